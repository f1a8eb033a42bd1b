"""hicache.plan.settings: the one table of settings (``HICACHE_*``) and how a value is read from
it, for the layers that read the environment (effects, the CLI) - a face over `_env` and
`_settings`; pure, as all of hicache.plan (the caller hands the environment in)."""

from hicache.plan._env import BY_NAME, HUGEPAGE_MODES, SETTINGS, Setting, env_value, size_in_range, unknown_variables
from hicache.plan._settings import DEFAULT_HUGEPAGE_BYTES, HUGETLBFS_MODES, check_hugepages

__all__ = ["BY_NAME", "DEFAULT_HUGEPAGE_BYTES", "HUGEPAGE_MODES", "HUGETLBFS_MODES", "SETTINGS", "Setting",
           "check_hugepages", "env_value", "size_in_range", "unknown_variables"]
