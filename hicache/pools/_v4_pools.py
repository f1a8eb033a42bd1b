"""The DeepSeek-V4 host pools: paged (page rows per layer) and state (a ring of slots per
page, sharing the SWA pool's indices); SGLang's ``pool_name`` constructor read by `_deepseek_v4`.
"""

from __future__ import annotations


from hicache.plan import (
    DeepSeekV4PagedLayout,
    DeepSeekV4StateLayout,
)
from hicache.plan.checks import is_integer
from hicache.pools._base import HostKVCache, Stream
from hicache.pools._forms import POOL_NAME, NamedConstructors, form_of
from hicache.pools._hisparse import HiSparseHostPoolMixin
from hicache.pools._options import split_keywords


class DeepSeekV4PagedHostPool(NamedConstructors, HiSparseHostPoolMixin, HostKVCache):
    """DeepSeek-V4 paged pool: ``item_bytes`` per page row per layer (device ``kv_buffer``).

    SGLang's constructor: ``DeepSeekV4PagedHostPool(pool_name, device_buffers, item_bytes,
    num_host_pages, slot_page_size, layout="layer_first", device="cpu", pin_memory=True,
    allocator_type="default")`` - transfers then copy to and from ``device_buffers`` whatever
    device pool the controller passes, as SGLang's does. The family-uniform constructor
    ``(device_pool, ratio, host_size, page_size, layout, ...)`` also works (a device pool with
    ``kv_buffer`` and ``item_bytes``).
    """

    row_attribute = "item_bytes"
    device_attribute = "kv_buffer"

    pool_family = "deepseek_v4"

    def __init__(self, *args, **kwargs):
        if form_of(self.pool_family, args, kwargs) is POOL_NAME:
            _init_v4_from_sglang(self, *args, **kwargs)
        else:
            self.pool_name = None
            super().__init__(*args, **kwargs)

    @classmethod
    def descriptor_class(cls):
        return DeepSeekV4PagedLayout

    def get_size_per_token(self) -> int:
        return self.layer_num * getattr(self.device_pool, self.row_attribute) // self.page_size or 1

    def buffer_dtypes(self):
        import torch

        return [torch.uint8] * len(self.layout_descriptor(1).buffers())

    def layout_descriptor(self, page_num: int):
        return self.descriptor_class()(
            self.layout, layer_num=self.layer_num, page_num=page_num,
            **{self.row_attribute: getattr(self.device_pool, self.row_attribute)},
        )

    def _host_view(self, stream, layer):
        if self.layout == "layer_first":  # one buffer per layer
            return self.buffers[layer]
        return super()._host_view(stream, layer)

    def streams(self):
        attribute = self.device_attribute
        return [Stream(0, None, lambda pool, layer: getattr(pool, attribute)[layer], rows=True)]

    def alloc(self, need_size: int):
        """SGLang's V4 pools round ``need_size`` up to whole slot pages."""
        if self.pool_name is not None and is_integer(need_size) and need_size > 0:
            need_size = -(-need_size // self.page_size) * self.page_size
        return super().alloc(need_size)


class DeepSeekV4StateHostPool(DeepSeekV4PagedHostPool):
    """DeepSeek-V4 state pool (ring of slots per page); reuses the SWA pool's indices, so it
    has no allocator of its own.

    SGLang's constructor: ``DeepSeekV4StateHostPool(pool_name, state_pools, num_host_pages,
    swa_page_size, layout="layer_first", device="cpu", pin_memory=True,
    allocator_type="default")``: one page row is ``ring_size`` slots of each state pool's
    ``kv_score_buffer.kv_score`` (all pools share ring size and slot bytes).
    """

    row_attribute = "state_page_bytes"
    device_attribute = "state_buffer"
    has_allocator = False

    def alloc(self, need_size: int):
        return HostKVCache.alloc(self, need_size)

    @classmethod
    def descriptor_class(cls):
        return DeepSeekV4StateLayout


def _init_v4_from_sglang(pool, pool_name, *args, **kwargs):
    from hicache.pools._deepseek_v4 import paged_device, state_device

    if isinstance(pool, DeepSeekV4StateHostPool):
        device_pool, num_host_pages, page_size, rest, kwargs = state_device(pool_name, *args, **kwargs)
    else:
        device_pool, num_host_pages, page_size, rest, kwargs = paged_device(pool_name, *args, **kwargs)
    layout, device, pin_memory, allocator_type = rest
    pool.pool_name = pool_name
    row_bytes = getattr(device_pool, pool.row_attribute)
    sizing, options = split_keywords(type(pool).__name__, dict(kwargs, pin_memory=pin_memory, device=device,
                                                                allocator_type=allocator_type),
                                     host_to_device_ratio=1.0, host_size=0, page_size=page_size,
                                     page_num=num_host_pages, size_per_token=row_bytes)  # SGLang's: one row's bytes
    pool._build(POOL_NAME, device_pool, sizing, layout, options)
    pool.page_aligned_only = getattr(device_pool, "page_aligned_only", False)
    setattr(pool, pool.row_attribute, row_bytes)  # item_bytes / state_page_bytes
    pool.device_buffers = getattr(device_pool, "kv_buffer", None) if pool.row_attribute == "item_bytes" else None
    pool.num_host_pages, pool.slot_page_size = num_host_pages, page_size
