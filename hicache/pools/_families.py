"""The concrete host pools, one per SGLang family: their buffers and their device views.

Each class says only how big a token is, which layout descriptor it has, and which device
tensors its buffers pair with; sizing, allocation, registration and transfers are the base's.
Device pools are duck-typed on SGLang's attribute names (``k_buffer``/``v_buffer`` per layer for
MHA, ``kv_buffer`` for MLA, ``index_k_with_scale_buffer`` for the DSA indexer,
``mamba_cache.temporal``/``.conv`` for Mamba).
"""

from __future__ import annotations

from hicache.plan import (
    AsymmetricMHALayout,
    DeepSeekV4PagedLayout,
    DeepSeekV4StateLayout,
    DSAIndexerLayout,
    MambaLayout,
    MHAKOnlyLayout,
    MHALayout,
    MLALayout,
)
from hicache.pools._base import HostKVCache, Stream
from hicache.pools._hisparse import HiSparseHostPoolMixin


def _itemsize(dtype) -> int:
    import torch

    return torch.empty((), dtype=dtype).element_size()


class MHATokenToKVPoolHost(HostKVCache):
    """Multi-head attention: K and V in one buffer with a leading axis of 2."""

    @classmethod
    def descriptor_class(cls):
        return MHALayout

    def _dims(self):
        pool = self.device_pool
        return dict(layer_num=self.layer_num, head_num=pool.head_num, head_dim=pool.head_dim,
                    page_size=self.page_size, itemsize=_itemsize(self.dtype))

    def layout_descriptor(self, page_num: int):
        return self.descriptor_class()(self.layout, page_num=page_num, **self._dims())

    def streams(self):
        return [
            Stream(0, 0, lambda pool, layer: pool.k_buffer[layer]),
            Stream(0, 1, lambda pool, layer: pool.v_buffer[layer]),
        ]

    @property
    def k_buffer(self):
        """The K half of ``kv_buffer`` (a view), as SGLang's MHA host pool exposes it."""
        return self.buffers[0][0]

    @property
    def v_buffer(self):
        """The V half of ``kv_buffer`` (a view); storage back ends branch on its presence."""
        return self.buffers[0][1]


def get_mha_host_pool_cls(device_pool):
    """SGLang's chooser: the asymmetric MHA host pool when K and V head dims differ."""
    head_dim = getattr(device_pool, "head_dim", None)
    v_head_dim = getattr(device_pool, "v_head_dim", head_dim)
    if head_dim is None and hasattr(device_pool, "k_head_dim"):
        head_dim = device_pool.k_head_dim
    return AsymmetricMHATokenToKVPoolHost if v_head_dim != head_dim else MHATokenToKVPoolHost


class MHATokenToKOnlyPoolHost(MHATokenToKVPoolHost):
    """MHA keys only (the index-K of sparse-attention models); sized like its anchor pool."""

    @classmethod
    def descriptor_class(cls):
        return MHAKOnlyLayout

    def streams(self):
        return [Stream(0, None, lambda pool, layer: pool.k_buffer[layer])]


class AsymmetricMHATokenToKVPoolHost(HostKVCache):
    """MHA with different K and V head dims: buffers ``k`` and ``v``."""

    @classmethod
    def descriptor_class(cls):
        return AsymmetricMHALayout

    def layout_descriptor(self, page_num: int):
        pool = self.device_pool
        return AsymmetricMHALayout(
            self.layout, layer_num=self.layer_num, head_num=pool.head_num, k_head_dim=pool.k_head_dim,
            v_head_dim=pool.v_head_dim, page_size=self.page_size, page_num=page_num,
            itemsize=_itemsize(self.dtype),
        )

    def streams(self):
        return [
            Stream(0, None, lambda pool, layer: pool.k_buffer[layer]),
            Stream(1, None, lambda pool, layer: pool.v_buffer[layer]),
        ]


class MLATokenToKVPoolHost(HiSparseHostPoolMixin, HostKVCache):
    """Multi-head latent attention: one ``kv_lora_rank + qk_rope_head_dim`` vector per token
    (``override_kv_cache_dim``: another width, as SGLang's HiSparse coordinator passes the
    device pool's ``kv_cache_dim``; ``token_stride_size`` is its bytes)."""

    def __init__(self, device_pool, host_to_device_ratio, host_size, page_size, layout, pin_memory=True,
                 device="cpu", allocator_type="default", *, override_kv_cache_dim=None, **kwargs):
        pool = device_pool
        self.kv_cache_dim = override_kv_cache_dim or pool.kv_lora_rank + pool.qk_rope_head_dim
        super().__init__(device_pool, host_to_device_ratio, host_size, page_size, layout, pin_memory, device,
                         allocator_type, **kwargs)
        self.token_stride_size = self.kv_cache_dim * _itemsize(self.dtype)

    @classmethod
    def descriptor_class(cls):
        return MLALayout

    def layout_descriptor(self, page_num: int):
        return MLALayout(
            self.layout, layer_num=self.layer_num, kv_cache_dim=self.kv_cache_dim,
            page_size=self.page_size, page_num=page_num, itemsize=_itemsize(self.dtype),
        )

    def streams(self):
        return [Stream(0, None, lambda pool, layer: pool.kv_buffer[layer])]


class DSAIndexerPoolHost(HostKVCache):
    """DeepSeek sparse-attention index keys (FP8 + fp32 scales, uint8), in whole page rows.

    Pass ``anchor_pool`` (the MLA host pool) to size it as SGLang does: ``(tokens + page_size
    + 1) // page_size`` pages.
    """

    def __init__(self, device_pool, host_to_device_ratio, host_size, page_size, layout, pin_memory, device,
                 allocator_type="default", *, anchor_pool=None, **kwargs):
        if anchor_pool is not None:
            kwargs.setdefault("page_num", (anchor_pool.size + page_size + 1) // page_size)
        super().__init__(device_pool, host_to_device_ratio, host_size, page_size, layout, pin_memory,
                         device, allocator_type, **kwargs)

    @classmethod
    def descriptor_class(cls):
        return DSAIndexerLayout

    def buffer_dtypes(self):
        import torch

        return [torch.uint8]

    def layout_descriptor(self, page_num: int):
        pool = self.device_pool
        return DSAIndexerLayout(
            self.layout, layer_num=self.layer_num, index_head_dim=pool.index_head_dim,
            page_size=self.page_size, page_num=page_num,
            quant_block_size=getattr(pool, "quant_block_size", 128),
        )

    def streams(self):
        return [Stream(0, None, lambda pool, layer: pool.index_k_with_scale_buffer[layer], rows=True)]


class MambaPoolHost(HostKVCache):
    """Linear-attention state: one slot per request (page size 1), temporal + conv states.

    SGLang's constructor: ``MambaPoolHost(mamba_pool, ratio, size, pin_memory=True,
    device="cpu", allocator_type="default", layout="layer_first")`` - no page size; like
    SGLang's, only the page-first layouts are supported, so callers pass ``layout``. The device
    pool is SGLang's `MambaPool` (``num_mamba_layers``, ``mamba_cache.temporal`` / ``.conv``,
    ``size``, ``device``; no ``store_dtype`` or ``layer_num``).
    """

    def __init__(self, device_pool, host_to_device_ratio, host_size, pin_memory=True, device="cpu",
                 allocator_type="default", layout="layer_first", **kwargs):
        super().__init__(device_pool, host_to_device_ratio, host_size, 1, layout, pin_memory, device,
                         allocator_type, **kwargs)

    @classmethod
    def descriptor_class(cls):
        return MambaLayout

    def _layer_count(self, device_pool) -> int:
        layers = getattr(device_pool, "num_mamba_layers", None)
        return layers if layers is not None else device_pool.mamba_cache.temporal.shape[0]

    def _store_dtype(self, device_pool):
        cache = device_pool.mamba_cache
        return cache.conv[0].dtype if cache.conv else cache.temporal.dtype

    def _states(self):
        cache = self.device_pool.mamba_cache
        return [cache.temporal, *cache.conv]

    def buffer_dtypes(self):
        return [t.dtype for t in self._states() if t[0, 0].numel()]

    def layout_descriptor(self, page_num: int):
        cache = self.device_pool.mamba_cache
        return MambaLayout(
            self.layout, layer_num=self.layer_num, slots=page_num,
            temporal_shape=tuple(cache.temporal.shape[2:]), temporal_itemsize=cache.temporal.element_size(),
            conv_shapes=tuple(tuple(c.shape[2:]) for c in cache.conv),
            conv_itemsize=cache.conv[0].element_size() if cache.conv else 1,
        )

    def streams(self):
        states = [i for i, t in enumerate(self._states()) if t[0, 0].numel()]
        return [
            Stream(buffer, None, lambda pool, layer, i=i: ([pool.mamba_cache.temporal, *pool.mamba_cache.conv][i])[layer])
            for buffer, i in enumerate(states)
        ]


class DeepSeekV4PagedHostPool(HiSparseHostPoolMixin, HostKVCache):
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

    def __init__(self, *args, **kwargs):
        if (args and isinstance(args[0], str)) or "pool_name" in kwargs:
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

        return [torch.uint8] * len(self.descriptor.buffers())

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

    def _transfer(self, device_pool, *args, **kwargs):
        if self.pool_name is not None:  # SGLang's: the device buffers given at construction
            device_pool = self.device_pool
        return super()._transfer(device_pool, *args, **kwargs)

    def alloc(self, need_size: int):
        """SGLang's V4 pools round ``need_size`` up to whole slot pages."""
        if self.pool_name is not None and isinstance(need_size, int) and not isinstance(need_size, bool) and need_size > 0:
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
    HostKVCache.__init__(pool, device_pool, 1.0, 0, page_size, layout, pin_memory, device, allocator_type,
                         page_num=num_host_pages, **kwargs)
    pool.size_per_token = getattr(device_pool, pool.row_attribute)  # SGLang's: one row's bytes
