"""The node store's SGLang back end's `extra_config`: the keys it reads (`CONFIG_KEYS`, the
table docs/store.md shows) and their check - every unknown key and bad value named at once, from
SGLang's factory, before any memory is taken."""

from __future__ import annotations

import math

from hicache.errors import ArenaError, PlanError
from hicache.plan.checks import is_integer, is_real
from hicache.plan.store_format import check_label
from hicache.store import MAX_PREFAULT_THREADS

#: extra_config keys this back end reads (beside SGLang's own backend_name/module_path/
#: class_name/interface_v1), and what each means - docs/store.md renders this table.
CONFIG_KEYS = {
    "arena": "path of the arena file on tmpfs (/dev/shm/...) or hugetlbfs (required)",
    "size_gb": "arena size in GB (10**9 bytes, as --hicache-size): create it when missing; "
               "absent: attach an existing arena only (one a creator is still making is waited for)",
    "slot_bytes": "bytes per slot when this engine creates the arena (default: its largest page)",
    "label": "a name for operators, shown by `hicache store status`: at most 64 bytes of printable text "
             "(default: the served model's name, shortened in the middle to fit)",
    "prefault_threads": "threads pre-faulting a new arena, at most 1024 (default: the CPUs, at most 16)",
}
SGLANG_KEYS = ("backend_name", "module_path", "class_name", "interface_v1")


def check_config(extra: dict) -> dict:
    """The validated extra_config: every unknown key and bad value named, at once."""
    problems = []
    # file_storage_path: SGLang adds it to every back end's extra_config when --file-storage-path is set
    unknown = sorted(set(extra) - set(CONFIG_KEYS) - set(SGLANG_KEYS) - {"file_storage_path"})
    if unknown:
        problems.append(f"unknown key(s) {unknown} (known: {sorted(CONFIG_KEYS)})")
    arena = extra.get("arena")
    if not isinstance(arena, str) or not arena.startswith("/"):
        problems.append(f"'arena' must be an absolute path of the arena file, got {arena!r}")
    size = extra.get("size_gb")
    if size is not None and not (is_real(size) and math.isfinite(size) and size > 0):  # JSON reads Infinity
        problems.append(f"'size_gb' must be a positive number of GB, got {size!r}")
    for key in ("slot_bytes", "prefault_threads"):
        value = extra.get(key)
        if value is not None and not (is_integer(value) and value > 0):
            problems.append(f"{key!r} must be a positive integer, got {value!r}")
    threads = extra.get("prefault_threads")
    if is_integer(threads) and threads > MAX_PREFAULT_THREADS:
        problems.append(f"'prefault_threads' must be at most {MAX_PREFAULT_THREADS}, got {threads!r}")
    if extra.get("label") is not None:
        try:
            check_label(extra["label"], where="'label'")
        except PlanError as error:
            problems.append(str(error))
    if problems:
        raise ArenaError("HiCacheNodeStore extra_config: " + "; ".join(problems))
    return extra
