"""The concrete host pools, one per SGLang family: their buffers and their device views.

Each class says only how big a token is, which layout descriptor it has, and which device
tensors its buffers pair with; sizing, allocation, registration and transfers are the base's.
Device pools are duck-typed on SGLang's attribute names (``k_buffer``/``v_buffer`` per layer for
MHA, ``kv_buffer`` for MLA, ``index_k_with_scale_buffer`` for the DSA indexer,
``mamba_cache.temporal``/``.conv`` for Mamba).
"""

from __future__ import annotations

import math

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
from hicache.errors import LayoutError, TransferError
from hicache.plan import dsa_indexer_pages
from hicache.plan.checks import check_int, is_integer
from hicache.pools._base import HostKVCache, Stream
from hicache.pools._hisparse import HiSparseHostPoolMixin
from hicache.pools._page_allocator import PageAllocator
from hicache.pools._sglang_inputs import (
    dsa_device,
    is_mamba_info,
    is_mha_info,
    is_mla_allocation,
    is_mla_info,
    mamba_device,
    mha_device,
    mla_device,
)


def _itemsize(dtype) -> int:
    import torch

    return torch.empty((), dtype=dtype).element_size()


def _k_only_args(owner: str, args, kwargs) -> tuple:
    """``layout, pin_memory=True, device="cpu", allocator_type="default"`` after the anchor (by
    position or keyword); hicache's own keywords stay in ``kwargs``."""
    kwargs.pop("anchor_host", None)
    names = ("layout", "pin_memory", "device", "allocator_type")
    values = dict(zip(names, args))
    if len(args) > len(names):
        raise TypeError(f"{owner}() takes at most {2 + len(names)} positional arguments")
    for name in names:
        if name in kwargs:
            if name in values:
                raise TypeError(f"{owner}() got multiple values for argument {name!r}")
            values[name] = kwargs.pop(name)
    if "layout" not in values:
        raise TypeError(f"{owner}() missing the argument 'layout'")
    return values["layout"], values.get("pin_memory", True), values.get("device", "cpu"), \
        values.get("allocator_type", "default")


def _first(pool, buffer_info, device_pool):
    """The first argument: 0.5.23's ``buffer_info`` or the older SGLang's ``device_pool`` (either
    may come by keyword, as SGLang's HiSparse coordinator passes them), exactly one of them."""
    if (buffer_info is None) == (device_pool is None):
        raise TypeError(f"{type(pool).__name__}() takes a device-buffer description (buffer_info, SGLang 0.5.23) or a "
                        "device pool (device_pool, older SGLang) first - exactly one")
    return buffer_info if buffer_info is not None else device_pool


def _mha_input(pool, first, drafts, write_back_staging, head_group_num, kwargs):
    """SGLang 0.5.23's MHA form (an `MHABufferInfo` first) -> its `BufferDevice`; the older
    form (a device pool first) as it is. Keywords only 0.5.23 has are refused with a pool."""
    name = type(pool).__name__
    head_group_num = check_int(LayoutError, name, "head_group_num", head_group_num)
    pool.head_group_num = head_group_num  # only SGLang's page_unified layout groups heads
    pool.write_back_staging = write_back_staging  # SGLang's CUDA write-back kernel's staging; unused here
    if is_mha_info(first):
        return mha_device(name, first, tuple(drafts), device_capacity_tokens=kwargs.get("device_capacity_tokens") or 0,
                          start_layer=kwargs.get("start_layer") or 0)
    if drafts:
        raise LayoutError(f"{name}: draft_buffer_infos come with SGLang 0.5.23's constructor (an MHABufferInfo first)")
    return first


class _MHAForms:
    """The MHA families' constructors: SGLang 0.5.23's (an `MHABufferInfo` first, its packed
    drafts, staging and head groups) or the older one (a device pool first), then the family's
    geometry fields (`_mha_geometry`)."""

    def __init__(self, buffer_info=None, host_to_device_ratio=None, host_size=None, page_size=None, layout=None,
                 pin_memory=True, device="cpu", allocator_type="default", *, draft_buffer_infos=(),
                 write_back_staging=None, head_group_num=1, device_pool=None, **kwargs):
        first = _mha_input(self, _first(self, buffer_info, device_pool), draft_buffer_infos, write_back_staging,
                           head_group_num, kwargs)
        super().__init__(first, host_to_device_ratio, host_size, page_size, layout, pin_memory, device,
                         allocator_type, **kwargs)
        self._mha_geometry()


class MHATokenToKVPoolHost(_MHAForms, HostKVCache):
    """Multi-head attention: K and V in one buffer with a leading axis of 2.

    SGLang 0.5.23's constructor: ``(buffer_info: MHABufferInfo, host_to_device_ratio,
    host_size, page_size, layout, pin_memory=True, device="cpu", allocator_type="default", *,
    device_capacity_tokens, start_layer, end_layer, draft_buffer_infos=(),
    write_back_staging=None, pool_label="kv", head_group_num=1, host_token_capacity=None)``;
    the older SGLang's (a device pool first) still works, chosen by the first argument's type.
    """

    def _mha_geometry(self) -> None:
        """SGLang's MHA fields: heads, widths, bytes of one token row and of one token's layers."""
        pool = self.device_pool
        self.head_num = pool.head_num
        self.head_dim = getattr(pool, "head_dim", None) or pool.k_head_dim
        self.v_head_dim = getattr(pool, "v_head_dim", None) or self.head_dim
        self.element_dim = self.head_num * self.head_dim
        self.token_stride_size = self.element_dim * _itemsize(self.dtype)
        self.layout_dim = self.token_stride_size * self.layer_num

    def get_hybrid_pool_buffer(self) -> list:
        """The K and V host tensors a zero-copy back end registers."""
        return [self.k_buffer, self.v_buffer]

    def get_split_heads_page_buffer_meta(self, indices, split_factor: int):
        """Zero-copy pointers for heterogeneous TP (mooncake, umbp): per page, per group of
        ``head_num // split_factor`` heads, a K and a V block - layout page_head only, as SGLang's."""
        return _split_heads_meta(self, indices, split_factor)

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
    """MHA keys only (the index-K of sparse-attention models); sized like its anchor pool.

    SGLang 0.5.23's constructor: ``(device_pool, anchor_host, layout, pin_memory=True,
    device="cpu", allocator_type="default")`` - the anchor's page size and page count, the
    device pool's layers; ``k_buffer`` is the one host tensor (no ``v_buffer``). The older
    form ``(device_pool, ratio, host_size, page_size, layout, ..., page_num=)`` still works,
    chosen by the second argument (a host pool, not a number)."""

    def __init__(self, device_pool=None, *args, **kwargs):
        anchor = args[0] if args else kwargs.get("anchor_host")
        if anchor is not None and hasattr(anchor, "page_num") and hasattr(anchor, "page_size"):
            layout, pin_memory, device, allocator_type = _k_only_args(type(self).__name__, args[1:], kwargs)
            super().__init__(device_pool, 1.0, 0, anchor.page_size, layout, pin_memory, device, allocator_type,
                             page_num=anchor.page_num, **kwargs)
            self.end_layer = getattr(device_pool, "end_layer", self.end_layer)  # SGLang's: the device pool's
            return
        super().__init__(device_pool, *args, **kwargs)

    @property
    def k_buffer(self):
        """The one host tensor (keys of every layer)."""
        return self.buffers[0]

    @property
    def v_buffer(self):
        raise AttributeError(f"{type(self).__name__} holds no V")  # back ends branch on hasattr(v_buffer)

    def get_hybrid_pool_buffer(self) -> list:
        return [self.k_buffer]

    @classmethod
    def descriptor_class(cls):
        return MHAKOnlyLayout

    def streams(self):
        return [Stream(0, None, lambda pool, layer: pool.k_buffer[layer])]


class AsymmetricMHATokenToKVPoolHost(_MHAForms, HostKVCache):
    """MHA with different K and V head dims: buffers ``k`` and ``v``. Constructors as
    `MHATokenToKVPoolHost` (0.5.23's with an `MHABufferInfo` whose ``v_head_dim`` differs)."""

    def _mha_geometry(self) -> None:
        pool = self.device_pool
        self.head_num = pool.head_num
        self.head_dim = getattr(pool, "head_dim", None) or pool.k_head_dim
        self.v_head_dim = pool.v_head_dim
        # no token_stride_size / layout_dim: K and V rows differ, and SGLang's pool leaves them
        # unset on purpose so a caller reaching for one shared stride fails loudly

    def get_ksize_per_token(self) -> int:
        """Bytes of one token's K over all layers (its V is narrower or wider)."""
        return self.head_dim * self.head_num * self.layer_num * _itemsize(self.dtype)

    @property
    def k_buffer(self):
        return self.buffers[0]

    @property
    def v_buffer(self):
        return self.buffers[1]

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
    device pool's ``kv_cache_dim``; ``token_stride_size`` is its bytes).

    SGLang 0.5.23's constructor: ``(buffer_info: MLABufferInfo | MLAHostAllocation,
    host_to_device_ratio, host_size, page_size, layout, pin_memory=True, device="cpu",
    allocator_type="default", override_kv_cache_dim=None, draft_buffer_infos=(), dcp_size=1,
    dcp_rank=0, *, device_capacity_tokens, start_layer, end_layer, target_layer_num,
    layer_shard_enabled=False, pool_label="kv", host_token_capacity=None)`` - an
    `MLAHostAllocation` makes SGLang's allocator-only pool (``is_dummy``: indices, no memory).
    The older SGLang's (a device pool first) still works, chosen by the first argument's type.
    """

    def __init__(self, buffer_info=None, host_to_device_ratio=None, host_size=None, page_size=None, layout=None,
                 pin_memory=True, device="cpu", allocator_type="default", override_kv_cache_dim=None,
                 draft_buffer_infos=(), dcp_size=1, dcp_rank=0, *, target_layer_num=None, layer_shard_enabled=False,
                 device_pool=None, **kwargs):
        name = type(self).__name__
        first = _first(self, buffer_info, device_pool)
        self.override_kv_cache_dim = override_kv_cache_dim
        self._allocation_size_per_token = None
        if is_mla_info(first):
            if target_layer_num is None:
                raise LayoutError(f"{name}: SGLang 0.5.23's constructor needs the keyword target_layer_num")
            dummy = is_mla_allocation(first)
            self.dsa_kv_cache_store_fp8 = bool(getattr(first, "packed_fp8", False))
            default_dim = first.kv_cache_dim if dummy else first.kv_lora_rank + first.qk_rope_head_dim
            self.kv_cache_dim = override_kv_cache_dim or default_dim
            if dummy:
                self._allocation_size_per_token = int(first.size_per_token)
                kwargs["is_dummy"] = True
            first = mla_device(name, first, tuple(draft_buffer_infos),
                               device_capacity_tokens=kwargs.get("device_capacity_tokens") or 0,
                               start_layer=kwargs.get("start_layer") or 0, target_layer_num=target_layer_num,
                               layer_shard_enabled=layer_shard_enabled)
            kwargs.update(dcp_size=dcp_size, dcp_rank=dcp_rank)
        else:
            if draft_buffer_infos or dcp_size != 1 or target_layer_num is not None or layer_shard_enabled:
                raise LayoutError(f"{name}: draft_buffer_infos, dcp_size, target_layer_num and layer_shard_enabled "
                                  "come with SGLang 0.5.23's constructor (an MLABufferInfo first)")
            self.dsa_kv_cache_store_fp8 = False
            self.kv_cache_dim = override_kv_cache_dim or first.kv_lora_rank + first.qk_rope_head_dim
        self.kv_lora_rank = first.kv_lora_rank
        self.qk_rope_head_dim = first.qk_rope_head_dim
        super().__init__(first, host_to_device_ratio, host_size, page_size, layout, pin_memory, device,
                         allocator_type, **kwargs)
        self.token_stride_size = self.kv_cache_dim * _itemsize(self.dtype)
        self.layout_dim = self.token_stride_size * self.layer_num

    def get_size_per_token(self) -> int:
        if self._allocation_size_per_token is not None:  # MLAHostAllocation says it
            return self._allocation_size_per_token
        return super().get_size_per_token()

    def get_contiguous_buf_infos(self):
        """``(data_ptrs, data_lens, item_lens)`` per layer, as SGLang's MLA host pool reports them
        to the disaggregation transfer engine (its per-layer references and lengths)."""
        if self.is_dummy:
            return [], [], []
        buffer = self.buffers[0]
        refs = buffer.transpose(0, 1) if self.layout == "page_first" else buffer
        data_ptrs = [refs[i].data_ptr() for i in range(self.layer_num)]
        data_lens = [buffer[i].nbytes for i in range(self.layer_num)]
        return data_ptrs, data_lens, [self.token_stride_size * self.page_size] * self.layer_num

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

    SGLang 0.5.23's constructor: ``(decl: HostPoolDecl, anchor_host, *,
    packed_draft_device_pools=(), pin_memory=True, device="cpu", allocator_type="default",
    is_dummy=False)`` - the declaration's device pool and owned layers (then one host layer per
    packed draft pool), the anchor's page size, layout and size, `hicache.plan.dsa_indexer_pages`
    of its size; copies to the declared device tensors. The older form
    ``(device_pool, ratio, host_size, page_size, layout, pin_memory, device, allocator_type, *,
    anchor_pool=None)`` still works, chosen by the first argument (a declaration or a pool).
    """

    def __init__(self, *args, anchor_pool=None, **kwargs):
        first = args[0] if args else kwargs.get("decl")
        if first is not None and hasattr(first, "storage_info") and hasattr(first, "device_pool"):
            return _init_dsa_from_decl(self, *args, **kwargs)
        if anchor_pool is not None:
            page_size = args[3] if len(args) > 3 else kwargs["page_size"]
            kwargs.setdefault("page_num", dsa_indexer_pages(anchor_pool.size, page_size))
        super().__init__(*args, **kwargs)

    def get_hybrid_pool_buffer(self) -> list:
        return [self.index_k_with_scale_buffer]

    @property
    def index_k_with_scale_buffer(self):
        """The host index buffer (SGLang's name)."""
        return self.buffers[0]

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

    SGLang 0.5.23's constructor: ``MambaPoolHost(buffer_info: MambaStateBufferInfo,
    host_to_device_ratio, host_size, *, device_capacity, pin_memory=True, device="cpu",
    allocator_type="default", layout="layer_first", mtp_draft_buffer_infos=())`` - sized as
    SGLang's (a padding slot), copies to the described device tensors (targets, then the packed
    draft layers); flat pages are raw bytes. The older SGLang's ``MambaPoolHost(mamba_pool, ratio,
    size, pin_memory=True, device="cpu", allocator_type="default", layout="layer_first")`` (a
    `MambaPool`: ``num_mamba_layers``, ``mamba_cache.temporal`` / ``.conv``) still works. Like
    SGLang's, only the page-first layouts are supported, so callers pass ``layout``.
    """

    def __init__(self, buffer_info=None, host_to_device_ratio=None, host_size=None, pin_memory=True, device="cpu",
                 allocator_type="default", layout="layer_first", *, device_capacity=None, mtp_draft_buffer_infos=(),
                 device_pool=None, **kwargs):
        first = _first(self, buffer_info, device_pool)
        if is_mamba_info(first):
            first = mamba_device(type(self).__name__, first, tuple(mtp_draft_buffer_infos),
                                 device_capacity=device_capacity or 0)
            self.mtp_draft_buffer_infos = tuple(mtp_draft_buffer_infos)
            kwargs.update(device_capacity_tokens=device_capacity, start_layer=0, end_layer=first.layer_num)
        elif mtp_draft_buffer_infos or device_capacity is not None:
            raise LayoutError(f"{type(self).__name__}: device_capacity and mtp_draft_buffer_infos come with SGLang "
                              "0.5.23's constructor (a MambaStateBufferInfo first)")
        self._states_facts = _mamba_states(first)
        super().__init__(first, host_to_device_ratio, host_size, 1, layout, pin_memory, device, allocator_type,
                         **kwargs)
        if self.sglang_form == "0.5.23":
            self.num_mamba_layers = self.layer_num
            # SGLang's Mamba pool says True so HostPoolGroup's AND keeps its MLA sibling's
            # staged write-back; its own backup routes by layout and backend, as this one does
            self.can_use_write_back_jit = True

    @classmethod
    def descriptor_class(cls):
        return MambaLayout

    def _layer_count(self, device_pool) -> int:
        layers = getattr(device_pool, "num_mamba_layers", None)
        return layers if layers is not None else device_pool.mamba_cache.temporal.shape[0]

    def _store_dtype(self, device_pool):
        facts = self._states_facts
        return facts[1][1] if len(facts) > 1 else facts[0][1]

    def buffer_dtypes(self):
        return [dtype for shape, dtype in self._states_facts if math.prod(shape)]

    def layout_descriptor(self, page_num: int):
        (temporal_shape, temporal_dtype), *convs = self._states_facts
        return MambaLayout(
            self.layout, layer_num=self.layer_num, slots=page_num,
            temporal_shape=tuple(temporal_shape), temporal_itemsize=_itemsize(temporal_dtype),
            conv_shapes=tuple(tuple(shape) for shape, _ in convs),
            conv_itemsize=_itemsize(convs[0][1]) if convs else 1,
        )

    def streams(self):
        states = [i for i, (shape, _) in enumerate(self._states_facts) if math.prod(shape)]
        return [
            Stream(buffer, None, lambda pool, layer, i=i: ([pool.mamba_cache.temporal, *pool.mamba_cache.conv][i])[layer])
            for buffer, i in enumerate(states)
        ]

    def load_to_device_per_layer(self, device_pool, host_indices, device_indices, layer_id, io_backend="kernel", *,
                                 is_draft: bool = False) -> None:
        """As every pool's; ``io_backend`` defaults to "kernel" as SGLang's Mamba pool's does
        (hicache copies with "direct"; "kernel" is an error naming what it supports)."""
        super().load_to_device_per_layer(device_pool, host_indices, device_indices, layer_id, io_backend,
                                         is_draft=is_draft)

    def backup_from_device_all_layer(self, device_pool, host_indices, device_indices, io_backend="kernel") -> None:
        super().backup_from_device_all_layer(device_pool, host_indices, device_indices, io_backend)

    @property
    def temporal_buffer(self):
        """The temporal state's host tensor (SGLang's name; None for a conv-only model)."""
        return self.buffers[0] if math.prod(self._states_facts[0][0]) else None

    @property
    def conv_buffer(self) -> list:
        """The conv states' host tensors (SGLang's name)."""
        return self.buffers[1:] if math.prod(self._states_facts[0][0]) else list(self.buffers)

    def get_data_page(self, index, flat: bool = True):
        """0.5.23: the slot's bytes, state by state (SGLang's L3 format for Mamba)."""
        if self.sglang_form != "0.5.23":
            return super().get_data_page(index, flat)
        import torch

        return torch.cat([part.contiguous().view(torch.uint8).reshape(-1) for part in self._page_parts(index)])

    def get_dummy_flat_data_page(self):
        if self.sglang_form != "0.5.23":
            return super().get_dummy_flat_data_page()
        import torch

        return torch.zeros(self.page_size * self.size_per_token, dtype=torch.uint8)

    def set_from_flat_data_page(self, index, data_page) -> None:
        if self.sglang_form != "0.5.23":
            return super().set_from_flat_data_page(index, data_page)
        import torch

        parts = self._page_parts(index)
        flat = data_page.contiguous().view(torch.uint8).reshape(-1)
        expected = sum(part.numel() * part.element_size() for part in parts)
        if flat.numel() != expected:
            raise TransferError(f"a Mamba state page holds {expected} bytes, data_page has {flat.numel()}")
        offset = 0
        for part in parts:
            size = part.numel() * part.element_size()
            part.copy_(flat[offset : offset + size].clone().view(part.dtype).reshape(part.shape))
            offset += size


def _mamba_states(first) -> list:
    """``[(state shape, dtype)]``: temporal, then each conv state - from a `MambaPool`'s
    ``mamba_cache`` or a 0.5.23 description's adapter."""
    if hasattr(first, "mamba_facts"):
        return list(first.mamba_facts)
    cache = first.mamba_cache
    return [(tuple(cache.temporal.shape[2:]), cache.temporal.dtype),
            *[(tuple(conv.shape[2:]), conv.dtype) for conv in cache.conv]]


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
    HostKVCache.__init__(pool, device_pool, 1.0, 0, page_size, layout, pin_memory, device, allocator_type,
                         page_num=num_host_pages, **kwargs)
    pool.size_per_token = getattr(device_pool, pool.row_attribute)  # SGLang's: one row's bytes
    pool.page_aligned_only = getattr(device_pool, "page_aligned_only", False)
    setattr(pool, pool.row_attribute, getattr(device_pool, pool.row_attribute))  # item_bytes / state_page_bytes
    pool.device_buffers = getattr(device_pool, "kv_buffer", None) if pool.row_attribute == "item_bytes" else None
    pool.num_host_pages, pool.slot_page_size = num_host_pages, page_size


def _split_heads_meta(pool, indices, split_factor: int):
    """SGLang's ``get_split_heads_page_buffer_meta`` for an MHA page_head pool: for each page,
    for each head group, the K block and the V block (``layer_num * page_size * head_num *
    head_dim / split_factor`` elements each), pointers inside the host buffer."""
    if pool.layout != "page_head":
        raise TransferError(f"{type(pool).__name__}: split-heads page meta needs layout page_head, not {pool.layout!r}")
    if not is_integer(split_factor) or split_factor < 1 or pool.head_num % split_factor:
        raise TransferError(f"split_factor must divide head_num={pool.head_num}, got {split_factor!r}")
    pages = pool._meta_pages(indices)
    itemsize = _itemsize(pool.dtype)
    base = pool.buffers[0].data_ptr()
    page_bytes = pool.layer_num * pool.head_num * pool.head_dim * itemsize * pool.page_size
    head_bytes = pool.page_size * pool.layer_num * pool.head_dim * itemsize
    v_offset = pool.layer_num * pool.size * pool.head_num * pool.head_dim * itemsize
    step = pool.head_num // split_factor
    ptrs = []
    for page in pages:
        for head in range(0, pool.head_num, step):
            k_ptr = base + page * page_bytes + head * head_bytes
            ptrs += (k_ptr, k_ptr + v_offset)
    return ptrs, [page_bytes // split_factor] * len(ptrs)


def _init_dsa_from_decl(pool, decl, anchor_host, *, packed_draft_device_pools=(), pin_memory=True, device="cpu",
                        allocator_type="default", is_dummy=False, **kwargs):
    """SGLang 0.5.23's DSA indexer host pool from its `HostPoolDecl`, beside ``anchor_host``."""
    name = type(pool).__name__
    view = dsa_device(name, decl, tuple(packed_draft_device_pools), anchor_host)
    page_size = anchor_host.page_size
    storage = decl.storage_info
    geometry = DSAIndexerLayout(anchor_host.layout, layer_num=view.layer_num, index_head_dim=view.index_head_dim,
                                page_size=page_size, page_num=1, quant_block_size=view.quant_block_size)
    if geometry.bytes_per_token_per_layer() != storage.bytes_per_token_per_layer:  # before any memory
        raise LayoutError(f"{name}: the declaration stores {storage.bytes_per_token_per_layer} bytes per token and "
                          f"layer, the device pool's index geometry {geometry.bytes_per_token_per_layer()}")
    pool.decl = decl
    pool.mtp_draft_device_pools = tuple(packed_draft_device_pools)
    indexer_page_num = dsa_indexer_pages(anchor_host.size, page_size)
    HostKVCache.__init__(pool, view, 1.0, 0, page_size, anchor_host.layout, pin_memory, device, allocator_type,
                         page_num=indexer_page_num, is_dummy=is_dummy, device_capacity_tokens=anchor_host.size,
                         start_layer=view.start_layer, end_layer=getattr(decl.device_pool, "end_layer", view.layer_num),
                         **kwargs)
    # SGLang's fields: the anchor's slots and pages; the buffer holds indexer_page_num pages
    pool.indexer_page_num = indexer_page_num
    pool.indexer_dtype = storage.dtype
    pool.indexer_page_stride_size = storage.page_bytes(page_size)
    pool.indexer_layout_dim = pool.indexer_page_stride_size * pool.layer_num
    pool.size, pool.page_num = anchor_host.size, anchor_host.page_num
    if pool._readiness is None and pool._pages is not None:  # slots as SGLang's: the anchor's
        pool._pages = PageAllocator(anchor_host.page_num, pool.logical_page_size)
