"""`PoolGeometry`: what a host pool is, decided once before any memory (issue #34 item 1).

A family's named constructor reads its SGLang form (`_forms`) into a device view and a `Sizing`
(what the caller asked for); `make_geometry` turns them into one frozen value - the form, layers
and the layer map's basis, dtypes, page size and DCP, device capacity, the sizing rule and its
page count, the layout descriptor that is brought up and the copy lanes. The base adopts it
whole before the bring-up and never changes it after: what a pool reports (`size`, `page_num`,
`size_per_token`) is what its plan brought up. Pages are counted by `hicache.plan`'s one sizing
rule (`_sglang_sizing` for 0.5.23's form). May import plan, errors and the pools' inputs.
"""

from __future__ import annotations

import logging

import attrs

from hicache.errors import LayoutError, TransferError
from hicache.plan import size_pool
from hicache.plan.checks import check_int, check_real
from hicache.errors import PlanError
from hicache.pools._server import server
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


@attrs.frozen(kw_only=True)
class PoolGeometry:
    """One host pool's geometry: its `Facts`, then its size as it reports it and the buffers'
    descriptor that is brought up (``buffer_page_num`` pages: DSA's differ from the slots it
    hands out, as SGLang's). ``streams``: the copy lanes (`Stream`: host buffer, K/V half,
    device tensor per layer); ``device``: the device view transfers copy with when the form
    says so (`Form.own_device`), and whose layer map resolves controller ids."""

    form: object
    family: str
    layout: str
    facts: Facts
    size_per_token: int
    page_num: int
    buffer_page_num: int
    buffer_dtypes: tuple
    descriptor: object = attrs.field(repr=False)
    streams: tuple = attrs.field(repr=False, eq=False)
    device: object = attrs.field(repr=False, eq=False)

    @property
    def size(self) -> int:
        """Token slots the pool hands out (``page_num * page_size``)."""
        return self.page_num * self.facts.page_size

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


def _pool_facts(owner: str, pool, view, sizing: Sizing) -> Facts:
    """A device pool (the older form, DeepSeek-V4's view, a K-only pool's): its dtype and layers.
    Never its end_layer unless the form says so: SGLang sets it inclusive when the caller gave
    none and exclusive when ModelRunner passes one; layer ids here are pool-local anyway."""
    if sizing.dcp_size != 1 or sizing.host_token_capacity is not None:
        raise LayoutError(f"{owner}: dcp_size, is_dummy and host_token_capacity come with SGLang 0.5.23's "
                          "constructor (a device-buffer description first), not a device pool")
    start = getattr(view, "start_layer", 0) or 0
    layers = pool._layer_count(view)
    end = start + layers if sizing.end_layer is None else sizing.end_layer
    return Facts(dtype=pool._store_dtype(view), layer_num=layers, target_layer_num=layers, start_layer=start,
                 end_layer=end, page_size=sizing.page_size, device_capacity_tokens=getattr(view, "size", 0) or 0)


def _page_num(owner: str, form, sizing: Sizing, facts: Facts, size_per_token: int, label: str) -> int:
    """The pages the pool hands out, by its form's rule."""
    if form.sizing in ("anchor", "given"):
        return _integer(owner, "page_num", sizing.page_num, minimum=1)
    if sizing.page_num is not None:  # hicache's page_num= keyword: sized like an anchor pool
        return _integer(owner, "page_num", sizing.page_num, minimum=1)
    if form.sizing == "sglang-0.5.23":
        return sglang_page_num(owner, size_per_token=size_per_token, page_size=facts.page_size, sizing=sizing,
                               device_capacity_tokens=facts.device_capacity_tokens, label=label)
    host_gb = 0.0 if sizing.host_size is None else check_real(
        PlanError, owner, "host_size", sizing.host_size, what="a finite number of GB (0: size by the ratio)")
    sized = size_pool(size_per_token_bytes=size_per_token, page_size=facts.page_size,
                      host_gb=host_gb if host_gb > 0 else None, device_tokens=facts.device_capacity_tokens or None,
                      host_to_device_ratio=sizing.host_to_device_ratio, rule="ceil")  # the older ceiling
    for note in sized.notes:
        logger.warning("%s: %s", owner, note)
    return sized.page_num


def make_geometry(pool, form, view, sizing: Sizing, layout: str) -> PoolGeometry:
    """The geometry of ``pool`` (a `HostKVCache` of some family) built by ``form`` from ``view``
    (its device side) and ``sizing``; the facts are adopted first, as the family's hooks
    (`layout_descriptor`, `get_size_per_token`, `streams`) read them."""
    owner = type(pool).__name__
    supported = pool.descriptor_class().supported()
    if layout not in supported:
        raise LayoutError(f"{owner}: layout {layout!r} is not supported; supported: {', '.join(supported)}")
    backend = server().io_backend()
    if backend is not None:  # a pair we cannot serve fails the server's start, not its first write-back
        check_backend(backend, layout, supported, error=LayoutError, owner=owner)
    facts = (_described_facts if form.mapped_layers else lambda o, v, s: _pool_facts(o, pool, v, s))(owner, view, sizing)
    pool._adopt_facts(view, layout, facts)
    per_token = pool.get_size_per_token()
    page_num = _page_num(owner, form, sizing, facts, per_token, pool.pool_label)
    if page_num < 1:
        raise PlanError(f"{owner}: page_num must be at least 1, got {page_num}")
    buffer_page_num = sizing.buffer_page_num or page_num
    descriptor = pool.layout_descriptor(buffer_page_num)
    return PoolGeometry(form=form, family=descriptor.family, layout=layout, facts=facts,
                        size_per_token=per_token if sizing.size_per_token is None else sizing.size_per_token,
                        page_num=page_num, buffer_page_num=buffer_page_num,
                        buffer_dtypes=tuple(pool.buffer_dtypes()), descriptor=descriptor, streams=tuple(pool.streams()), device=view)
