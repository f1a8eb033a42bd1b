"""The MHA host pools: K/V per layer (`MHATokenToKVPoolHost`), K only
(`MHATokenToKOnlyPoolHost`), K and V of different head dims (`AsymmetricMHATokenToKVPoolHost`),
SGLang's `get_mha_host_pool_cls`, and page_head's split-heads page meta. Device pools are
duck-typed on SGLang's ``k_buffer``/``v_buffer`` per layer; the forms (`_forms`) make the
geometry (`_geometry`); allocation, registration and transfers are the base's.
"""

from __future__ import annotations


from hicache.plan import (
    AsymmetricMHALayout,
    MHAKOnlyLayout,
    MHALayout,
)
from hicache.errors import LayoutError, TransferError
from hicache.plan.checks import check_int, is_integer
from hicache.pools._base import HostKVCache, Stream
from hicache.pools._forms import ANCHOR, DESCRIPTION, DEVICE_POOL, NamedConstructors, dispatch, form_of
from hicache.pools._geometry import Shape
from hicache.pools._options import given, split_keywords
from hicache.pools._sglang_inputs import mha_device, older_device_pool

from hicache.pools._family_base import _first, _itemsize


class MHAShape(Shape):
    """MHA's builder: K and V of one head dim in one buffer (a leading axis of 2); the view
    says ``head_num`` and ``head_dim`` (the older device pools: ``k_head_dim`` too)."""

    descriptor_class = MHALayout

    def _heads(self) -> tuple[int, int]:
        view = self.view
        return view.head_num, getattr(view, "head_dim", None) or view.k_head_dim

    def descriptor(self, layout, facts, page_num):
        head_num, head_dim = self._heads()
        return self.descriptor_class(layout, page_num=page_num, layer_num=facts.layer_num, head_num=head_num,
                                     head_dim=head_dim, page_size=facts.page_size, itemsize=_itemsize(facts.dtype))

    def streams(self):
        return (Stream(0, 0, lambda pool, layer: pool.k_buffer[layer]),
                Stream(0, 1, lambda pool, layer: pool.v_buffer[layer]))

    def fields(self, layout, facts):
        """SGLang's MHA fields: heads, widths, bytes of one token row and of one token's layers."""
        head_num, head_dim = self._heads()
        element_dim = head_num * head_dim
        token_stride_size = element_dim * _itemsize(facts.dtype)
        return {**super().fields(layout, facts), "head_num": head_num, "head_dim": head_dim,
                "v_head_dim": getattr(self.view, "v_head_dim", None) or head_dim, "element_dim": element_dim,
                "token_stride_size": token_stride_size, "layout_dim": token_stride_size * facts.layer_num}


class MHAKOnlyShape(MHAShape):
    """K only: one buffer of keys (the MHA fields as SGLang's K-only pool keeps them)."""

    descriptor_class = MHAKOnlyLayout

    def streams(self):
        return (Stream(0, None, lambda pool, layer: pool.k_buffer[layer]),)


class AsymmetricMHAShape(MHAShape):
    """K and V of different head dims: buffers ``k`` and ``v``. No ``token_stride_size`` or
    ``layout_dim``: K and V rows differ, and SGLang's pool leaves them unset on purpose so a
    caller reaching for one shared stride fails loudly."""

    descriptor_class = AsymmetricMHALayout

    def descriptor(self, layout, facts, page_num):
        view = self.view
        return AsymmetricMHALayout(layout, layer_num=facts.layer_num, head_num=view.head_num,
                                   k_head_dim=view.k_head_dim, v_head_dim=view.v_head_dim, page_size=facts.page_size,
                                   page_num=page_num, itemsize=_itemsize(facts.dtype))

    def streams(self):
        return (Stream(0, None, lambda pool, layer: pool.k_buffer[layer]),
                Stream(1, None, lambda pool, layer: pool.v_buffer[layer]))

    def fields(self, layout, facts):
        head_num, head_dim = self._heads()
        return {**self.given, "head_num": head_num, "head_dim": head_dim, "v_head_dim": self.view.v_head_dim}


class _MHAForms(NamedConstructors):
    """The MHA families' constructors: SGLang 0.5.23's (an `MHABufferInfo` first, its packed
    drafts, staging and head groups) or the older one (a device pool first), told apart by
    `_forms.FORMS`, read into the family's shape (`shape_class`)."""

    pool_family = "mha"

    def __init__(self, buffer_info=None, host_to_device_ratio=None, host_size=None, page_size=None, layout=None,
                 pin_memory=True, device="cpu", allocator_type="default", *, device_capacity_tokens=None,
                 start_layer=None, end_layer=None, draft_buffer_infos=(), write_back_staging=None, pool_label="kv",
                 head_group_num=1, host_token_capacity=None, device_pool=None, page_num=None, options=None,
                 host=None):
        name = type(self).__name__
        first = _first(self, buffer_info, device_pool)
        form = form_of(self.pool_family, (first,), {})
        fields = dict(head_group_num=check_int(LayoutError, name, "head_group_num", head_group_num),  # page_unified
                      write_back_staging=write_back_staging)  # SGLang's CUDA write-back kernel's staging; unused
        keywords = given(device_capacity_tokens=device_capacity_tokens, start_layer=start_layer, end_layer=end_layer,
                         host_token_capacity=host_token_capacity, page_num=page_num)
        sizing, options = split_keywords(name, dict(keywords, pin_memory=pin_memory, device=device,
                                                    allocator_type=allocator_type, pool_label=pool_label,
                                                    options=options, host=host),
                                         host_to_device_ratio=host_to_device_ratio, host_size=host_size,
                                         page_size=page_size)
        if form is DESCRIPTION:
            view = mha_device(name, first, tuple(draft_buffer_infos),
                              device_capacity_tokens=sizing.device_capacity_tokens or 0,
                              start_layer=sizing.start_layer or 0)
        elif draft_buffer_infos:
            raise LayoutError(f"{name}: draft_buffer_infos come with SGLang 0.5.23's constructor (an MHABufferInfo "
                              "first)")
        else:
            view = older_device_pool(self, first, "an MHABufferInfo", ("layer_num", "head_num", "dtype"))
        self._build(form, type(self).shape_class(view, given=fields), sizing, layout, options)


class MHATokenToKVPoolHost(_MHAForms, HostKVCache):
    """Multi-head attention: K and V in one buffer with a leading axis of 2.

    SGLang 0.5.23's constructor: ``(buffer_info: MHABufferInfo, host_to_device_ratio,
    host_size, page_size, layout, pin_memory=True, device="cpu", allocator_type="default", *,
    device_capacity_tokens, start_layer, end_layer, draft_buffer_infos=(),
    write_back_staging=None, pool_label="kv", head_group_num=1, host_token_capacity=None)``;
    the older SGLang's (a device pool first) still works, told apart by `_forms.FORMS`
    (``from_buffer_info`` / ``from_device_pool`` build one form only).
    """

    shape_class = MHAShape

    def get_hybrid_pool_buffer(self) -> list:
        """The K and V host tensors a zero-copy back end registers."""
        return [self.k_buffer, self.v_buffer]

    def get_split_heads_page_buffer_meta(self, indices, split_factor: int):
        """Zero-copy pointers for heterogeneous TP (mooncake, umbp): per page, per group of
        ``head_num // split_factor`` heads, a K and a V block - layout page_head only, as SGLang's."""
        return _split_heads_meta(self, indices, split_factor)

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
    if head_dim is None:  # the older device pools name it k_head_dim
        head_dim = getattr(device_pool, "k_head_dim", None)
    return AsymmetricMHATokenToKVPoolHost if v_head_dim != head_dim else MHATokenToKVPoolHost


def _k_only_from_anchor(pool, device_pool, anchor_host, layout, pin_memory=True, device="cpu",
                        allocator_type="default", *, options=None, host=None) -> None:
    """SGLang 0.5.23's K-only pool beside ``anchor_host``: its page size and page count, the
    device pool's layers and end layer (SGLang's)."""
    sizing, settings = split_keywords(type(pool).__name__, dict(
        pin_memory=pin_memory, device=device, allocator_type=allocator_type, options=options, host=host),
        host_to_device_ratio=1.0, host_size=0, page_size=anchor_host.page_size, page_num=anchor_host.page_num,
        end_layer=getattr(device_pool, "end_layer", None))
    pool._build(ANCHOR, MHAKOnlyShape(device_pool, given=dict(head_group_num=1, write_back_staging=None)),
                sizing, layout, settings)


class MHATokenToKOnlyPoolHost(MHATokenToKVPoolHost):
    """MHA keys only (the index-K of sparse-attention models); sized like its anchor pool.

    SGLang 0.5.23's constructor: ``(device_pool, anchor_host, layout, pin_memory=True,
    device="cpu", allocator_type="default")`` - the anchor's page size and page count, the
    device pool's layers; ``k_buffer`` is the one host tensor (no ``v_buffer``). The older
    form ``(device_pool, ratio, host_size, page_size, layout, ..., page_num=)`` still works,
    told apart by `_forms.FORMS` (the second argument: a host pool, not a number)."""

    pool_family = "mha_k_only"
    shape_class = MHAKOnlyShape
    builders = {ANCHOR: _k_only_from_anchor, DEVICE_POOL: _MHAForms.__init__}

    def __init__(self, *args, **kwargs):
        """SGLang 0.5.23's anchor form or the older device-pool one (the MHA pair's signature),
        told apart and bound once by `_forms.dispatch`."""
        dispatch(self, args, kwargs)

    @property
    def k_buffer(self):
        """The one host tensor (keys of every layer)."""
        return self.buffers[0]

    @property
    def v_buffer(self):
        raise AttributeError(f"{type(self).__name__} holds no V")  # back ends branch on hasattr(v_buffer)

    def get_hybrid_pool_buffer(self) -> list:
        return [self.k_buffer]


class AsymmetricMHATokenToKVPoolHost(_MHAForms, HostKVCache):
    """MHA with different K and V head dims: buffers ``k`` and ``v``. Constructors as
    `MHATokenToKVPoolHost` (0.5.23's with an `MHABufferInfo` whose ``v_head_dim`` differs)."""

    shape_class = AsymmetricMHAShape

    def get_ksize_per_token(self) -> int:
        """Bytes of one token's K over all layers (its V is narrower or wider)."""
        return self.head_dim * self.head_num * self.layer_num * _itemsize(self.dtype)

    @property
    def k_buffer(self):
        return self.buffers[0]

    @property
    def v_buffer(self):
        return self.buffers[1]


def _split_heads_meta(pool, indices, split_factor: int):
    """SGLang's ``get_split_heads_page_buffer_meta`` for an MHA page_head pool: for each page,
    for each head group, the K block and the V block (``layer_num * page_size * head_num *
    head_dim / split_factor`` elements each), pointers inside the host buffer."""
    if pool.layout != "page_head":
        raise TransferError(f"{type(pool).__name__}: split-heads page meta needs layout page_head, not {pool.layout!r}")
    if not is_integer(split_factor) or split_factor < 1 or pool.head_num % split_factor:
        raise TransferError(f"split_factor must divide head_num={pool.head_num}, got {split_factor!r}")
    pages = pool._pointers.meta_pages(indices)
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
