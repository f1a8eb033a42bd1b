"""Host tensor allocators by storage back end (SGLang's `get_allocator_from_storage`).

Owns the registry of allocator types; the allocators themselves live in hicache.effects
(`HostTensorAllocator`: page-aligned, pre-faulted mmap; `"torch"`: a plain `torch.empty`).
Storage back ends add theirs with `register_allocator`.
"""

from __future__ import annotations

import logging
import threading

from hicache.effects import HostAllocator, HostTensorAllocator, TorchHostTensorAllocator
from hicache.errors import PlanError
from hicache.plan import HUGETLBFS_MODES
from hicache.pools._server import server as current_server

logger = logging.getLogger(__name__)

_REGISTRY = {"default": HostTensorAllocator, "torch": TorchHostTensorAllocator}
_REGISTRY_LOCK = threading.Lock()


def register_allocator(allocator_type: str, factory) -> None:
    """Make ``get_allocator_from_storage(allocator_type)`` return ``factory()``."""
    if not isinstance(allocator_type, str) or not allocator_type:
        raise PlanError(f"allocator_type must be a non-empty string, got {allocator_type!r}")
    with _REGISTRY_LOCK:
        _REGISTRY[allocator_type] = factory


def known_allocators() -> tuple[str, ...]:
    with _REGISTRY_LOCK:
        return tuple(sorted(_REGISTRY))


def get_allocator_from_storage(allocator_type: str | None = "default", *, fallback: str | None = "default",
                               strict: bool = False, sglangs: bool = False, server=None):
    """A new allocator for a storage back end, as SGLang's does: ``allocator_type`` is the
    ``--hicache-storage-backend`` name (``None``, ``"file"``, ``"mooncake"``, ...). A registered
    name gets its factory's; with ``sglangs=True`` (a pool built by SGLang 0.5.23's constructor)
    and a server (a pool's: the plug-in's SGLang process), a name the server has an allocator of
    its own for (SGLang: mooncake, mori, shm, tensorcast) gets that; every other name gets the
    ``fallback`` (the default allocator),
    with a log line naming the fallback. ``strict=True`` (hicache's stricter check) makes an unknown
    name an error listing the known ones instead. ``server``: the one to ask (a pool's
    `HostSetup.server`; None: the one the deprecated `hicache.pools.serve_in` handed in, if any)."""
    name = "default" if allocator_type is None else allocator_type
    with _REGISTRY_LOCK:
        factory = _REGISTRY.get(name)
    if factory is None and sglangs:
        asked = current_server() if server is None else server
        theirs = asked.storage_allocator(name)  # the serving process's own (compat: SGLang's)
        if theirs is not None:
            return theirs
    with _REGISTRY_LOCK:
        if factory is None and not strict and fallback is not None:
            factory = _REGISTRY.get(fallback)
            if factory is not None:
                logger.info("no host allocator registered for storage back end %r: using %r", name, fallback)
    if factory is None:
        raise PlanError(
            f"unknown allocator_type {allocator_type!r}; known: {', '.join(known_allocators())} "
            "(register_allocator adds one; strict=False falls back to the default)"
        )
    return factory()


def pool_allocator(allocator_type, *, fallback: str, strict: bool, sglangs: bool, server, numa_node, hugepages,
                   limits):
    """A pool's allocator: the storage back end's (`get_allocator_from_storage`), and where it is
    hicache's own, configured with the pool's NUMA node and page size (``hugepages``; hugetlbfs
    modes cut on ``limits``' huge page)."""
    allocator = get_allocator_from_storage(allocator_type, fallback=fallback, strict=strict, sglangs=sglangs,
                                           server=server)
    if isinstance(allocator, HostAllocator):  # hicache's: settings at construction
        allocator = allocator.configure(numa_node=numa_node, hugepages=hugepages,
                                        hugepage_bytes=limits.hugepage_bytes if hugepages in HUGETLBFS_MODES else None)
    return allocator
