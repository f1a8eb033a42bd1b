"""The host memory budget: whether the host can afford a rank's pools.

Owns the one budget check (available memory, reserved hugepages, the cgroup's headroom, the
reserve, shared by the ranks still to allocate: sglang #34972, #40135, #38156), used by every
bring-up, `hicache doctor` and a capacity plan given the host's memory. Apart from the sizing
rule (`_capacity`) so that `hicache plan` without a host figure does not build its class.
Machine figures come in as arguments. Pure: attrs, the standard library and hicache.errors only.
"""

from __future__ import annotations

from hicache.errors import CapacityError, PlanError
from hicache.plan.checks import check_int
from hicache.plan._capacity import DEFAULT_RESERVE_BYTES
from hicache.plan._units import format_bytes, format_gb
from hicache.plan._value import value_class


@value_class
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
