"""Host tensor allocators by storage back end (SGLang's `get_allocator_from_storage`).

Owns the registry of allocator types; the allocators themselves live in hicache.effects
(`HostTensorAllocator`: page-aligned, pre-faulted mmap; `"torch"`: a plain `torch.empty`).
Storage back ends add theirs with `register_allocator`.
"""

from __future__ import annotations

import logging
import threading

from hicache.effects import HostTensorAllocator, TorchHostTensorAllocator
from hicache.errors import PlanError

logger = logging.getLogger(__name__)

_REGISTRY = {"default": HostTensorAllocator, "torch": TorchHostTensorAllocator}
_REGISTRY_LOCK = threading.Lock()


def register_allocator(allocator_type: str, factory) -> None:
    """Make ``get_allocator_from_storage(allocator_type)`` return ``factory()``."""
    if not isinstance(allocator_type, str) or not allocator_type:
        raise PlanError(f"allocator_type must be a non-empty string, got {allocator_type!r}")
    with _REGISTRY_LOCK:
        _REGISTRY[allocator_type] = factory


_SGLANG_COMMON = "sglang.srt.mem_cache.pool_host.common"


def _sglangs_allocator(name: str):
    """Inside SGLang (its pool module loaded): the allocator SGLang's own
    `get_allocator_from_storage` gives a back end that brings its memory - Mooncake's, UMBP's,
    TensorCast's, ``"shm"``'s `ShmHostTensorAllocator` (``fd``/``mm``) - whose memory hicache
    then plans and registers; None where SGLang would use its plain default allocator (hicache's
    default serves instead) or SGLang is not loaded."""
    import sys

    common = sys.modules.get(_SGLANG_COMMON)
    get = getattr(common, "get_allocator_from_storage", None)
    plain = getattr(common, "HostTensorAllocator", None)
    if get is None or plain is None:
        return None
    allocator = get(name)
    if type(allocator) is plain:  # SGLang's default (or its fallback when a back end is missing)
        return None
    logger.info("host allocator for storage back end %r: SGLang's %s", name, type(allocator).__name__)
    return allocator


def known_allocators() -> tuple[str, ...]:
    with _REGISTRY_LOCK:
        return tuple(sorted(_REGISTRY))


def get_allocator_from_storage(allocator_type: str | None = "default", *, fallback: str | None = "default",
                               strict: bool = False, sglangs: bool = False):
    """A new allocator for a storage back end, as SGLang's does: ``allocator_type`` is the
    ``--hicache-storage-backend`` name (``None``, ``"file"``, ``"mooncake"``, ...). A registered
    name gets its factory's; with ``sglangs=True`` (a pool built by SGLang 0.5.23's constructor)
    and SGLang loaded, a name SGLang has an allocator of its own for (mooncake, mori, shm,
    tensorcast) gets SGLang's; every other name gets the ``fallback`` (the default allocator),
    with a log line naming the fallback. ``strict=True`` (hicache's stricter check) makes an unknown
    name an error listing the known ones instead."""
    name = "default" if allocator_type is None else allocator_type
    with _REGISTRY_LOCK:
        factory = _REGISTRY.get(name)
    if factory is None and sglangs:
        theirs = _sglangs_allocator(name)
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
