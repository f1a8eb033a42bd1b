"""Host tensor allocators, chosen by storage back end (SGLang's `get_allocator_from_storage`).

Owns the registry of allocator types. `"default"` maps hicache's page-aligned anonymous memory
and pre-faults it in parallel; `"torch"` is a plain `torch.empty`. Storage back ends add theirs
with `register_allocator`. Allocated memory lives as long as any tensor viewing it.
"""

from __future__ import annotations

import threading

from hicache.effects import allocate_host, prefault
from hicache.errors import PlanError, RegistrationStateError


class HostTensorAllocator:
    """Allocates host tensors for KV pools: page-aligned mmap, pre-faulted from N threads.

    Not ``torch.empty(pin_memory=True)``: that rounds every block up to a power of two
    (sglang PR #37285). Pinning is the registration step's job, not the allocator's.
    """

    def __init__(self, *, prefault_threads: int | None = None, hugepages: str = "off") -> None:
        self.prefault_threads = prefault_threads
        self.hugepages = hugepages
        self.buffers = []  # HostBuffers handed out, for destroy()
        self._lock = threading.Lock()

    def allocate(self, dims, dtype, device="cpu", pin_memory: bool = False):
        """A tensor of ``dims`` x ``dtype`` on page-aligned, pre-faulted host memory."""
        import torch

        dims = tuple(int(d) for d in dims)
        if str(device) not in ("cpu",):
            return torch.empty(dims, dtype=dtype, device=device, pin_memory=pin_memory)
        itemsize = torch.empty((), dtype=dtype).element_size()
        nbytes = itemsize
        for d in dims:
            nbytes *= d
        buffer = allocate_host(nbytes, hugepages=self.hugepages)
        prefault(buffer, threads=self.prefault_threads)
        with self._lock:
            self.buffers.append(buffer)
        return buffer.tensor.view(dtype).view(dims)

    def free_all(self, *, ledger=None) -> None:
        """Unmap every buffer this allocator made; one still registered is kept, and the first
        such refusal is raised after every other buffer was freed."""
        with self._lock:
            buffers, self.buffers = self.buffers, []
        kept, errors = [], []
        for buffer in buffers:
            try:
                buffer.free(ledger=ledger)
            except RegistrationStateError as error:
                kept.append(buffer)
                errors.append(error)
        with self._lock:
            self.buffers.extend(kept)
        if errors:
            raise errors[0]


class TorchHostTensorAllocator:
    """``torch.empty`` host tensors (optionally pinned by torch) - for small or test pools."""

    def allocate(self, dims, dtype, device="cpu", pin_memory: bool = False):
        import torch

        return torch.empty(tuple(dims), dtype=dtype, device=device, pin_memory=pin_memory)

    def free_all(self, *, ledger=None) -> None:
        """Nothing to do: torch frees its tensors when they die."""


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
