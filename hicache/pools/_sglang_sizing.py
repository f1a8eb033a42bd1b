"""Sizing a pool as SGLang 0.5.23's `HostKVCache.__init__` does (pool_host/base.py), for pools
built from its device-buffer descriptions: the same ``size``, ``page_num`` and layer fields, so
SGLang's controllers, radix cache and L3 keys see the pool they would see with SGLang's own.

0.5.23's rule: ``host_token_capacity`` if given (positive, page-aligned; no padding page), else
``int(host_size * 1e9 // size_per_token)`` when ``host_size > 0`` (synced to the pipeline
group's minimum by SGLang's own helper when SGLang runs distributed), else
``int(device_capacity_tokens * host_to_device_ratio)``; then a padding page: ``page_num = size
// page_size + 1``, ``size = page_num * page_size`` - the token count and the pages are
`hicache.plan.host_tokens` / `pages_for` under rule ``sglang-0.5.23``, the rule `hicache plan`
sizes with too (issue #34). Layers come from the description (targets
plus packed drafts), ``start_layer``/``end_layer`` are kept as the caller passed them.
"""

from __future__ import annotations

import logging

from hicache.errors import LayoutError, PlanError
from hicache.plan.checks import check_int, check_real
from hicache.pools._server import server
from hicache.plan._capacity import SGLANG_0_5_23
from hicache.plan import host_tokens, pages_for

logger = logging.getLogger(__name__)



def _integer(owner: str, field: str, value, *, minimum: int = 0) -> int:
    return check_int(LayoutError, owner, field, value, minimum=minimum)


def _real(owner: str, field: str, value) -> float:
    return check_real(PlanError, owner, field, value)


def _synced(size: int, host_size: float) -> int:
    """The server's PP-group agreement on a fixed --hicache-size (`hicache.pools.server()`; SGLang's
    acts only under an initialized torch.distributed with a pipeline group)."""
    return server().synced_size(size, host_size)


def size_as_sglang(pool, host_to_device_ratio, host_size, *, device_capacity_tokens, start_layer, end_layer,
                   host_token_capacity, page_num=None) -> None:
    """Set ``dtype``, layers, ``size_per_token``, ``size``, ``page_num`` and the descriptor on
    ``pool`` (a `HostKVCache` whose ``device_pool`` is a `BufferDevice`); ``page_num``: sized by
    an anchor pool instead (SGLang's side pools)."""
    owner = type(pool).__name__
    device = pool.device_pool
    if device_capacity_tokens is None or start_layer is None or end_layer is None:
        missing = [name for name, value in (("device_capacity_tokens", device_capacity_tokens),
                                            ("start_layer", start_layer), ("end_layer", end_layer)) if value is None]
        raise LayoutError(f"{owner}: SGLang 0.5.23's constructor needs the keyword(s) {', '.join(missing)}")
    pool.device_capacity_tokens = _integer(owner, "device_capacity_tokens", device_capacity_tokens)
    pool.start_layer = _integer(owner, "start_layer", start_layer)
    pool.end_layer = _integer(owner, "end_layer", end_layer)
    pool.dtype = device.dtype
    pool.layer_num = device.layer_num
    pool.target_layer_num = device.target_layer_num
    supported = pool.descriptor_class().supported()
    if pool.layout not in supported:
        raise LayoutError(f"{owner}: layout {pool.layout!r} is not supported; supported: {', '.join(supported)}")
    pool.size_per_token = pool.get_size_per_token()
    page_size = pool.page_size
    anchored = page_num is not None
    if anchored:
        size = page_num * page_size
    elif host_token_capacity is not None:
        size = _integer(owner, "host_token_capacity", host_token_capacity, minimum=1)
        if size % page_size:
            raise LayoutError(f"{owner}: host_token_capacity must be positive and page-aligned, got {size} for "
                              f"page_size={page_size}")
        page_num = size // page_size
    else:
        gb = _real(owner, "host_size", host_size if host_size is not None else 0)
        if gb > 0:  # plan.host_tokens: SGLang's float arithmetic, then the server's PP-group agreement
            size = _synced(host_tokens(size_per_token_bytes=pool.size_per_token, host_gb=gb, rule=SGLANG_0_5_23), gb)
        else:
            ratio = _real(owner, "host_to_device_ratio", host_to_device_ratio)
            tokens = pool.device_capacity_tokens
            size = (host_tokens(size_per_token_bytes=pool.size_per_token, device_tokens=tokens, host_to_device_ratio=ratio,
                                rule=SGLANG_0_5_23)
                    if ratio > 0 and tokens > 0 else int(tokens * ratio))  # 0 or less: what SGLang lets through
        if size < 0:
            raise PlanError(f"{owner}: the pool would hold {size} tokens (host_to_device_ratio="
                            f"{host_to_device_ratio!r}, host_size={host_size!r})")
        page_num = pages_for(size, page_size, SGLANG_0_5_23)  # SGLang's padding page for an independent pool
    if page_num < 1:
        raise PlanError(f"{owner}: page_num must be at least 1, got {page_num}")
    pool.page_num = page_num
    pool.size = page_num * page_size
    if not anchored and pool.size <= pool.device_capacity_tokens:
        logger.warning("HiCache %s host pool (%d tokens) is smaller than the device pool (%d tokens); L2 cache "
                       "effectiveness is reduced. Consider increasing --hicache-ratio (or --hicache-size).",
                       pool.pool_label, pool.size, pool.device_capacity_tokens)
    pool.descriptor = pool.layout_descriptor(page_num)
