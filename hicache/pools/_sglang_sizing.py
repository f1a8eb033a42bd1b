"""Counting a pool's pages as SGLang 0.5.23's `HostKVCache.__init__` does (pool_host/base.py),
for pools built from its device-buffer descriptions: the same ``size`` and ``page_num``, so
SGLang's controllers, radix cache and L3 keys see the pool they would see with SGLang's own.

0.5.23's rule: ``host_token_capacity`` if given (positive, page-aligned; no padding page), else
``int(host_size * 1e9 // size_per_token)`` when ``host_size > 0`` (synced to the pipeline
group's minimum by SGLang's own helper when SGLang runs distributed), else
``int(device_capacity_tokens * host_to_device_ratio)``; then a padding page: ``page_num = size
// page_size + 1`` - the token count and the pages are `hicache.plan.host_tokens` / `pages_for`
under rule ``sglang-0.5.23``, the rule `hicache plan` sizes with too (issue #34).
"""

from __future__ import annotations

import logging

from hicache.errors import LayoutError, PlanError
from hicache.plan.checks import check_int, check_real
from hicache.plan import SGLANG_0_5_23
from hicache.plan import host_tokens, pages_for

logger = logging.getLogger(__name__)


def _real(owner: str, field: str, value) -> float:
    return check_real(PlanError, owner, field, value)


def _tokens(owner: str, size_per_token: int, sizing, device_capacity_tokens: int, server) -> int:
    host_size, ratio = sizing.host_size, sizing.host_to_device_ratio
    gb = _real(owner, "host_size", host_size if host_size is not None else 0)
    if gb > 0:  # plan.host_tokens: SGLang's float arithmetic, then the server's PP-group agreement
        # the server's PP-group agreement on a fixed --hicache-size (SGLang's acts only under an
        # initialized torch.distributed with a pipeline group)
        size = server.synced_size(host_tokens(size_per_token_bytes=size_per_token, host_gb=gb, rule=SGLANG_0_5_23), gb)
    else:
        ratio = _real(owner, "host_to_device_ratio", ratio)
        tokens = device_capacity_tokens
        size = (host_tokens(size_per_token_bytes=size_per_token, device_tokens=tokens, host_to_device_ratio=ratio,
                            rule=SGLANG_0_5_23)
                if ratio > 0 and tokens > 0 else int(tokens * ratio))  # 0 or less: what SGLang lets through
    if size < 0:
        raise PlanError(f"{owner}: the pool would hold {size} tokens (host_to_device_ratio="
                        f"{sizing.host_to_device_ratio!r}, host_size={host_size!r})")
    return size  # SGLang's padding page follows (pages_for)


def sglang_page_num(owner: str, *, size_per_token: int, page_size: int, sizing, device_capacity_tokens: int,
                    label: str, server) -> int:
    """The pages SGLang 0.5.23's constructor gives a pool of ``size_per_token`` bytes a token
    for ``sizing`` (a `_geometry.Sizing`: ratio, host_size, host_token_capacity); ``server``: the
    pool's (`HostSetup.server`), whose pipeline group agrees on a fixed size."""
    if sizing.host_token_capacity is not None:
        size = check_int(LayoutError, owner, "host_token_capacity", sizing.host_token_capacity, minimum=1)
        if size % page_size:
            raise LayoutError(f"{owner}: host_token_capacity must be positive and page-aligned, got {size} for "
                              f"page_size={page_size}")
        page_num = size // page_size  # SGLang's: no padding page
    else:
        page_num = pages_for(_tokens(owner, size_per_token, sizing, device_capacity_tokens, server), page_size,
                             SGLANG_0_5_23)
    if page_num * page_size <= device_capacity_tokens:
        logger.warning("HiCache %s host pool (%d tokens) is smaller than the device pool (%d tokens); L2 cache "
                       "effectiveness is reduced. Consider increasing --hicache-ratio (or --hicache-size).",
                       label, page_num * page_size, device_capacity_tokens)
    return page_num
