"""hicache.plan: the pure core. Layouts and limits in, frozen registration plans out.

No I/O, environment, clocks, randomness, torch or CUDA here (ARCHITECTURE.md, "The one rule");
tests/test_purity.py enforces it. Beside this face, four sub-faces by audience, for the layers
that act on them: `hicache.plan.settings` (the ``HICACHE_*`` table and its readers),
`store_format` (the node store's arena format), `transfer` (which engine moves a batch) and
`thp` (the ``hugepages="auto"`` decision).
"""

from typing import TYPE_CHECKING

if TYPE_CHECKING:  # what type checkers read (py.typed): the same names from the same homes as _HOMES,
    # re-exported (``X as X``); to them the lazy __getattr__ below would make each one Any
    from hicache.plan._capacity import (
        DEFAULT_RESERVE_BYTES as DEFAULT_RESERVE_BYTES, SGLANG_0_5_23 as SGLANG_0_5_23,
        SIZING_RULES as SIZING_RULES, host_tokens as host_tokens, pages_for as pages_for, PoolSize as PoolSize,
        size_pool as size_pool,
    )
    from hicache.plan._budget import (
        BudgetVerdict as BudgetVerdict, assess_budget as assess_budget, check_budget as check_budget,
    )
    from hicache.plan._capacity_plan import (
        CAPACITY_DEFAULTS as CAPACITY_DEFAULTS, CapacityPlan as CapacityPlan, NamedPool as NamedPool,
        plan_capacity as plan_capacity,
    )
    from hicache.plan._codec import (
        SCHEMA_VERSION as SCHEMA_VERSION, from_jsonable as from_jsonable, to_jsonable as to_jsonable,
    )
    from hicache.plan._layouts import (
        LAYOUT_CLASSES as LAYOUT_CLASSES, LAYOUT_RULES as LAYOUT_RULES, BufferSpec as BufferSpec,
        dsa_indexer_pages as dsa_indexer_pages,
    )
    from hicache.plan._layouts_mha import (
        MHALayout as MHALayout,
    )
    from hicache.plan._layouts_kv_split import (
        AsymmetricMHALayout as AsymmetricMHALayout, MHAKOnlyLayout as MHAKOnlyLayout,
    )
    from hicache.plan._layouts_mla import (
        DSAIndexerLayout as DSAIndexerLayout, MLALayout as MLALayout,
    )
    from hicache.plan._layouts_state import (
        DeepSeekV4PagedLayout as DeepSeekV4PagedLayout, DeepSeekV4StateLayout as DeepSeekV4StateLayout,
        MambaLayout as MambaLayout,
    )
    from hicache.plan._limits import (
        DEFAULT_CALL_CAP_BYTES as DEFAULT_CALL_CAP_BYTES, DEFAULT_CHUNK_LIMIT_BYTES as DEFAULT_CHUNK_LIMIT_BYTES,
        DRIVER_CEILING_BYTES as DRIVER_CEILING_BYTES, KERNEL_PIN_CAP_BYTES as KERNEL_PIN_CAP_BYTES,
        Limits as Limits, kernel_pin_cap as kernel_pin_cap, parse_kernel_release as parse_kernel_release,
    )
    from hicache.plan._planner import (
        RegistrationPlan as RegistrationPlan, pace as pace, pace_head as pace_head,
        plan_registration as plan_registration, replan as replan,
    )
    from hicache.plan._models import (
        DEFAULT_MODEL as DEFAULT_MODEL, KV_DTYPES as KV_DTYPES, PRESETS as PRESETS, ConfigError as ConfigError,
        ModelSpec as ModelSpec, model_from_hf_config as model_from_hf_config,
    )
    from hicache.plan._intervals import (
        IntervalSet as IntervalSet,
    )
    from hicache.plan._pool import (
        BufferPlan as BufferPlan, PoolPlan as PoolPlan, plan_pool as plan_pool,
    )
    from hicache.plan._range import (
        Range as Range,
    )
    from hicache.plan._store import (
        StorePlan as StorePlan, plan_store as plan_store,
    )
    from hicache.plan._slot_policy import (
        SlotView as SlotView, claimed_generation as claimed_generation, home_slot as home_slot,
        published_generation as published_generation, reclaimed_generation as reclaimed_generation,
        victim_order as victim_order, window_of as window_of,
    )
    from hicache.plan._settings import (
        DEFAULT_HUGEPAGE_BYTES as DEFAULT_HUGEPAGE_BYTES, HUGEPAGE_MODES as HUGEPAGE_MODES,
        HUGETLBFS_MODES as HUGETLBFS_MODES, SETTINGS_ENV as SETTINGS_ENV, SGLANG_CHUNK_ENV as SGLANG_CHUNK_ENV,
        ResolvedLimits as ResolvedLimits, env_size as env_size, resolve_limits as resolve_limits,
    )
    from hicache.errors import (
        EnvError as EnvError,
    )
    from hicache.plan._units import (
        format_bytes as format_bytes, format_gb as format_gb, format_progress as format_progress,
        parse_size as parse_size,
    )

#: Where each public name lives. Its module is imported on first use (PEP 562): `hicache plan`
#: starts in the time of the modules it runs (issue #35 item 4: <= 1.5x `import attrs`), not of all.
_HOMES = {
    **dict.fromkeys((
        "DEFAULT_RESERVE_BYTES", "SGLANG_0_5_23", "SIZING_RULES", "host_tokens", "pages_for", "PoolSize", "size_pool"
    ), "hicache.plan._capacity"),
    **dict.fromkeys(("BudgetVerdict", "assess_budget", "check_budget"), "hicache.plan._budget"),
    **dict.fromkeys(("CAPACITY_DEFAULTS", "CapacityPlan", "NamedPool", "plan_capacity"), "hicache.plan._capacity_plan"),
    **dict.fromkeys(("SCHEMA_VERSION", "from_jsonable", "to_jsonable"), "hicache.plan._codec"),
    **dict.fromkeys(("LAYOUT_CLASSES", "LAYOUT_RULES", "BufferSpec", "dsa_indexer_pages"), "hicache.plan._layouts"),
    **dict.fromkeys(("MHALayout",), "hicache.plan._layouts_mha"),
    **dict.fromkeys(("AsymmetricMHALayout", "MHAKOnlyLayout"), "hicache.plan._layouts_kv_split"),
    **dict.fromkeys(("DSAIndexerLayout", "MLALayout"), "hicache.plan._layouts_mla"),
    **dict.fromkeys(("DeepSeekV4PagedLayout", "DeepSeekV4StateLayout", "MambaLayout"), "hicache.plan._layouts_state"),
    **dict.fromkeys((
        "DEFAULT_CALL_CAP_BYTES", "DEFAULT_CHUNK_LIMIT_BYTES", "DRIVER_CEILING_BYTES", "KERNEL_PIN_CAP_BYTES", "Limits",
        "kernel_pin_cap",
        "parse_kernel_release"
    ), "hicache.plan._limits"),
    **dict.fromkeys(("RegistrationPlan", "pace", "pace_head", "plan_registration", "replan"), "hicache.plan._planner"),
    **dict.fromkeys((
        "DEFAULT_MODEL", "KV_DTYPES", "PRESETS", "ConfigError", "ModelSpec", "model_from_hf_config"
    ), "hicache.plan._models"),
    **dict.fromkeys(("IntervalSet",), "hicache.plan._intervals"),
    **dict.fromkeys(("BufferPlan", "PoolPlan", "plan_pool"), "hicache.plan._pool"),
    **dict.fromkeys(("Range",), "hicache.plan._range"),
    **dict.fromkeys(("StorePlan", "plan_store"), "hicache.plan._store"),
    **dict.fromkeys((
        "SlotView", "claimed_generation", "home_slot", "published_generation", "reclaimed_generation", "victim_order",
        "window_of"
    ), "hicache.plan._slot_policy"),
    **dict.fromkeys((
        "DEFAULT_HUGEPAGE_BYTES", "HUGEPAGE_MODES", "HUGETLBFS_MODES", "SETTINGS_ENV", "SGLANG_CHUNK_ENV",
        "ResolvedLimits", "env_size", "resolve_limits"
    ), "hicache.plan._settings"),
    **dict.fromkeys(("EnvError",), "hicache.errors"),
    **dict.fromkeys(("format_bytes", "format_gb", "format_progress", "parse_size"), "hicache.plan._units"),
}


def __getattr__(name: str):
    """Import the module that holds ``name`` and keep its value here (the next lookup is plain)."""
    home = _HOMES.get(name)
    if home is None:
        raise AttributeError(f"module 'hicache.plan' has no attribute {name!r}")
    import importlib

    value = getattr(importlib.import_module(home), name)
    globals()[name] = value
    return value


def __dir__() -> list:
    return sorted({*globals(), *__all__})


__all__ = list(_HOMES)  # the public names: exactly those with a home
