"""Host tensor allocators: the memory half of a bring-up (`hicache.effects._bringup._bring_up`).

Owns the `HostAllocator` protocol - what a bring-up may ask of an allocator, declared once so
nobody probes allocators with ``hasattr`` - and how a host buffer's tensor comes to exist.
`HostTensorAllocator` maps page-aligned anonymous memory and pre-faults it in parallel (times
kept for reports); `TorchHostTensorAllocator` is a plain `torch.empty`;
`FrameworkPinnedAllocator` lets torch pin (NPU, MUSA); `host_allocator` adapts any object with
``allocate``/``free_all`` (a storage back end's). Settings (NUMA node, hugepages, pre-fault
threads) are given at construction (`configure` makes a configured copy). The registry of
allocator types by storage back end lives in hicache.pools; pinning is the bring-up's job.
"""

from __future__ import annotations

import threading
import time
from typing import Protocol, runtime_checkable

from hicache.effects._host import _memory
from hicache.effects._host._memory import allocate_host, prefault
from hicache.errors import RegistrationStateError


def _nbytes(dims, dtype) -> int:
    import torch

    nbytes = torch.empty((), dtype=dtype).element_size()
    for d in dims:
        nbytes *= d
    return nbytes


@runtime_checkable
class HostAllocator(Protocol):
    """What a bring-up asks of an allocator. ``can_map_unfaulted``: `allocate_unfaulted`
    works (the pipelined and progressive modes need it); ``owned()``: what must stay mapped
    if CUDA may still pin it; ``prefault_threads``: threads a background pre-fault may use
    (None: one per core, at most 16); `configure` returns a copy with those settings."""

    can_map_unfaulted: bool
    prefault_threads: int | None

    def allocate(self, dims, dtype, device="cpu", pin_memory: bool = False): ...

    def allocate_unfaulted(self, dims, dtype): ...

    def free_all(self, *, ledger=None) -> None: ...

    def owned(self) -> list: ...

    def add_prefault_time(self, seconds: float) -> None: ...

    def configure(self, *, numa_node=None, hugepages: str = "off", hugepage_bytes=None) -> "HostAllocator": ...


class _Allocator:
    """The protocol's defaults: no unfaulted mapping, nothing owned, nothing to configure."""

    can_map_unfaulted = False
    prefault_threads = None

    def allocate_unfaulted(self, dims, dtype):
        raise RegistrationStateError(f"{type(self).__name__} cannot map memory without faulting it")

    def free_all(self, *, ledger=None) -> None:
        """Nothing to do: torch frees its tensors when they die."""

    def owned(self) -> list:
        return []

    def add_prefault_time(self, seconds: float) -> None:
        pass

    def configure(self, *, numa_node=None, hugepages: str = "off", hugepage_bytes=None):
        return self


class _Adapted(_Allocator):
    """An object with ``allocate``/``free_all`` only (a storage back end's), as a `HostAllocator`."""

    def __init__(self, inner) -> None:
        self.inner = inner

    def allocate(self, dims, dtype, device="cpu", pin_memory: bool = False):
        return self.inner.allocate(dims, dtype=dtype, device=device)

    def free_all(self, *, ledger=None) -> None:
        free_all = getattr(self.inner, "free_all", None)  # the one probe: foreign allocators
        if free_all is not None:
            free_all(ledger=ledger)

    def __repr__(self) -> str:
        return f"<adapted allocator {self.inner!r}>"


def host_allocator(allocator) -> HostAllocator:
    """``allocator`` as a `HostAllocator` (None: a new `HostTensorAllocator`)."""
    if allocator is None:
        return HostTensorAllocator()
    if isinstance(allocator, _Allocator):
        return allocator
    if not callable(getattr(allocator, "allocate", None)):
        raise TypeError(f"an allocator needs allocate(dims, dtype, device), got {allocator!r}")
    return _Adapted(allocator)


class HostTensorAllocator(_Allocator):
    """Allocates host tensors for KV pools: page-aligned mmap, pre-faulted from N threads.

    Not ``torch.empty(pin_memory=True)``: that rounds every block up to a power of two
    (sglang PR #37285). ``hugepages``/``hugepage_bytes`` as `allocate_host` (``"auto"`` by default: a
    bring-up's pre-fault decides each piece against a 4 KiB reference piece; `allocate`, which
    faults the whole buffer at once with nothing to compare it to, keeps 4 KiB pages). ``allocate_s`` and
    ``prefault_s`` add up the time spent mapping and faulting.
    """

    def __init__(self, *, prefault_threads: int | None = None, hugepages: str = "auto",
                 hugepage_bytes: int | None = None, numa_node: int | None = None) -> None:
        self.prefault_threads = prefault_threads
        self.numa_node = numa_node  # bind every buffer there (see effects/_host/_numa)
        # a size the kernel does not offer: required is refused here, before any memory (issue #33)
        self.hugepage_note = _memory.hugepage_size_note(hugepages, hugepage_bytes)
        self.hugepages = hugepages
        self.hugepage_bytes = hugepage_bytes
        self.buffers = []  # HostBuffers handed out, for free_all()
        self.allocate_s = 0.0
        self.prefault_s = 0.0
        self._lock = threading.Lock()

    can_map_unfaulted = True

    def configure(self, *, numa_node=None, hugepages: str = "off", hugepage_bytes=None) -> "HostTensorAllocator":
        """A new allocator with these settings and this one's pre-fault threads."""
        return HostTensorAllocator(prefault_threads=self.prefault_threads, hugepages=hugepages,
                                   hugepage_bytes=hugepage_bytes, numa_node=numa_node)

    def add_prefault_time(self, seconds: float) -> None:
        self.prefault_s += seconds

    def allocate(self, dims, dtype, device="cpu", pin_memory: bool = False):
        """A tensor of ``dims`` x ``dtype`` on page-aligned, pre-faulted host memory."""
        import torch

        dims = tuple(int(d) for d in dims)
        if str(device) not in ("cpu",):
            return torch.empty(dims, dtype=dtype, device=device, pin_memory=pin_memory)
        start = time.perf_counter()
        kwargs = {"hugepage_bytes": self.hugepage_bytes} if self.hugepage_bytes else {}
        buffer = allocate_host(_nbytes(dims, dtype), hugepages=self.hugepages, numa_node=self.numa_node, **kwargs)
        with self._lock:  # tracked before the slow part: an interrupt there still frees it
            self.buffers.append(buffer)
        middle = time.perf_counter()
        prefault(buffer, threads=self.prefault_threads)
        end = time.perf_counter()
        self.allocate_s += middle - start
        self.prefault_s += end - middle
        return buffer.tensor.view(dtype).view(dims)

    def allocate_unfaulted(self, dims, dtype):
        """``(tensor, HostBuffer)`` mapped but not yet pre-faulted: the bring-up faults it in
        the background while it registers (see effects/_bringup/_faulting)."""
        dims = tuple(int(d) for d in dims)
        start = time.perf_counter()
        kwargs = {"hugepage_bytes": self.hugepage_bytes} if self.hugepage_bytes else {}
        buffer = allocate_host(_nbytes(dims, dtype), hugepages=self.hugepages, numa_node=self.numa_node, **kwargs)
        with self._lock:
            self.buffers.append(buffer)
        self.allocate_s += time.perf_counter() - start
        return buffer.tensor.view(dtype).view(dims), buffer

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

    def owned(self) -> list:
        """What must stay mapped if CUDA may still pin it (see `quarantine`)."""
        with self._lock:
            return list(self.buffers)


class TorchHostTensorAllocator(_Allocator):
    """``torch.empty`` host tensors (optionally pinned by torch) - for small or test pools."""

    def allocate(self, dims, dtype, device="cpu", pin_memory: bool = False):
        import torch

        return torch.empty(tuple(dims), dtype=dtype, device=device, pin_memory=pin_memory)


class FrameworkPinnedAllocator(_Allocator):
    """``torch.empty(pin_memory=True)``: devices whose framework pins host memory itself."""

    def allocate(self, dims, dtype, device="cpu", pin_memory: bool = True):
        import torch

        return torch.empty(tuple(dims), dtype=dtype, pin_memory=True)
