"""hicache.plan: the pure core. Layouts and limits in, frozen registration plans out.

No I/O, environment, clocks, randomness, torch or CUDA here (ARCHITECTURE.md, "The one rule");
tests/test_purity.py enforces it.
"""

from hicache.plan._capacity import (
    DEFAULT_RESERVE_BYTES,
    SIZING_RULES,
    host_tokens,
    pages_for,
    BudgetVerdict,
    PoolSize,
    assess_budget,
    check_budget,
    size_pool,
)
from hicache.plan._capacity_plan import CAPACITY_DEFAULTS, CapacityPlan, NamedPool, plan_capacity
from hicache.plan._codec import SCHEMA_VERSION, from_jsonable, to_jsonable
from hicache.plan._layouts import (
    LAYOUT_CLASSES,
    LAYOUT_RULES,
    AsymmetricMHALayout,
    BufferSpec,
    DeepSeekV4PagedLayout,
    DeepSeekV4StateLayout,
    DSAIndexerLayout,
    MambaLayout,
    MHAKOnlyLayout,
    MHALayout,
    MLALayout,
    dsa_indexer_pages,
)
from hicache.plan._limits import (
    DEFAULT_CHUNK_LIMIT_BYTES,
    DRIVER_CEILING_BYTES,
    KERNEL_PIN_CAP_BYTES,
    Limits,
    kernel_pin_cap,
    parse_kernel_release,
)
from hicache.plan._planner import RegistrationPlan, pace, pace_head, plan_registration, replan
from hicache.plan._models import (
    DEFAULT_MODEL,
    KV_DTYPES,
    PRESETS,
    ConfigError,
    ModelSpec,
    model_from_hf_config,
)
from hicache.plan._intervals import IntervalSet
from hicache.plan._pool import BufferPlan, PoolPlan, plan_pool
from hicache.plan._range import Range
from hicache.plan._store import StorePlan, plan_store
from hicache.plan._settings import (
    DEFAULT_HUGEPAGE_BYTES,
    HUGEPAGE_MODES,
    HUGETLBFS_MODES,
    SETTINGS_ENV,
    SGLANG_CHUNK_ENV,
    ResolvedLimits,
    env_size,
    resolve_limits,
)
from hicache.errors import EnvError
from hicache.plan._units import format_bytes, format_gb, format_progress, parse_size

__all__ = [
    "pace",
    "pace_head",
    "SIZING_RULES",
    "host_tokens",
    "pages_for",
    "dsa_indexer_pages",
    "CAPACITY_DEFAULTS",
    "SETTINGS_ENV",
    "IntervalSet",
    "SGLANG_CHUNK_ENV",
    "DEFAULT_HUGEPAGE_BYTES",
    "HUGEPAGE_MODES",
    "HUGETLBFS_MODES",
    "EnvError",
    "ResolvedLimits",
    "env_size",
    "resolve_limits",
    "AsymmetricMHALayout",
    "BudgetVerdict",
    "BufferPlan",
    "BufferSpec",
    "CapacityPlan",
    "ConfigError",
    "DEFAULT_MODEL",
    "KV_DTYPES",
    "ModelSpec",
    "NamedPool",
    "PRESETS",
    "model_from_hf_config",
    "plan_capacity",
    "DEFAULT_CHUNK_LIMIT_BYTES",
    "DEFAULT_RESERVE_BYTES",
    "DRIVER_CEILING_BYTES",
    "DSAIndexerLayout",
    "DeepSeekV4PagedLayout",
    "DeepSeekV4StateLayout",
    "KERNEL_PIN_CAP_BYTES",
    "LAYOUT_CLASSES",
    "LAYOUT_RULES",
    "Limits",
    "MHAKOnlyLayout",
    "MHALayout",
    "MLALayout",
    "MambaLayout",
    "PoolPlan",
    "PoolSize",
    "Range",
    "StorePlan",
    "plan_store",
    "RegistrationPlan",
    "SCHEMA_VERSION",
    "assess_budget",
    "check_budget",
    "format_bytes",
    "format_gb",
    "format_progress",
    "kernel_pin_cap",
    "parse_kernel_release",
    "from_jsonable",
    "parse_size",
    "plan_pool",
    "plan_registration",
    "replan",
    "size_pool",
    "to_jsonable",
]
