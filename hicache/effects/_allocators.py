"""Host tensor allocators: the memory half of a bring-up (`hicache.effects._bringup`).

Owns how a host buffer's tensor comes to exist. `HostTensorAllocator` maps page-aligned
anonymous memory and pre-faults it in parallel (times kept for reports); `TorchHostTensorAllocator`
is a plain `torch.empty`; `FrameworkPinnedAllocator` lets torch pin (NPU, MUSA). The registry of
allocator types by storage back end lives in hicache.pools; pinning is the bring-up's job.
"""

from __future__ import annotations

import threading
import time

from hicache.effects._host_memory import allocate_host, prefault
from hicache.errors import RegistrationStateError


def _nbytes(dims, dtype) -> int:
    import torch

    nbytes = torch.empty((), dtype=dtype).element_size()
    for d in dims:
        nbytes *= d
    return nbytes


class HostTensorAllocator:
    """Allocates host tensors for KV pools: page-aligned mmap, pre-faulted from N threads.

    Not ``torch.empty(pin_memory=True)``: that rounds every block up to a power of two
    (sglang PR #37285). ``hugepages``/``hugepage_bytes`` as `allocate_host`. ``allocate_s`` and
    ``prefault_s`` add up the time spent mapping and faulting.
    """

    def __init__(self, *, prefault_threads: int | None = None, hugepages: str = "off",
                 hugepage_bytes: int | None = None, numa_node: int | None = None) -> None:
        self.prefault_threads = prefault_threads
        self.numa_node = numa_node  # bind every buffer there (see effects/_numa)
        self.hugepages = hugepages
        self.hugepage_bytes = hugepage_bytes
        self.buffers = []  # HostBuffers handed out, for free_all()
        self.allocate_s = 0.0
        self.prefault_s = 0.0
        self._lock = threading.Lock()

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
        the background while it registers (see effects/_pipeline)."""
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


class TorchHostTensorAllocator:
    """``torch.empty`` host tensors (optionally pinned by torch) - for small or test pools."""

    def allocate(self, dims, dtype, device="cpu", pin_memory: bool = False):
        import torch

        return torch.empty(tuple(dims), dtype=dtype, device=device, pin_memory=pin_memory)

    def free_all(self, *, ledger=None) -> None:
        """Nothing to do: torch frees its tensors when they die."""


class FrameworkPinnedAllocator:
    """``torch.empty(pin_memory=True)``: devices whose framework pins host memory itself."""

    def allocate(self, dims, dtype, device="cpu", pin_memory: bool = True):
        import torch

        return torch.empty(tuple(dims), dtype=dtype, pin_memory=True)

    def free_all(self, *, ledger=None) -> None:
        """Nothing to do: torch frees its tensors when they die."""
