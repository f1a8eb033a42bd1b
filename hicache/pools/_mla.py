"""The MLA host pool (one latent ``kv_buffer`` per layer) and the DSA indexer beside its MLA
anchor (``index_k_with_scale_buffer``: page rows of FP8 keys and scales), both of SGLang 0.5.23's
constructor forms (told apart by `_forms`; each makes the pool's `_geometry`). Allocation,
registration and transfers are the base's.
"""

from __future__ import annotations

import attrs

from hicache.plan import (
    DSAIndexerLayout,
    MLALayout,
)
from hicache.errors import LayoutError
from hicache.plan.checks import check_int
from hicache.plan import dsa_indexer_pages
from hicache.pools._base import HostKVCache, Stream
from hicache.pools._hisparse import HiSparseHostPoolMixin
from hicache.pools._geometry import Shape
from hicache.pools._forms import DECLARATION, DEVICE_POOL, NamedConstructors, dispatch, form_of
from hicache.pools._options import given, split_keywords
from hicache.pools._sglang_inputs import dsa_device, mla_device, older_device_pool

from hicache.pools._family_base import _first, _itemsize


@attrs.frozen(eq=False)
class MLAShape(Shape):
    """MLA's builder: one ``kv_cache_dim`` latent row per token and layer (``token_bytes``:
    what an `MLAHostAllocation` says a token takes, where it says it)."""

    descriptor_class = MLALayout
    kv_cache_dim: int = attrs.field(kw_only=True)
    allocation_token_bytes: int | None = attrs.field(kw_only=True, default=None)

    def descriptor(self, layout, facts, page_num):
        return MLALayout(layout, layer_num=facts.layer_num, kv_cache_dim=self.kv_cache_dim,
                         page_size=facts.page_size, page_num=page_num, itemsize=_itemsize(facts.dtype))

    def streams(self):
        return (Stream(0, None, lambda pool, layer: pool.kv_buffer[layer]),)

    def token_bytes(self, layout, facts):
        if self.allocation_token_bytes is not None:  # MLAHostAllocation says it
            return self.allocation_token_bytes
        return super().token_bytes(layout, facts)

    def fields(self, layout, facts):
        token_stride_size = self.kv_cache_dim * _itemsize(facts.dtype)
        return {**super().fields(layout, facts), "kv_cache_dim": self.kv_cache_dim,
                "kv_lora_rank": self.view.kv_lora_rank, "qk_rope_head_dim": self.view.qk_rope_head_dim,
                "token_stride_size": token_stride_size, "layout_dim": token_stride_size * facts.layer_num}


class DSAShape(Shape):
    """The DSA indexer's builder: page rows of FP8 keys and fp32 scales, uint8 (``given``: the
    declaration form's SGLang fields, `_dsa_fields`)."""

    descriptor_class = DSAIndexerLayout

    def descriptor(self, layout, facts, page_num):
        view = self.view
        return DSAIndexerLayout(layout, layer_num=facts.layer_num, index_head_dim=view.index_head_dim,
                                page_size=facts.page_size, page_num=page_num,
                                quant_block_size=getattr(view, "quant_block_size", 128))

    def buffer_dtypes(self, layout, facts):
        import torch

        return (torch.uint8,)

    def streams(self):
        return (Stream(0, None, lambda pool, layer: pool.index_k_with_scale_buffer[layer], rows=True),)

    def fields(self, layout, facts):
        fields = super().fields(layout, facts)
        if "indexer_page_stride_size" in fields:  # the declaration form's
            fields["indexer_layout_dim"] = fields["indexer_page_stride_size"] * facts.layer_num
        return fields


class MLATokenToKVPoolHost(NamedConstructors, HiSparseHostPoolMixin, HostKVCache):
    """Multi-head latent attention: one ``kv_lora_rank + qk_rope_head_dim`` vector per token
    (``override_kv_cache_dim``: another width, as SGLang's HiSparse coordinator passes the
    device pool's ``kv_cache_dim``; ``token_stride_size`` is its bytes).

    SGLang 0.5.23's constructor: ``(buffer_info: MLABufferInfo | MLAHostAllocation,
    host_to_device_ratio, host_size, page_size, layout, pin_memory=True, device="cpu",
    allocator_type="default", override_kv_cache_dim=None, draft_buffer_infos=(), dcp_size=1,
    dcp_rank=0, *, device_capacity_tokens, start_layer, end_layer, target_layer_num,
    layer_shard_enabled=False, pool_label="kv", host_token_capacity=None)`` - an
    `MLAHostAllocation` makes SGLang's allocator-only pool (``is_dummy``: indices, no memory).
    The older SGLang's (a device pool first) still works, told apart by `_forms.FORMS`
    (``from_allocation`` / ``from_buffer_info`` / ``from_device_pool`` build one form only).
    """

    pool_family = "mla"
    shape_class = MLAShape

    def __init__(self, buffer_info=None, host_to_device_ratio=None, host_size=None, page_size=None, layout=None,
                 pin_memory=True, device="cpu", allocator_type="default", override_kv_cache_dim=None,
                 draft_buffer_infos=(), dcp_size=1, dcp_rank=0, *, device_capacity_tokens=None, start_layer=None,
                 end_layer=None, target_layer_num=None, layer_shard_enabled=False, pool_label="kv",
                 host_token_capacity=None, device_pool=None, page_num=None, options=None, host=None):
        name = type(self).__name__
        first = _first(self, buffer_info, device_pool)
        form = form_of(self.pool_family, (first,), {})
        fields = dict(override_kv_cache_dim=override_kv_cache_dim)
        allocation_token_bytes = None
        keywords = dict(given(device_capacity_tokens=device_capacity_tokens, start_layer=start_layer,
                              end_layer=end_layer, host_token_capacity=host_token_capacity, page_num=page_num),
                        pin_memory=pin_memory, device=device, allocator_type=allocator_type, pool_label=pool_label,
                        options=options, host=host)
        if form is DEVICE_POOL:
            first = older_device_pool(self, first, "an MLABufferInfo or MLAHostAllocation",
                                      ("layer_num", "kv_lora_rank", "qk_rope_head_dim", "dtype"))
            if draft_buffer_infos or dcp_size != 1 or target_layer_num is not None or layer_shard_enabled:
                raise LayoutError(f"{name}: draft_buffer_infos, dcp_size, target_layer_num and layer_shard_enabled "
                                  "come with SGLang 0.5.23's constructor (an MLABufferInfo first)")
            fields["dsa_kv_cache_store_fp8"] = False
            kv_cache_dim = override_kv_cache_dim or first.kv_lora_rank + first.qk_rope_head_dim
            view = first
        else:
            if target_layer_num is None:
                raise LayoutError(f"{name}: SGLang 0.5.23's constructor needs the keyword target_layer_num")
            fields["dsa_kv_cache_store_fp8"] = bool(getattr(first, "packed_fp8", False))
            dummy = form.allocator_only  # SGLang's allocator-only pool: its geometry says the token size
            kv_cache_dim = override_kv_cache_dim or (
                first.kv_cache_dim if dummy else first.kv_lora_rank + first.qk_rope_head_dim)
            if dummy:
                allocation_token_bytes = int(first.size_per_token)
                keywords["is_dummy"] = True
            view = mla_device(name, first, tuple(draft_buffer_infos),
                              device_capacity_tokens=device_capacity_tokens or 0,
                              start_layer=start_layer or 0, target_layer_num=target_layer_num,
                              layer_shard_enabled=layer_shard_enabled)
            keywords.update(dcp_size=dcp_size, dcp_rank=dcp_rank)
        sizing, options = split_keywords(name, keywords, host_to_device_ratio=host_to_device_ratio,
                                         host_size=host_size, page_size=page_size)
        shape = MLAShape(view, given=fields, kv_cache_dim=kv_cache_dim, allocation_token_bytes=allocation_token_bytes)
        self._build(form, shape, sizing, layout, options)

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


def _dsa_from_decl(pool, decl, anchor_host, *, packed_draft_device_pools=(), pin_memory=True, device="cpu",
                   allocator_type="default", is_dummy=False, options=None, host=None) -> None:
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
    indexer_page_num = dsa_indexer_pages(anchor_host.size, page_size)
    # SGLang's fields: the anchor's slots and pages; the buffer holds indexer_page_num pages
    fields = dict(decl=decl, mtp_draft_device_pools=tuple(packed_draft_device_pools), indexer_page_num=indexer_page_num,
                 indexer_dtype=storage.dtype, indexer_page_stride_size=storage.page_bytes(page_size))
    sizing, options = split_keywords(name, dict(pin_memory=pin_memory, device=device, allocator_type=allocator_type,
                                                is_dummy=is_dummy, options=options, host=host),
                                     host_to_device_ratio=1.0, host_size=0, page_size=page_size,
                                     page_num=anchor_host.page_num, buffer_page_num=indexer_page_num,
                                     device_capacity_tokens=anchor_host.size, start_layer=view.start_layer,
                                     end_layer=getattr(decl.device_pool, "end_layer", view.layer_num))
    pool._build(DECLARATION, DSAShape(view, given=fields), sizing, anchor_host.layout, options)


def _dsa_from_device_pool(pool, device_pool, host_to_device_ratio, host_size, page_size, layout, pin_memory=True,
                          device="cpu", allocator_type="default", *, anchor_pool=None, page_num=None,
                          end_layer=None, pool_label="kv", options=None, host=None) -> None:
    """The older SGLang's DSA indexer pool (`HostKVCache`'s older form); beside ``anchor_pool``,
    sized like SGLang's: the index pages of the anchor's slots (`dsa_indexer_pages`)."""
    if anchor_pool is not None and page_num is None:
        page_num = dsa_indexer_pages(anchor_pool.size, check_int(LayoutError, type(pool).__name__, "page_size",
                                                                 page_size, minimum=1))
    HostKVCache.__init__(pool, device_pool, host_to_device_ratio, host_size, page_size, layout, pin_memory, device,
                         allocator_type, page_num=page_num, end_layer=end_layer, pool_label=pool_label,
                         options=options, host=host)


class DSAIndexerPoolHost(NamedConstructors, HostKVCache):
    """DeepSeek sparse-attention index keys (FP8 + fp32 scales, uint8), in whole page rows.

    SGLang 0.5.23's constructor: ``(decl: HostPoolDecl, anchor_host, *,
    packed_draft_device_pools=(), pin_memory=True, device="cpu", allocator_type="default",
    is_dummy=False)`` - the declaration's device pool and owned layers (then one host layer per
    packed draft pool), the anchor's page size, layout and size, `hicache.plan.dsa_indexer_pages`
    of its size; copies to the declared device tensors. The older form
    ``(device_pool, ratio, host_size, page_size, layout, pin_memory, device, allocator_type, *,
    anchor_pool=None)`` still works, told apart by `_forms.FORMS` (``from_decl`` /
    ``from_device_pool``).
    """

    pool_family = "dsa"
    shape_class = DSAShape
    builders = {DECLARATION: _dsa_from_decl, DEVICE_POOL: _dsa_from_device_pool}

    def __init__(self, *args, **kwargs):
        """SGLang 0.5.23's declaration form or the older device-pool one (`_forms.dispatch`)."""
        dispatch(self, args, kwargs)

    def get_hybrid_pool_buffer(self) -> list:
        return [self.index_k_with_scale_buffer]

    @property
    def index_k_with_scale_buffer(self):
        """The host index buffer (SGLang's name)."""
        return self.buffers[0]
