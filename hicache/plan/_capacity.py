"""Capacity math: how many tokens a host pool holds, and whether the host can afford it.

Owns the one pool-sizing rule (``--hicache-size`` in decimal GB per rank, or device tokens x
ratio; issue #34: it was written twice) in its two forms - SGLang 0.5.23's (its float
arithmetic, then whole pages plus its padding page) and the older ceiling (exact decimals,
pages by ceil division, no extra page) - used by `hicache plan` and by the pools alike, and the
budget check against available memory. Machine
figures come in as arguments. Pure: attrs, the standard library and hicache.errors only.
"""

from __future__ import annotations

import numbers
from decimal import Decimal, InvalidOperation

import attrs

from hicache.errors import CapacityError, PlanError, PoolTooSmallError
from hicache.plan.checks import check_int
from hicache.plan._units import format_bytes, format_gb

#: SGLang keeps 10 GiB of host memory back for everything else (memory_pool_host.py).
DEFAULT_RESERVE_BYTES = 10 * 2**30


def _positive_number(owner: str, field: str, value) -> Decimal:
    if isinstance(value, bool) or not isinstance(value, (numbers.Real, Decimal, str)):  # numpy's floats too
        raise PlanError(f"{owner}.{field} must be a number, got {value!r}")
    try:
        number = Decimal(str(value))
    except InvalidOperation:
        raise PlanError(f"{owner}.{field} must be a number, got {value!r}") from None
    if not number.is_finite() or number <= 0:
        raise PlanError(f"{owner}.{field} must be a positive finite number, got {value!r}")
    return number


#: The sizing rules: SGLang 0.5.23's (``tokens // page_size + 1``: its padding page for an
#: independent pool, what its constructor allocates) and the older ceiling (``ceil(tokens /
#: page_size)``, page-aligned counts get no extra page).
SGLANG_0_5_23, CEIL = "sglang-0.5.23", "ceil"
SIZING_RULES = (SGLANG_0_5_23, CEIL)


def host_tokens(*, size_per_token_bytes: int, host_gb=None, device_tokens=None, host_to_device_ratio=None,
                rule: str = CEIL) -> int:
    """Tokens a host pool is sized for before pages: ``host_gb`` decimal GB over the bytes per
    token, else ``device_tokens x host_to_device_ratio``. SGLang 0.5.23's rule does SGLang's own
    float arithmetic (``int(host_size * 1e9 // size_per_token)``, ``int(tokens * ratio)``) so the
    count is exactly the one its constructor reaches; the ceiling's is exact (decimals)."""
    owner = "size_pool"
    if rule not in SIZING_RULES:
        raise PlanError(f"{owner}.rule must be one of {', '.join(SIZING_RULES)}, got {rule!r}")
    per_token = check_int(PlanError, owner, "size_per_token_bytes", size_per_token_bytes)
    if host_gb is not None:
        gb = _positive_number(owner, "host_gb", host_gb)
        if rule == SGLANG_0_5_23:
            return int(float(gb) * 1e9 // per_token)
        return int(gb * 10**9) // per_token
    if device_tokens is not None and host_to_device_ratio is not None:
        ratio = _positive_number(owner, "host_to_device_ratio", host_to_device_ratio)
        tokens = check_int(PlanError, owner, "device_tokens", device_tokens)
        return int(tokens * float(ratio)) if rule == SGLANG_0_5_23 else int(tokens * ratio)
    raise PlanError("size_pool needs host_gb, or device_tokens together with host_to_device_ratio")


def pages_for(tokens: int, page_size: int, rule: str = CEIL) -> int:
    """Pages for ``tokens`` under ``rule``: 0.5.23's whole pages plus its padding page, or the
    ceiling (no extra page for a page-aligned count)."""
    if rule == SGLANG_0_5_23:
        return tokens // page_size + 1
    return -(-tokens // page_size)


@attrs.frozen
class PoolSize:
    """Tokens and pages a pool holds; ``notes`` carry warnings (host smaller than device)."""

    tokens: int
    page_size: int
    page_num: int
    size_per_token_bytes: int
    notes: tuple[str, ...] = ()

    @property
    def total_bytes(self) -> int:
        """Bytes for ``page_num * page_size`` tokens."""
        return self.page_num * self.page_size * self.size_per_token_bytes


def size_pool(
    *,
    size_per_token_bytes: int,
    page_size: int,
    host_gb: float | int | None = None,
    device_tokens: int | None = None,
    host_to_device_ratio: float | int | None = None,
    rule: str = CEIL,
) -> PoolSize:
    """Size a host pool by ``rule`` (`SIZING_RULES`; default the ceiling: SGLang's sizing minus
    its extra page; ``"sglang-0.5.23"``: what 0.5.23's constructor allocates, padding page included).

    ``host_gb`` (decimal GB per rank, SGLang's ``--hicache-size``) takes precedence; otherwise
    ``device_tokens * host_to_device_ratio``. A host pool smaller than the device pool is a
    note, not an error. Raises ``PlanError``/``CapacityError`` for bad or empty sizes.
    """
    owner = "size_pool"
    per_token = check_int(PlanError, owner, "size_per_token_bytes", size_per_token_bytes)
    page = check_int(PlanError, owner, "page_size", page_size)
    if device_tokens is not None:
        device_tokens = check_int(PlanError, owner, "device_tokens", device_tokens)
    notes: list[str] = []
    if host_gb is not None:
        tokens = host_tokens(size_per_token_bytes=per_token, host_gb=host_gb, rule=rule)
        if tokens == 0:
            host_bytes = int(_positive_number(owner, "host_gb", host_gb) * 10**9)
            raise PoolTooSmallError(
                f"host_gb={host_gb} ({format_gb(host_bytes)}) holds no token of "
                f"{per_token} bytes"
            )
    else:
        tokens = host_tokens(size_per_token_bytes=per_token, device_tokens=device_tokens,
                             host_to_device_ratio=host_to_device_ratio, rule=rule)
        if tokens == 0:
            raise PoolTooSmallError(
                f"{device_tokens} device tokens x ratio {host_to_device_ratio} is no token"
            )
    if device_tokens is not None and tokens < device_tokens:
        notes.append(
            f"host pool ({tokens} tokens) is smaller than the device pool ({device_tokens} "
            "tokens): pages evicted from the device may not fit on the host"
        )
    page_num = pages_for(tokens, page, rule)
    return PoolSize(page_num * page, page, page_num, per_token, tuple(notes))


@attrs.frozen
class BudgetVerdict:
    """The arithmetic of one budget check; ``ok`` says whether the request fits."""

    requested_bytes: int
    available_bytes: int
    free_hugepage_bytes: int
    cgroup_headroom_bytes: int | None
    reserve_bytes: int
    ranks_sharing: int
    per_rank_bytes: int

    @property
    def ok(self) -> bool:
        return self.requested_bytes <= self.per_rank_bytes

    def explain(self, *, binary: bool = False) -> str:
        """One sentence with every figure in decimal GB (as SGLang's --hicache-size), or in
        GiB/MiB with ``binary`` (as `hicache doctor` shows every size)."""
        fmt = format_bytes if binary else format_gb
        parts = [f"{fmt(self.available_bytes)} available"]
        if self.free_hugepage_bytes:
            parts.append(f"+ {fmt(self.free_hugepage_bytes)} free reserved hugepages")
        if self.cgroup_headroom_bytes is not None:
            parts.append(f"(capped by {fmt(self.cgroup_headroom_bytes)} cgroup headroom)")
        parts.append(f"- {fmt(self.reserve_bytes)} reserve")
        parts.append(f"/ {self.ranks_sharing} rank(s) = {fmt(self.per_rank_bytes)} per rank")
        return (
            f"requested {fmt(self.requested_bytes)} per rank; " + " ".join(parts)
        )


def assess_budget(
    requested_bytes: int,
    *,
    available_bytes: int,
    reserve_bytes: int = DEFAULT_RESERVE_BYTES,
    ranks_per_host: int = 1,
    ranks_already_allocated: int = 0,
    free_hugepage_bytes: int = 0,
    cgroup_limit_bytes: int | None = None,
    cgroup_usage_bytes: int = 0,
) -> BudgetVerdict:
    """Work out how much one rank may take; never raises for a refusal (see ``check_budget``).

    ``available_bytes`` is the host's available memory (psutil ``available``), which does not
    count reserved hugepages: pass ``free_hugepage_bytes`` when the pool will use them (sglang
    #34972). A cgroup limit caps what is usable at ``limit - usage`` (#40135). The rest, minus
    ``reserve_bytes``, is shared by the ranks that have not allocated yet: ranks that already did
    are no longer in ``available_bytes`` and must not be counted twice (#38156).
    """
    owner = "check_budget"
    requested = check_int(PlanError, owner, "requested_bytes", requested_bytes, minimum=0)
    available = check_int(PlanError, owner, "available_bytes", available_bytes, minimum=0)
    reserve = check_int(PlanError, owner, "reserve_bytes", reserve_bytes, minimum=0)
    ranks = check_int(PlanError, owner, "ranks_per_host", ranks_per_host)
    done = check_int(
        PlanError, owner, "ranks_already_allocated", ranks_already_allocated,
        minimum=0, maximum=ranks - 1,
    )
    hugepages = check_int(PlanError, owner, "free_hugepage_bytes", free_hugepage_bytes, minimum=0)
    usable = available + hugepages
    headroom = None
    if cgroup_limit_bytes is not None:
        limit = check_int(PlanError, owner, "cgroup_limit_bytes", cgroup_limit_bytes)
        usage = check_int(PlanError, owner, "cgroup_usage_bytes", cgroup_usage_bytes, minimum=0)
        headroom = max(limit - usage, 0)
        usable = min(usable, headroom)
    sharing = ranks - done
    per_rank = max(usable - reserve, 0) // sharing
    return BudgetVerdict(requested, available, hugepages, headroom, reserve, sharing, per_rank)


def check_budget(requested_bytes: int, **machine) -> BudgetVerdict:
    """``assess_budget``, raising ``CapacityError`` (GB figures and a hint) when it is refused."""
    verdict = assess_budget(requested_bytes, **machine)
    if not verdict.ok:
        raise CapacityError(
            f"host memory budget refused: {verdict.explain()}. Hint: lower the host pool size "
            "(--hicache-size / host_gb), run fewer ranks per host, or free host memory"
        )
    return verdict
