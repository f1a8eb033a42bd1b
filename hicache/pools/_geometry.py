"""`PoolGeometry`: what a host pool is, decided once before any memory (issues #34 item 1, #55 item 1).

A family's constructor reads its SGLang form (`_forms`) into a `Shape` (its device view and what
the family makes of it: descriptor, copy lanes, dtypes, SGLang-facing fields - pure, no pool) and
a `Sizing` (what the caller asked for); `make_geometry` turns them into one frozen value - the
form, layers and the layer map's basis, dtypes, page size and DCP, device capacity, the sizing
rule and its page count, the layout descriptor that is brought up, the copy lanes and the
family's fields. It never sees the pool (built outside in): the base adopts the value whole
before the bring-up and never changes it after, so what a pool reports (`size`, `page_num`,
`size_per_token`) is what its plan brought up. Pages are counted by `hicache.plan`'s one sizing
rule (`_sglang_sizing` for 0.5.23's form). May import plan, errors and the pools' inputs.
"""

from __future__ import annotations

import logging
import types
from typing import ClassVar

import attrs

from hicache.errors import LayoutError, TransferError
from hicache.plan import size_pool
from hicache.plan.checks import check_int, check_real
from hicache.errors import PlanError
from hicache.pools._server import NO_SERVER
from hicache.pools._sglang_sizing import sglang_page_num
from hicache.pools._transfer import check_backend

logger = logging.getLogger(__name__)


@attrs.frozen(kw_only=True)
class Sizing:
    """What a constructor call asks of the pool's size, as SGLang's arguments say it.

    ``page_size`` as passed (0.5.23 widens it by ``dcp_size``); ``page_num``: pages given by the
    form (an anchor's, DeepSeek-V4's ``num_host_pages``); ``buffer_page_num``: pages the buffer
    holds where they differ from the slots the pool hands out (DSA: `plan.dsa_indexer_pages`);
    ``size_per_token``: the figure SGLang's pool reports where it is not the layout's (V4: one
    row's bytes); ``end_layer``: SGLang's value where the form fixes it."""

    host_to_device_ratio: object = None
    host_size: object = None
    page_size: object = None
    page_num: int | None = None
    buffer_page_num: int | None = None
    device_capacity_tokens: object = None
    start_layer: object = None
    end_layer: object = None
    host_token_capacity: object = None
    dcp_size: object = 1
    dcp_rank: object = 0
    size_per_token: int | None = None


@attrs.frozen(kw_only=True)
class Facts:
    """The layers, dtype and page of a pool, before it is sized."""

    dtype: object
    layer_num: int
    target_layer_num: int
    start_layer: int
    end_layer: int
    page_size: int
    dcp_size: int = 1
    dcp_rank: int = 0
    device_capacity_tokens: int = 0


@attrs.frozen(eq=False)
class Shape:
    """A family's pure builder over its device view (issue #55 item 1): what the geometry is
    made of, asked with the facts `make_geometry` reads - never the pool. Each family subclasses
    it (`descriptor_class`, `descriptor`, `streams`, and `fields`: the SGLang-facing attributes
    its pool carries, e.g. MHA's ``head_num``); ``view``: the device side (a typed `DeviceView`
    of SGLang 0.5.23's form, or the older form's device pool); ``given``: attributes SGLang's
    constructor arguments set as passed (MHA's ``head_group_num``, V4's ``pool_name``)."""

    view: object
    given: dict = attrs.field(factory=dict, kw_only=True)
    descriptor_class: ClassVar[type]

    def layer_count(self) -> int:
        """The layers an older-form device pool holds."""
        return self.view.layer_num

    def store_dtype(self):
        """The dtype the host buffers store (an older device pool's ``store_dtype`` if it says one)."""
        return getattr(self.view, "store_dtype", None) or self.view.dtype

    def descriptor(self, layout: str, facts: Facts, page_num: int):
        """The layout descriptor of ``page_num`` pages."""
        raise NotImplementedError

    def streams(self) -> tuple:
        """The copy lanes (`Stream`s) between host buffers and the device tensors."""
        raise NotImplementedError

    def buffer_dtypes(self, layout: str, facts: Facts) -> tuple:
        """The torch dtype of each buffer (default: the stored dtype for every one)."""
        return (facts.dtype,) * len(self.descriptor(layout, facts, 1).buffers())

    def token_bytes(self, layout: str, facts: Facts) -> int:
        """Bytes one token (or slot) takes across all layers and buffers (`get_size_per_token`)."""
        return self.descriptor(layout, facts, 1).size_per_token_bytes()

    def fields(self, layout: str, facts: Facts) -> dict:
        """The family's SGLang-facing attributes of the pool, by name (``given`` among them)."""
        return dict(self.given)


@attrs.frozen(kw_only=True)
class PoolGeometry:
    """One host pool's geometry: its `Facts`, then its size as it reports it and the buffers'
    descriptor that is brought up (``buffer_page_num`` pages: DSA's differ from the slots it
    hands out, as SGLang's). ``streams``: the copy lanes (`Stream`: host buffer, K/V half,
    device tensor per layer); ``device``: the device view transfers copy with when the form
    says so (`Form.own_device`), and whose layer map resolves controller ids; ``token_bytes``:
    the layout's bytes per token (`get_size_per_token`; ``size_per_token`` is what the pool
    reports, which SGLang's V4 pools set to one row's bytes); ``fields``: the family's
    SGLang-facing attributes (`Shape.fields`), read-only; ``shape`` and ``sizing``: what it was
    made from (`make_geometry` of the two gives it again); ``owner``: the pool class it was made
    for (`HostKVCache.from_geometry` brings it up in that class only)."""

    owner: str
    form: object
    family: str
    layout: str
    facts: Facts
    size_per_token: int
    token_bytes: int
    page_num: int
    buffer_page_num: int
    buffer_dtypes: tuple
    descriptor: object = attrs.field(repr=False)
    streams: tuple = attrs.field(repr=False, eq=False)
    device: object = attrs.field(repr=False, eq=False)
    fields: types.MappingProxyType = attrs.field(repr=False, eq=False, factory=lambda: types.MappingProxyType({}))
    shape: Shape | None = attrs.field(repr=False, eq=False, default=None)
    sizing: Sizing | None = attrs.field(repr=False, eq=False, default=None)

    @property
    def size(self) -> int:
        """Token slots the pool hands out (``page_num * page_size``)."""
        return self.page_num * self.facts.page_size

    # the facts a pool's parts read most, by the names SGLang's pool fields have
    @property
    def page_size(self) -> int:
        """Token slots of one (physical) page."""
        return self.facts.page_size

    @property
    def layer_num(self) -> int:
        """Layers the pool holds."""
        return self.facts.layer_num

    @property
    def dcp_size(self) -> int:
        """Decode-context-parallel ranks that share a logical page (1: none)."""
        return self.facts.dcp_size

    @property
    def dcp_rank(self) -> int:
        """This rank among them."""
        return self.facts.dcp_rank

    @property
    def logical_page_size(self) -> int:
        """The page in the controllers' logical space (the widened DCP page)."""
        return self.facts.page_size * self.facts.dcp_size

    def host_layer(self, layer_id: int, *, is_draft: bool = False) -> int | None:
        """The host layer a controller's ``layer_id`` copies: through the description's map where
        the form has one (targets by id, packed drafts with ``is_draft``; None for a layer the
        pool does not hold - SGLang's own pools skip it too), else a pool-local id
        (``0..layer_num-1``, what SGLang's controller passes, also on a pipeline stage whose
        ``start_layer > 0``), checked."""
        if self.form.mapped_layers:
            return self.device.resolve(layer_id, is_draft=bool(is_draft))
        if not 0 <= layer_id < self.facts.layer_num:
            raise TransferError(f"layer_id {layer_id} out of range [0, {self.facts.layer_num}) (pool-local ids)")
        return layer_id


def _integer(owner: str, field: str, value, *, minimum: int = 0) -> int:
    return check_int(LayoutError, owner, field, value, minimum=minimum)


def _dcp(owner: str, sizing: Sizing) -> tuple[int, int, int]:
    """SGLang 0.5.23: ``page_size`` arrives widened by ``dcp_size`` (decode context
    parallelism); this rank holds every ``dcp_size``-th slot, so its physical page is
    ``page_size // dcp_size``. Returns (physical page, dcp_size, dcp_rank)."""
    size, rank, page = (_integer(owner, field, getattr(sizing, field), minimum=-(2**63))
                        for field in ("dcp_size", "dcp_rank", "page_size"))
    if size < 1 or not 0 <= rank < size:
        raise LayoutError(f"{owner}: dcp_rank must lie in [0, dcp_size), got dcp_size={size}, dcp_rank={rank}")
    if page <= 0 or page % size:
        raise LayoutError(f"{owner}: page_size ({page}) must be a positive multiple of dcp_size ({size}): "
                          "the widened page from the DCP paged allocator")
    return page // size, size, rank


def _described_facts(owner: str, view, sizing: Sizing) -> Facts:
    """0.5.23's description: layers from it (targets plus packed drafts), the rest from the
    keywords SGLang passes (kept as passed)."""
    missing = [f for f in ("device_capacity_tokens", "start_layer", "end_layer") if getattr(sizing, f) is None]
    if missing:
        raise LayoutError(f"{owner}: SGLang 0.5.23's constructor needs the keyword(s) {', '.join(missing)}")
    page, dcp_size, dcp_rank = _dcp(owner, sizing)
    return Facts(dtype=view.dtype, layer_num=view.layer_num, target_layer_num=view.target_layer_num,
                 start_layer=_integer(owner, "start_layer", sizing.start_layer),
                 end_layer=_integer(owner, "end_layer", sizing.end_layer), page_size=page, dcp_size=dcp_size,
                 dcp_rank=dcp_rank,
                 device_capacity_tokens=_integer(owner, "device_capacity_tokens", sizing.device_capacity_tokens))


def _pool_facts(owner: str, shape: Shape, sizing: Sizing) -> Facts:
    """A device pool (the older form, DeepSeek-V4's view, a K-only pool's): its dtype and layers.
    Never its end_layer unless the form says so: SGLang sets it inclusive when the caller gave
    none and exclusive when ModelRunner passes one; layer ids here are pool-local anyway."""
    if sizing.dcp_size != 1 or sizing.host_token_capacity is not None:
        raise LayoutError(f"{owner}: dcp_size, is_dummy and host_token_capacity come with SGLang 0.5.23's "
                          "constructor (a device-buffer description first), not a device pool")
    view = shape.view
    start = getattr(view, "start_layer", 0) or 0
    layers = shape.layer_count()
    end = start + layers if sizing.end_layer is None else sizing.end_layer
    return Facts(dtype=shape.store_dtype(), layer_num=layers, target_layer_num=layers, start_layer=start,
                 end_layer=end, page_size=sizing.page_size, device_capacity_tokens=getattr(view, "size", 0) or 0)


def _page_num(owner: str, form, sizing: Sizing, facts: Facts, size_per_token: int, label: str, server) -> int:
    """The pages the pool hands out, by its form's rule."""
    if form.sizing in ("anchor", "given"):
        return _integer(owner, "page_num", sizing.page_num, minimum=1)
    if sizing.page_num is not None:  # hicache's page_num= keyword: sized like an anchor pool
        return _integer(owner, "page_num", sizing.page_num, minimum=1)
    if form.sizing == "sglang-0.5.23":
        return sglang_page_num(owner, size_per_token=size_per_token, page_size=facts.page_size, sizing=sizing,
                               device_capacity_tokens=facts.device_capacity_tokens, label=label, server=server)
    host_gb = 0.0 if sizing.host_size is None else check_real(
        PlanError, owner, "host_size", sizing.host_size, what="a finite number of GB (0: size by the ratio)")
    sized = size_pool(size_per_token_bytes=size_per_token, page_size=facts.page_size,
                      host_gb=host_gb if host_gb > 0 else None, device_tokens=facts.device_capacity_tokens or None,
                      host_to_device_ratio=sizing.host_to_device_ratio, rule="ceil")  # the older ceiling
    for note in sized.notes:
        logger.warning("%s: %s", owner, note)
    return sized.page_num


def check_layout(owner: str, layout: str, supported, server) -> None:
    """``layout`` is one the family brings up (``supported``) and one ``server``'s io backend can
    copy: a pair we cannot serve fails the server's start, not its first write-back."""
    if layout not in supported:
        raise LayoutError(f"{owner}: layout {layout!r} is not supported; supported: {', '.join(supported)}")
    backend = server.io_backend()
    if backend is not None:
        check_backend(backend, layout, supported, error=LayoutError, owner=owner)


def make_geometry(owner: str, shape: Shape, form, sizing: Sizing, layout: str, *,
                  pool_label: str = "kv", server=NO_SERVER) -> PoolGeometry:
    """The geometry of ``owner``'s pool (its class name, for errors), built by ``form`` from
    ``shape`` (its family's builder over the device view) and ``sizing``: pure over its
    arguments and what ``server`` (the pool's `HostSetup.server`) says - its io backend, its
    pipeline group's agreement on a fixed size - before any memory."""
    check_layout(owner, layout, shape.descriptor_class.supported(), server)
    facts = _described_facts(owner, shape.view, sizing) if form.mapped_layers else _pool_facts(owner, shape, sizing)
    per_token = shape.token_bytes(layout, facts)
    page_num = _page_num(owner, form, sizing, facts, per_token, pool_label, server)
    if page_num < 1:
        raise PlanError(f"{owner}: page_num must be at least 1, got {page_num}")
    buffer_page_num = sizing.buffer_page_num or page_num
    descriptor = shape.descriptor(layout, facts, buffer_page_num)
    return PoolGeometry(owner=owner, form=form, family=descriptor.family, layout=layout, facts=facts,
                        size_per_token=per_token if sizing.size_per_token is None else sizing.size_per_token,
                        token_bytes=per_token, page_num=page_num, buffer_page_num=buffer_page_num,
                        buffer_dtypes=tuple(shape.buffer_dtypes(layout, facts)), descriptor=descriptor,
                        streams=tuple(shape.streams()), device=shape.view,
                        fields=types.MappingProxyType(dict(shape.fields(layout, facts))), shape=shape, sizing=sizing)
