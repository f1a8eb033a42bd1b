"""`plan_capacity`: a model, a parallel layout and a host size -> every pool a rank registers.

Owns the arithmetic a capacity reviewer reads: tokens and pages per rank, each pool's buffers
and registration plans, the caps that applied, and the budget verdict when the host's memory is
given. Never reads the machine. Pure: the rest of hicache.plan only.
"""

from __future__ import annotations

from decimal import Decimal
from typing import TYPE_CHECKING

from hicache.errors import CapacityError, PlanError
from hicache.plan._capacity import DEFAULT_RESERVE_BYTES, SGLANG_0_5_23, PoolSize, size_pool
from hicache.plan.checks import check_int
from hicache.plan._limits import Limits
from hicache.plan._models import DEFAULT_MODEL, ModelSpec, kv_itemsize, model_pools
from hicache.plan._pool import PoolPlan, plan_pool
from hicache.plan._units import format_gb
from hicache.plan._value import value_class

if TYPE_CHECKING:  # an annotation only: a plan without a host figure does not load the budget
    from hicache.plan._budget import BudgetVerdict


@value_class
class NamedPool:
    """One pool of a model on a rank (``kv``, ``indexer``, ``mamba``, ...) and its plan."""

    name: str
    plan: PoolPlan


#: pool families whose page in an L3 back end is one request's state, not a page of tokens
#: (SGLang 0.5.23 stores a Mamba pool's slot where a request's node ends, not with every page)
PER_REQUEST_FAMILIES = ("mamba",)


@value_class
class StoredPage:
    """One pool's page as SGLang 0.5.23 stores it in an L3 back end - in hicache's node store, a
    slot of its own: ``page_bytes``, for a page of tokens or (``per_request``) one request's state."""

    pool: str
    page_bytes: int
    per_request: bool


@value_class
class CapacityPlan:
    """Everything one rank registers, with the inputs it was computed from."""

    model: ModelSpec
    tp: int
    page_size: int
    layout: str
    kv_dtype: str
    mamba_slots: int
    host_bytes: int | None
    device_tokens: int | None
    host_to_device_ratio: str | None
    size: PoolSize
    limits: Limits
    pools: tuple[NamedPool, ...]
    ranks_per_host: int | None
    host_memory_bytes: int | None
    reserve_bytes: int
    budget: BudgetVerdict | None
    notes: tuple[str, ...]

    @property
    def total_bytes(self) -> int:
        return sum(p.plan.total_bytes for p in self.pools)

    @property
    def call_count(self) -> int:
        return sum(p.plan.call_count for p in self.pools)

    @property
    def largest_call_bytes(self) -> int:
        return max((p.plan.largest_call_bytes for p in self.pools), default=0)

    def stored_pages(self) -> tuple[StoredPage, ...]:
        """Each pool's L3 page: a page of ``page_size`` tokens of every token pool (the KV, DSA's
        index keys, a sliding window's KV: all of its layers), one request's state of a state pool."""
        return tuple(StoredPage(p.name, p.plan.layout.size_per_token_bytes() * p.plan.layout.page_size,
                                p.plan.layout.family in PER_REQUEST_FAMILIES) for p in self.pools)

    @property
    def max_calls_per_host(self) -> int:
        """Registration calls (and so memory mappings) of all ranks on one host."""
        return self.call_count * (self.ranks_per_host or 1)


#: The defaults of a capacity plan, shared by `plan_capacity` and the CLI: TP 1 as SGLang's
#: ``--tp-size``, 64-token pages, the zero-copy ``page_first_direct`` layout, 100 GB per rank
#: (the CLI's; the library needs a size), 256 linear-attention state slots.
CAPACITY_DEFAULTS = {
    "model": DEFAULT_MODEL, "tp": 1, "page_size": 64, "layout": "page_first_direct",
    "host_gb": 100, "mamba_slots": 256,
}


def plan_capacity(
    model: ModelSpec,
    *,
    limits: Limits,
    tp: int = CAPACITY_DEFAULTS["tp"],
    page_size: int = CAPACITY_DEFAULTS["page_size"],
    layout: str = CAPACITY_DEFAULTS["layout"],
    kv_dtype: str | None = None,
    host_gb=None,
    device_tokens: int | None = None,
    host_to_device_ratio=None,
    mamba_slots: int = CAPACITY_DEFAULTS["mamba_slots"],
    ranks_per_host: int | None = None,
    host_memory_bytes: int | None = None,
    reserve_bytes: int = DEFAULT_RESERVE_BYTES,
    sizing: str = SGLANG_0_5_23,
) -> CapacityPlan:
    """Plan every host pool ``model`` needs on one rank.

    ``sizing``: the pool-sizing rule (`SIZING_RULES`): SGLang 0.5.23's by default, so the plan
    of a pool is what 0.5.23's constructor allocates (its padding page included); ``"ceil"``
    the older ceiling.

    Pool size: ``host_gb`` decimal GB per rank (SGLang's ``--hicache-size``), or
    ``device_tokens * host_to_device_ratio``. Per-request state (linear attention) comes out
    of ``host_gb`` first. With ``host_memory_bytes`` the budget verdict is computed for
    ``ranks_per_host`` ranks; otherwise it is None (not checked).
    """
    tp = check_int(PlanError, "plan_capacity", "tp", tp)
    page_size = check_int(PlanError, "plan_capacity", "page_size", page_size)
    mamba_slots = check_int(PlanError, "plan_capacity", "mamba_slots", mamba_slots)
    dtype = kv_dtype or model.facts.get("torch_dtype") or "bfloat16"
    itemsize = kv_itemsize(dtype)
    recipe = model_pools(model, tp=tp, page_size=page_size, layout=layout, itemsize=itemsize, mamba_slots=mamba_slots)
    state_bytes = sum(state.total_bytes for _, state in recipe.state_pools)
    per_token = sum(build(1).size_per_token_bytes() for _, build in recipe.token_pools)
    host_bytes = None
    if host_gb is not None:
        host_bytes = int(Decimal(str(host_gb)) * 10**9) if not isinstance(host_gb, bool) else host_gb
        if not isinstance(host_bytes, int) or host_bytes <= 0:
            raise PlanError(f"host_gb must be a positive number, got {host_gb!r}")
        left = host_bytes - state_bytes
        if left <= 0:
            raise CapacityError(
                f"host size {format_gb(host_bytes)} does not even hold the per-request state "
                f"({format_gb(state_bytes)})"
            )
        size = size_pool(size_per_token_bytes=per_token, page_size=page_size, host_gb=Decimal(left) / 10**9,
                         device_tokens=device_tokens, rule=sizing)
    else:
        size = size_pool(
            size_per_token_bytes=per_token, page_size=page_size, device_tokens=device_tokens,
            host_to_device_ratio=host_to_device_ratio, rule=sizing,
        )
    pools = [NamedPool(name, plan_pool(build(size.page_num), limits)) for name, build in recipe.token_pools]
    pools += [NamedPool(name, plan_pool(state, limits)) for name, state in recipe.state_pools]
    total = sum(p.plan.total_bytes for p in pools)
    budget = None
    if host_memory_bytes is not None:
        from hicache.plan._budget import assess_budget  # here: a plan without a host figure needs none

        budget = assess_budget(
            total, available_bytes=host_memory_bytes, reserve_bytes=reserve_bytes,
            ranks_per_host=ranks_per_host or 1,
        )
    notes = tuple(size.notes) + recipe.notes
    for pool in pools:
        for buffer in pool.plan.buffers:
            notes += tuple(f"{pool.name}/{buffer.spec.name}: {n}" for n in buffer.plan.notes)
    ratio = None if host_to_device_ratio is None else str(Decimal(str(host_to_device_ratio)))
    return CapacityPlan(
        model, tp, page_size, layout, dtype, mamba_slots, host_bytes, device_tokens, ratio, size,
        limits, tuple(pools), ranks_per_host, host_memory_bytes, reserve_bytes, budget, notes,
    )
