"""The `sglang.srt.plugins` entry point named ``hicache``: hicache's bring-up inside SGLang.

SGLang 0.5.23 loads every entry point of the group in every process (`load_plugins()`) and
patches what they register through `HookRegistry` (a REPLACE hook reaches every ``from X
import name`` too). Every one of its host-pool classes allocates through
`pool_host.common.alloc_with_host_register` and releases through `_cuda_host_unregister`, so
replacing those three functions with hicache's (`hicache.compat.sglang`, SGLang's exact
signatures) puts hicache's planned, all-or-nothing registration under all of them, and its
admission check (`host_memory_budget_bytes`) samples under hicache's host-wide budget lock
against available memory less the host's claims still filling, and an admitted request is
claimed before the lock goes (`hicache.effects.admission`, issue #35). Outside
the SGLang versions it was tested with nothing is patched (one warning); HICACHE_SGLANG=off
turns it off. Reads the environment through hicache.effects only.
"""

from __future__ import annotations

import logging
import re

logger = logging.getLogger(__name__)

#: The SGLang releases this plug-in was tested with: [low, high).
TESTED_RANGE = ((0, 5, 23), (0, 5, 24))
_COMMON = "sglang.srt.mem_cache.pool_host.common"
#: What the plug-in replaces: SGLang's dotted name -> hicache.compat.sglang's function.
TARGETS = {
    f"{_COMMON}.alloc_with_host_register": "alloc_with_host_register",
    f"{_COMMON}._cuda_host_register": "_cuda_host_register",
    f"{_COMMON}._cuda_host_unregister": "_cuda_host_unregister",
}


#: With HICACHE_SGLANG_POOLS=1: SGLang's host-pool classes hicache has and proves against SGLang's
#: own (tests/test_sglang_conformance.py), and where SGLang's assembler builds them, under its own
#: radix tree (tests/test_sglang_radix.py) -> hicache.pools' class
#: (class REPLACE: SGLang's assembler, `get_mha_host_pool_cls` and every ``from X import`` then
#: build hicache's pools - HICACHE_PROGRESSIVE=1 makes them serve before they are pinned)
POOL_CLASSES = {
    "sglang.srt.mem_cache.pool_host.mha.MHATokenToKVPoolHost": "MHATokenToKVPoolHost",
    "sglang.srt.mem_cache.pool_host.mha.AsymmetricMHATokenToKVPoolHost": "AsymmetricMHATokenToKVPoolHost",
    "sglang.srt.mem_cache.pool_host.mla.MLATokenToKVPoolHost": "MLATokenToKVPoolHost",
    "sglang.srt.mem_cache.pool_host.mha.MHATokenToKOnlyPoolHost": "MHATokenToKOnlyPoolHost",
    "sglang.srt.mem_cache.pool_host.mamba.MambaPoolHost": "MambaPoolHost",
    "sglang.srt.mem_cache.memory_pool_host.LogicalHostPool": "LogicalHostPool",
    "sglang.srt.mem_cache.pool_host.dsa.DSAIndexerPoolHost": "DSAIndexerPoolHost",
    "sglang.srt.mem_cache.memory_pool_host.DeepSeekV4PagedHostPool": "DeepSeekV4PagedHostPool",
    "sglang.srt.mem_cache.memory_pool_host.DeepSeekV4StateHostPool": "DeepSeekV4StateHostPool",
}

#: pools SGLang 0.5.23 builds with a class pools mode replaces that hicache's class does not serve,
#: by their ``pool_name``: its HiSparse coordinator's DeepSeek-V4 C4 pool (managers/
#: hisparse_coordinator.py), whose decode backups copy single tokens of the fused C4 page row
#: (`backup_tokens_from_device_all_layer`; hicache's V4 pools move whole page rows). Built as
#: SGLang's own class, its memory hicache's through the seam, as HiSparse's MHA pool is.
SGLANG_BUILT = {"sglang.srt.mem_cache.memory_pool_host.DeepSeekV4PagedHostPool": ("dsv4_hisparse_c4",)}


#: SGLang's admission check, wrapped (AROUND) so ranks sample it one after another under the
#: host-wide budget lock, against available memory less the host's claims still filling, each
#: admitted request claimed before the lock goes (`hicache.effects.admission`, issue #35).
BUDGET_TARGET = "sglang.srt.mem_cache.pool_host.base.host_memory_budget_bytes"
#: SGLang's sample of available memory, wrapped (AROUND) to take those pending claims off while
#: the admission check samples (transparent otherwise; the patch reaches every importer).
AVAILABLE_TARGET = "sglang.srt.mem_cache.host_memory.available_host_memory_bytes"


def _version_tuple(text: str) -> tuple[int, ...] | None:
    match = re.match(r"^(\d+)\.(\d+)\.(\d+)", text or "")
    return tuple(int(part) for part in match.groups()) if match else None


def sglang_version() -> str | None:
    """The installed SGLang's version (None when it is not installed)."""
    from hicache.effects import package_version

    return package_version("sglang")


def supported(version: str | None) -> bool:
    """True for an SGLang version inside `TESTED_RANGE`."""
    parsed = _version_tuple(version)
    low, high = TESTED_RANGE
    return parsed is not None and low <= parsed < high


def _forget_resolved_alloc_funcs() -> None:
    """SGLang's pools pick their allocation function from `ALLOC_MEMORY_FUNCS`, a defaultdict
    whose factory returns the module's `alloc_with_host_register` - and stores it on first use
    ("cuda" included). An entry stored before the hooks apply would keep SGLang's own function
    past the patch, so entries holding it are dropped: the factory then finds the patched one."""
    import importlib

    common = importlib.import_module(_COMMON)
    table = getattr(common, "ALLOC_MEMORY_FUNCS", None)
    original = getattr(common, "alloc_with_host_register", None)
    if table is None or original is None:
        return
    for key, func in list(table.items()):
        if func is original:
            del table[key]


def entry_point_names() -> tuple[str, ...]:
    """The names of the entry points installed in group ``sglang.srt.plugins`` (what SGLang's
    `load_plugins()` discovers)."""
    from importlib.metadata import entry_points

    return tuple(sorted(point.name for point in entry_points(group="sglang.srt.plugins")))


def admitted(env) -> bool:
    """Whether ``SGLANG_PLUGINS`` (SGLang's comma-separated list; unset or empty: all) admits
    the ``hicache`` entry point."""
    raw = (env.get("SGLANG_PLUGINS") or "").strip()
    return not raw or "hicache" in {name.strip() for name in raw.split(",") if name.strip()}


def load() -> list[str]:
    """The entry point SGLang calls: register the REPLACE hooks (applied by SGLang's
    `HookRegistry.apply_hooks()` right after). Returns the targets registered ([] when off or
    outside the tested range)."""
    from hicache.effects import for_sglang

    if not for_sglang.sglang_plugin_enabled():
        logger.info("hicache: HICACHE_SGLANG=off; SGLang's own host-memory registration stays")
        return []
    version = sglang_version()
    if not supported(version):
        low, high = (".".join(map(str, v)) for v in TESTED_RANGE)
        logger.warning("hicache: SGLang %s is outside the range this plug-in was tested with (>=%s, <%s); "
                       "nothing is patched", version, low, high)
        return []
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    from hicache.compat import sglang as ours
    from hicache.effects import pool_settings

    settings = pool_settings()  # a bad HICACHE_* value: an EnvError naming it, before anything is registered
    for target, name in TARGETS.items():
        HookRegistry.register(target, getattr(ours, name), HookType.REPLACE)
    _forget_resolved_alloc_funcs()
    from hicache.effects import admission

    HookRegistry.register(BUDGET_TARGET, admission.host_memory_budget_bytes, HookType.AROUND)
    HookRegistry.register(AVAILABLE_TARGET, admission.available_host_memory_bytes, HookType.AROUND)
    classes = _register_pool_classes(HookRegistry, HookType, settings)
    logger.info("hicache: SGLang %s host memory goes through hicache's bring-up: %s; its admission check "
                "runs under the host-wide budget lock", version, ", ".join(target.rsplit(".", 1)[1] for target in TARGETS))
    return [*TARGETS, BUDGET_TARGET, AVAILABLE_TARGET, *classes]


def served_pool_classes() -> dict[str, type]:
    """SGLang's dotted name -> the hicache pool class SGLang builds there: `POOL_CLASSES`' own,
    each pool class through `hicache.pools.with_host` with SGLang's process as its setup's
    server (the chunk setting, PP sync, back ends' allocators and budget in force it asks); the
    server's scope comes with the class, not a process-wide setting (issue #55 item 3). A pool
    hicache's class does not serve fails SGLang's start naming the switch (`NOT_SERVED_HINT`)."""
    import hicache.pools as pools
    from hicache.compat.sglang_process import SGLangProcess
    from hicache.effects import HostSetup

    setup = HostSetup(server=SGLangProcess())
    classes = {target: getattr(pools, name) for target, name in POOL_CLASSES.items()}
    return {target: _served(target, pools.with_host(cls, setup), SGLANG_BUILT.get(target, ()))
            if issubclass(cls, pools.HostKVCache) else cls  # memoryless: as is
            for target, cls in classes.items()}


#: what a pool hicache's class does not serve (`hicache.errors.NotServedError`) adds in pools mode
NOT_SERVED_HINT = ("Start the server without HICACHE_SGLANG_POOLS=1: SGLang's own host pools serve it, and the "
                   "plug-in still plans, registers and budgets their memory")


def _served(target: str, cls: type, sglang_built: tuple) -> type:
    """``cls`` as SGLang builds it at ``target``: a `NotServedError` from its constructor names
    `NOT_SERVED_HINT`; a pool whose ``pool_name`` (first, or by keyword) is one of
    ``sglang_built`` is built as SGLang's own class at ``target`` (taken now, before the REPLACE;
    the seam pins it)."""
    import importlib
    import inspect

    from hicache.errors import NotServedError

    def __init__(self, *args, **kwargs):
        try:
            cls.__init__(self, *args, **kwargs)
        except NotServedError as error:
            raise NotServedError(f"{error}. {NOT_SERVED_HINT}") from None

    __init__.__signature__, __init__.__doc__ = inspect.signature(cls.__init__), cls.__init__.__doc__  # SGLang's

    namespace = {"__init__": __init__, "__module__": cls.__module__, "__qualname__": cls.__qualname__,
                 "__doc__": cls.__doc__}
    if sglang_built:
        module, name = target.rsplit(".", 1)
        original = getattr(importlib.import_module(module), name)
        if original.__module__.startswith("hicache."):  # already replaced (a second load): SGLang's is not at hand
            raise RuntimeError(f"hicache: {target} is hicache's already: the plug-in was loaded twice without a reset")

        def __new__(klass, *args, **kwargs):
            if kwargs.get("pool_name", args[0] if args else None) in sglang_built:
                return original(*args, **kwargs)  # not a ``klass``: Python runs no ``klass.__init__`` on it
            return super(served, klass).__new__(klass)

        namespace["__new__"] = __new__
    served = type(cls)(cls.__name__, (cls,), namespace)
    return served


def _register_pool_classes(registry, hook_type, settings) -> list[str]:
    """HICACHE_SGLANG_POOLS=1: REPLACE SGLang's host-pool classes in `POOL_CLASSES` with hicache's
    (their 0.5.23 constructors, scoped to SGLang's process: `served_pool_classes`); [] otherwise."""
    if not settings.sglang_pools:
        return []
    for target, cls in served_pool_classes().items():
        registry.register(target, cls, hook_type.REPLACE)
    logger.info("hicache: HICACHE_SGLANG_POOLS=1: SGLang builds hicache's host pools (%s)%s",
                ", ".join(POOL_CLASSES.values()),
                "; progressive (HICACHE_PROGRESSIVE=1): serving from the first registered page" if settings.progressive
                else "")
    return list(POOL_CLASSES)
