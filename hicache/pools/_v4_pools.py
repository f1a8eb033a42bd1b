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
from hicache.pools._geometry import Shape
from hicache.pools._forms import DEVICE_POOL, POOL_NAME, NamedConstructors, dispatch
from hicache.pools._hisparse import HiSparseHostPoolMixin
from hicache.pools._options import split_keywords

#: SGLang 0.5.23's name for DeepSeek-V4's window pool (`PoolName.SWA`): the one paged pool of its
#: group whose own allocator hands out the slots it copies
WINDOW_POOL = "swa"


class V4PagedShape(Shape):
    """DeepSeek-V4 paged builder: ``item_bytes`` per page row per layer (device ``kv_buffer``),
    raw bytes; the older form's pool has no ``pool_name``."""

    descriptor_class = DeepSeekV4PagedLayout
    row_attribute = "item_bytes"
    device_attribute = "kv_buffer"

    @property
    def row_bytes(self) -> int:
        return getattr(self.view, self.row_attribute)

    def token_bytes(self, layout, facts):
        return facts.layer_num * self.row_bytes // facts.page_size or 1

    def buffer_dtypes(self, layout, facts):
        import torch

        return (torch.uint8,) * len(self.descriptor(layout, facts, 1).buffers())

    def descriptor(self, layout, facts, page_num):
        return self.descriptor_class(layout, layer_num=facts.layer_num, page_num=page_num,
                                     **{self.row_attribute: self.row_bytes})

    def streams(self):
        attribute = self.device_attribute
        return (Stream(0, None, lambda pool, layer: getattr(pool, attribute)[layer], rows=True),)

    def fields(self, layout, facts):
        return {"pool_name": None, **super().fields(layout, facts)}


class V4StateShape(V4PagedShape):
    """DeepSeek-V4 state builder: a page row is ``ring_size`` slots of each state pool."""

    descriptor_class = DeepSeekV4StateLayout
    row_attribute = "state_page_bytes"
    device_attribute = "state_buffer"


def _paged_from_pool_name(pool, pool_name, device_buffers, item_bytes, num_host_pages, slot_page_size,
                          layout="layer_first", device="cpu", pin_memory=True, allocator_type="default",
                          page_aligned_only=False, *, options=None, host=None) -> None:
    """SGLang's paged constructor, every argument named."""
    from hicache.pools._deepseek_v4 import paged_device

    view, pages, page_size = paged_device(pool_name, device_buffers, item_bytes, num_host_pages, slot_page_size,
                                          page_aligned_only)
    _build_v4(pool, pool_name, view, pages, page_size, layout, device, pin_memory, allocator_type, options, host)


def _state_from_pool_name(pool, pool_name, state_pools, num_host_pages, swa_page_size, layout="layer_first",
                          device="cpu", pin_memory=True, allocator_type="default", *, options=None,
                          host=None) -> None:
    """SGLang's state constructor, every argument named."""
    from hicache.pools._deepseek_v4 import state_device

    view, pages, page_size = state_device(pool_name, state_pools, num_host_pages, swa_page_size)
    _build_v4(pool, pool_name, view, pages, page_size, layout, device, pin_memory, allocator_type, options, host)


class DeepSeekV4PagedHostPool(NamedConstructors, HiSparseHostPoolMixin, HostKVCache):
    """DeepSeek-V4 paged pool: ``item_bytes`` per page row per layer (device ``kv_buffer``).

    SGLang's constructor: ``DeepSeekV4PagedHostPool(pool_name, device_buffers, item_bytes,
    num_host_pages, slot_page_size, layout="layer_first", device="cpu", pin_memory=True,
    allocator_type="default")`` - transfers then copy to and from ``device_buffers`` whatever
    device pool the controller passes, as SGLang's does. The family-uniform constructor
    ``(device_pool, ratio, host_size, page_size, layout, ...)`` also works (a device pool with
    ``kv_buffer`` and ``item_bytes``).
    """

    pool_family = "deepseek_v4"
    shape_class = V4PagedShape
    builders = {POOL_NAME: _paged_from_pool_name, DEVICE_POOL: HostKVCache.__init__}

    def __init__(self, *args, **kwargs):
        """SGLang's ``pool_name`` form, or the family-uniform device-pool one (`_forms.dispatch`)."""
        dispatch(self, args, kwargs)

    def _host_view(self, stream, layer):
        if self.layout == "layer_first":  # one buffer per layer
            return self.buffers[layer]
        return super()._host_view(stream, layer)

    @property
    def own_slots(self) -> bool:
        """SGLang 0.5.23's V4 group hands out slots from two pools: its memoryless KV anchor
        (`LogicalHostPool`, every slot ready at once) and the window pool (pool name "swa"); every
        other paged pool (C4 KV, its index keys, C128, ...) copies at the KV anchor's slots, so
        it registers whole before it serves. The device-pool form (no pool name) allocates its own."""
        return self.pool_name in (None, WINDOW_POOL)

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

    shape_class = V4StateShape
    has_allocator = False
    builders = {POOL_NAME: _state_from_pool_name, DEVICE_POOL: HostKVCache.__init__}

    def alloc(self, need_size: int):
        return HostKVCache.alloc(self, need_size)


def _build_v4(pool, pool_name, device_pool, num_host_pages, page_size, layout, device, pin_memory, allocator_type,
              options, host) -> None:
    """A V4 pool of SGLang's ``pool_name`` form from its device view (`_deepseek_v4`)."""
    shape_class = type(pool).shape_class
    row_bytes = getattr(device_pool, shape_class.row_attribute)
    fields = {"pool_name": pool_name, "page_aligned_only": getattr(device_pool, "page_aligned_only", False),
              shape_class.row_attribute: row_bytes,  # item_bytes / state_page_bytes
              "device_buffers": getattr(device_pool, "kv_buffer", None) if shape_class is V4PagedShape else None,
              "num_host_pages": num_host_pages, "slot_page_size": page_size}
    sizing, settings = split_keywords(type(pool).__name__, dict(pin_memory=pin_memory, device=device,
                                                                 allocator_type=allocator_type, options=options,
                                                                 host=host),
                                      host_to_device_ratio=1.0, host_size=0, page_size=page_size,
                                      page_num=num_host_pages, size_per_token=row_bytes)  # SGLang's: one row's bytes
    pool._build(POOL_NAME, shape_class(device_pool, given=fields), sizing, layout, settings)
