"""The Mamba (linear-attention) host pool: one slot per request, temporal and conv states
(``mamba_cache.temporal`` / ``.conv`` of SGLang's device pool).
"""

from __future__ import annotations

import math

import attrs

from hicache.plan import (
    MambaLayout,
)
from hicache.errors import LayoutError, TransferError
from hicache.pools._base import HostKVCache, Stream
from hicache.pools._geometry import Shape
from hicache.pools._forms import STATE_DESCRIPTION, NamedConstructors, form_of
from hicache.pools._options import given, split_keywords
from hicache.pools._sglang_inputs import mamba_device, older_device_pool
from hicache.pools._storage import written

from hicache.pools._family_base import _first, _itemsize


@attrs.frozen(eq=False)
class MambaShape(Shape):
    """Mamba's builder: one slot per request, the temporal state then each conv state
    (``states``: ``((state shape, dtype), ...)``; a state of no elements has no buffer)."""

    descriptor_class = MambaLayout
    states: tuple = attrs.field(kw_only=True)

    @staticmethod
    def older_states(device_pool) -> tuple:
        """``states`` of an older SGLang `MambaPool` (its ``mamba_cache``: temporal, then each conv)."""
        cache = device_pool.mamba_cache
        return ((tuple(cache.temporal.shape[2:]), cache.temporal.dtype),
                *((tuple(conv.shape[2:]), conv.dtype) for conv in cache.conv))

    def layer_count(self) -> int:
        layers = getattr(self.view, "num_mamba_layers", None)
        return layers if layers is not None else self.view.mamba_cache.temporal.shape[0]

    def store_dtype(self):
        return self.states[1][1] if len(self.states) > 1 else self.states[0][1]

    def buffer_dtypes(self, layout, facts):
        return tuple(dtype for shape, dtype in self.states if math.prod(shape))

    def descriptor(self, layout, facts, page_num):
        (temporal_shape, temporal_dtype), *convs = self.states
        return MambaLayout(layout, layer_num=facts.layer_num, slots=page_num,
                           temporal_shape=tuple(temporal_shape), temporal_itemsize=_itemsize(temporal_dtype),
                           conv_shapes=tuple(tuple(shape) for shape, _ in convs),
                           conv_itemsize=_itemsize(convs[0][1]) if convs else 1)

    def streams(self):
        held = [i for i, (shape, _) in enumerate(self.states) if math.prod(shape)]
        return tuple(Stream(buffer, None,
                            lambda pool, layer, i=i: ([pool.mamba_cache.temporal, *pool.mamba_cache.conv][i])[layer])
                     for buffer, i in enumerate(held))

    @property
    def has_temporal(self) -> bool:
        """Whether the temporal state holds anything (a conv-only model's does not)."""
        return bool(math.prod(self.states[0][0]))


class MambaPoolHost(NamedConstructors, HostKVCache):
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

    pool_family = "mamba"
    shape_class = MambaShape

    def __init__(self, buffer_info=None, host_to_device_ratio=None, host_size=None, pin_memory=True, device="cpu",
                 allocator_type="default", layout="layer_first", *, device_capacity=None, mtp_draft_buffer_infos=(),
                 device_pool=None, page_num=None, options=None, host=None):
        name = type(self).__name__
        first = _first(self, buffer_info, device_pool)
        form = form_of(self.pool_family, (first,), {})
        keywords = dict(given(page_num=page_num), pin_memory=pin_memory, device=device, allocator_type=allocator_type,
                        options=options, host=host)
        fields = {}
        if form is STATE_DESCRIPTION:
            first = mamba_device(name, first, tuple(mtp_draft_buffer_infos), device_capacity=device_capacity or 0)
            # SGLang's Mamba pool says True (can_use_write_back_jit) so HostPoolGroup's AND keeps its
            # MLA sibling's staged write-back; its own backup routes by layout and backend, as this one does
            fields = dict(mtp_draft_buffer_infos=tuple(mtp_draft_buffer_infos), num_mamba_layers=first.layer_num,
                         can_use_write_back_jit=True)
            keywords.update(device_capacity_tokens=device_capacity, start_layer=0, end_layer=first.layer_num)
            states = tuple(first.mamba_facts)
        else:
            first = older_device_pool(self, first, "a MambaStateBufferInfo", ("mamba_cache",))
            if mtp_draft_buffer_infos or device_capacity is not None:
                raise LayoutError(f"{name}: device_capacity and mtp_draft_buffer_infos come with SGLang "
                                  "0.5.23's constructor (a MambaStateBufferInfo first)")
            states = MambaShape.older_states(first)
        sizing, options = split_keywords(name, keywords, host_to_device_ratio=host_to_device_ratio,
                                         host_size=host_size, page_size=1)
        self._build(form, MambaShape(first, given=fields, states=states), sizing, layout, options)

    def load_to_device_per_layer(self, device_pool, host_indices, device_indices, layer_id, io_backend="kernel", *,
                                 is_draft: bool = False) -> None:
        """As every pool's; ``io_backend`` defaults to "kernel" as SGLang's Mamba pool's does
        (hicache serves "direct" and "kernel" alike, issue #52)."""
        super().load_to_device_per_layer(device_pool, host_indices, device_indices, layer_id, io_backend,
                                         is_draft=is_draft)

    def backup_from_device_all_layer(self, device_pool, host_indices, device_indices, io_backend="kernel") -> None:
        super().backup_from_device_all_layer(device_pool, host_indices, device_indices, io_backend)

    @property
    def temporal_buffer(self):
        """The temporal state's host tensor (SGLang's name; None for a conv-only model)."""
        return self.buffers[0] if self.geometry.shape.has_temporal else None

    @property
    def conv_buffer(self) -> list:
        """The conv states' host tensors (SGLang's name)."""
        return self.buffers[1:] if self.geometry.shape.has_temporal else list(self.buffers)

    def get_data_page(self, index, flat: bool = True):
        """0.5.23: the slot's bytes, state by state (SGLang's L3 format for Mamba)."""
        if not self.geometry.form.byte_pages:
            return super().get_data_page(index, flat)
        import torch

        parts = self._l3.page_parts(self.kv_buffer, index)
        return torch.cat([part.contiguous().view(torch.uint8).reshape(-1) for part in parts])

    def get_dummy_flat_data_page(self):
        if not self.geometry.form.byte_pages:
            return super().get_dummy_flat_data_page()
        import torch

        return torch.zeros(self.page_size * self.size_per_token, dtype=torch.uint8)

    def set_from_flat_data_page(self, index, data_page) -> None:
        if not self.geometry.form.byte_pages:
            return super().set_from_flat_data_page(index, data_page)
        geometry, key = self._l3.page_at(self.kv_buffer, index)
        if geometry.writer is not None and written(geometry, key, data_page):
            return
        import torch

        parts = [t[key] for t in geometry.tensors]
        flat = data_page.contiguous().view(torch.uint8).reshape(-1)
        expected = sum(part.numel() * part.element_size() for part in parts)
        if flat.numel() != expected:
            raise TransferError(f"a Mamba state page holds {expected} bytes, data_page has {flat.numel()}")
        offset = 0
        for part in parts:
            size = part.numel() * part.element_size()
            piece = flat[offset : offset + size]
            if piece.storage_offset() % part.element_size():  # a state after one of another dtype may
                piece = piece.clone()  # start where its dtype cannot be viewed: re-based at 0 (as SGLang)
            part.copy_(piece.view(part.dtype).reshape(part.shape))  # else no copy but the one into the slot
            offset += size
