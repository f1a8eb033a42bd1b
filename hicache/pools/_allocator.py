"""Host tensor allocators by storage back end (SGLang's `get_allocator_from_storage`).

Owns the registry of allocator types; the allocators themselves live in hicache.effects
(`HostTensorAllocator`: page-aligned, pre-faulted mmap; `"torch"`: a plain `torch.empty`).
Storage back ends add theirs with `register_allocator`.
"""

from __future__ import annotations

import threading

from hicache.effects import HostTensorAllocator, TorchHostTensorAllocator
from hicache.errors import PlanError

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


def get_allocator_from_storage(allocator_type: str = "default", *, fallback: str | None = None):
    """A new allocator of ``allocator_type``; unknown types are an error listing the known ones,
    unless ``fallback`` names one to use instead."""
    with _REGISTRY_LOCK:
        factory = _REGISTRY.get(allocator_type) or (_REGISTRY.get(fallback) if fallback else None)
    if factory is None:
        raise PlanError(
            f"unknown allocator_type {allocator_type!r}; known: {', '.join(known_allocators())} "
            "(register_allocator adds one; fallback= picks one for unknown types)"
        )
    return factory()
