"""hicache.plan: the pure core. Layouts and limits in, frozen registration plans out.

No I/O, environment, clocks, randomness, torch or CUDA here (ARCHITECTURE.md, "The one rule");
tests/test_purity.py enforces it. Beside this face, four sub-faces by audience, for the layers
that act on them: `hicache.plan.settings` (the ``HICACHE_*`` table and its readers),
`store_format` (the node store's arena format), `transfer` (which engine moves a batch) and
`thp` (the ``hugepages="auto"`` decision).
"""

#: Where each public name lives. Its module is imported on first use (PEP 562): `hicache plan`
#: starts in the time of the modules it runs (issue #35 item 4: <= 1.5x `import attrs`), not of all.
_HOMES = {
    **dict.fromkeys((
        "DEFAULT_RESERVE_BYTES", "SGLANG_0_5_23", "SIZING_RULES", "host_tokens", "pages_for", "PoolSize", "size_pool"
    ), "hicache.plan._capacity"),
    **dict.fromkeys(("BudgetVerdict", "assess_budget", "check_budget"), "hicache.plan._budget"),
    **dict.fromkeys(("CAPACITY_DEFAULTS", "CapacityPlan", "NamedPool", "plan_capacity"), "hicache.plan._capacity_plan"),
    **dict.fromkeys(("SCHEMA_VERSION", "from_jsonable", "to_jsonable"), "hicache.plan._codec"),
    **dict.fromkeys((
        "LAYOUT_CLASSES", "LAYOUT_RULES", "AsymmetricMHALayout", "BufferSpec", "DeepSeekV4PagedLayout",
        "DeepSeekV4StateLayout", "DSAIndexerLayout", "MambaLayout", "MHAKOnlyLayout", "MHALayout", "MLALayout",
        "dsa_indexer_pages"
    ), "hicache.plan._layouts"),
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
