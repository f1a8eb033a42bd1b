"""The live SGLang process as hicache's pools need it (issue #34 item 3): the one place outside
the plug-in's hooks that reads SGLang's loaded modules. `SGLangProcess` answers the pools'
questions (`hicache.pools.NoServer`'s, as their `HostSetup.server`): SGLANG_HICACHE_HOST_REGISTER_CHUNK_GB through
SGLang's own `envs` accessor (what its tests patch, its handling of a bad value), its PP-group
sync of a fixed --hicache-size, the allocator SGLang's `get_allocator_from_storage` gives a
storage back end that brings its own memory, and the budget of SGLang's
`host_memory_budget_scope` (its auto-sizing books every pool built inside against one snapshot). Modules are looked up, never imported: a process
where SGLang did not load one simply has no answer there.
"""

from __future__ import annotations

import logging
import sys

logger = logging.getLogger(__name__)

_ENVIRON = "sglang.srt.environ"
_BASE = "sglang.srt.mem_cache.pool_host.base"
_COMMON = "sglang.srt.mem_cache.pool_host.common"
_RUNTIME = "sglang.srt.runtime_context"


class SGLangProcess:
    """SGLang 0.5.23 as the pools see it; the server of the pool classes the plug-in gives
    SGLang (`sglang_plugin.served_pool_classes`, through `hicache.pools.with_host`)."""

    name = "sglang"

    def chunk_limit_bytes(self) -> int | None:
        """SGLANG_HICACHE_HOST_REGISTER_CHUNK_GB as SGLang reads it (GiB, at least 1), or None
        where SGLang's `envs` is not loaded."""
        envs = getattr(sys.modules.get(_ENVIRON), "envs", None)
        setting = getattr(envs, "SGLANG_HICACHE_HOST_REGISTER_CHUNK_GB", None)
        return None if setting is None else max(int(setting.get()), 1) * 2**30

    def synced_size(self, size: int, host_size: float) -> int:
        """SGLang's PP-group minimum for a fixed --hicache-size (it acts only under an initialized
        torch.distributed with a pipeline group; otherwise it returns ``size``)."""
        sync = getattr(sys.modules.get(_BASE), "sync_fixed_hicache_size", None)
        return int(sync(size, host_size)) if sync is not None else size

    def io_backend(self) -> str | None:
        """``--hicache-io-backend`` as the server published it (SGLang's own `get_memory()`, read
        as its pools read it to refuse a pair at construction), after its start-up rewrites
        (page_first_direct + kernel becomes direct); None where nothing was published."""
        context = sys.modules.get(_RUNTIME)
        get_memory = getattr(context, "get_memory", None)
        if get_memory is None:
            return None
        try:
            backend = get_memory().hicache_io_backend
        except (AttributeError, KeyError, ValueError):  # not published (a script, a test)
            return None
        return backend if isinstance(backend, str) else None

    def book_host_memory(self, nbytes: int) -> int | None:
        """Inside SGLang's `host_memory_budget_scope` (its auto-sizing, its tests): SGLang's own
        `host_memory_budget_bytes(nbytes)`, which books ``nbytes`` against the scope's snapshot
        when they fit and returns the allowance before - as SGLang's own pools are admitted there
        (through the plug-in's admission hook, which claims them on the host-wide lock). None
        outside a scope, or where SGLang's pool module is not loaded."""
        base = sys.modules.get(_BASE)
        scope = getattr(base, "_host_memory_budget", None)
        if scope is None or scope.get() is None:
            return None
        return int(base.host_memory_budget_bytes(nbytes))

    def host_memory_settled(self, nbytes: int, *, up: bool) -> None:
        """The plug-in's claim for a request `book_host_memory` admitted: paid off once the pool
        is up (its memory is resident), dropped when it failed - as compat's
        ``alloc_with_host_register`` settles SGLang's own pools' claims."""
        from hicache.effects import admission

        if up:
            admission.resident(nbytes)
        else:
            admission.abandon()

    def storage_allocator(self, name: str):
        """The allocator SGLang's own `get_allocator_from_storage` gives back end ``name`` when
        it brings its memory (Mooncake's, UMBP's, TensorCast's, "shm"'s `ShmHostTensorAllocator`);
        None where SGLang would use its plain default (hicache's default serves instead)."""
        common = sys.modules.get(_COMMON)
        get = getattr(common, "get_allocator_from_storage", None)
        plain = getattr(common, "HostTensorAllocator", None)
        if get is None or plain is None:
            return None
        allocator = get(name)
        if type(allocator) is plain:  # SGLang's default (or its fallback when a back end is missing)
            return None
        logger.info("host allocator for storage back end %r: SGLang's %s", name, type(allocator).__name__)
        return allocator
