"""Host memory for large pools: page-aligned anonymous mmap, optional hugepages, pre-fault.

Owns mapping, pre-faulting and unmapping. Not `torch.empty(pin_memory=True)`: PyTorch's host
allocator rounds every pinned block up to a power of two (80 GiB pins 128 GiB; sglang PR
#37285) and malloc'd bases are not page aligned. Memory still registered with CUDA is never
unmapped (the ledger says what is).
"""

from __future__ import annotations

import ctypes
import errno
import mmap
import os
import threading
import time
from concurrent.futures import ThreadPoolExecutor, wait
from pathlib import Path

import attrs

from hicache.effects._interrupts import deferred_interrupts
from hicache.effects._cuda._ledger import PROCESS_LEDGER, HostLedger
from hicache.effects._host import _release  # a module: tests replace its give_back
from hicache.effects._host._commit import commit_refusal
from hicache.effects._host._numa import bind
from hicache.effects._host._threads import lower_priority, pin_thread
from hicache.errors import HostOutOfMemoryError, HugepagesExhaustedError, PlanError, RegistrationStateError
from hicache.plan.checks import check_int
from hicache.effects._host._libc import madvise_function as _madvise
from hicache.plan.settings import DEFAULT_HUGEPAGE_BYTES, HUGETLBFS_MODES, check_hugepages

MAP_HUGETLB, MAP_HUGE_SHIFT = 0x40000, 26  # linux/mman.h
MADV_POPULATE_WRITE = 23  # Linux >= 5.14: fault pages in writable without writing data
#: The most one MADV_POPULATE_WRITE call faults. Each call holds the process's mmap lock (for
#: reading) over its whole range, so every mmap, munmap, mprotect and thread start in the
#: process - a serving engine's allocations beside a progressive pool's background pre-fault -
#: waits for the call in flight. Measured here: a 1 MiB mmap waited 592 ms behind a 2 GiB call,
#: 309 ms behind 512 MiB (TensorRT-LLM's piece size), at most 32 ms behind 64 MiB; 16-64 MiB
#: calls fault as fast as 2 GiB ones (4 KiB pages, 2 threads: 0.65 s per 4 GiB either way).
PREFAULT_PIECE_BYTES = 32 * 2**20
#: Buffers whose memory CUDA may still have pinned (a release or rollback leaked): kept here
#: for the life of the process so that garbage collection can never unmap them.
QUARANTINE: list = []
_QUARANTINE_LOCK = threading.Lock()


def quarantine(*buffers) -> None:
    """Keep ``buffers`` mapped until the process exits (their registration leaked)."""
    with _QUARANTINE_LOCK:
        QUARANTINE.extend(buffers)


def unquarantine(*buffers) -> None:
    """Let ``buffers`` go again: a later release unregistered what had leaked."""
    with _QUARANTINE_LOCK:
        keep = {id(b) for b in buffers}
        QUARANTINE[:] = [b for b in QUARANTINE if id(b) not in keep]


def os_page_bytes() -> int:
    """The base page size of this machine."""
    return os.sysconf("SC_PAGE_SIZE")


def free_hugepages(size_bytes: int, *, root: str = "/") -> tuple[int, int]:
    """``(total, free)`` reserved hugepages of ``size_bytes`` from sysfs (0, 0 if none)."""
    base = Path(root, f"sys/kernel/mm/hugepages/hugepages-{size_bytes // 1024}kB")
    try:
        total = int((base / "nr_hugepages").read_text())
        free = int((base / "free_hugepages").read_text())
    except (OSError, ValueError):
        return 0, 0
    return total, free


def offered_hugepage_sizes(*, root: str = "/") -> tuple[int, ...]:
    """The hugetlbfs page sizes this kernel offers, ascending (``/sys/kernel/mm/hugepages``'s
    ``hugepages-<N>kB`` entries; empty when it offers none or sysfs is not there)."""
    try:
        names = os.listdir(Path(root, "sys/kernel/mm/hugepages"))
    except OSError:
        return ()
    sizes = []
    for name in names:
        digits = name[len("hugepages-"):-len("kB")] if name.startswith("hugepages-") and name.endswith("kB") else ""
        if digits.isascii() and digits.isdigit():
            sizes.append(int(digits) * 1024)
    return tuple(sorted(sizes))


def hugepage_size_note(hugepages: str, hugepage_bytes: int | None, *, root: str = "/") -> str | None:
    """Whether hugetlbfs pages of ``hugepage_bytes`` (default 2 MiB) can be had at all here:
    ``required`` and a size the kernel does not offer is a `HugepageSizeError` naming the
    offered ones (before any memory); ``prefer`` gets the note that it falls back to 4 KiB
    pages; None when the size is offered or no hugetlbfs page is asked for."""
    from hicache.errors import HugepageSizeError
    from hicache.plan import format_bytes

    if hugepages not in HUGETLBFS_MODES:
        return None
    size = hugepage_bytes or DEFAULT_HUGEPAGE_BYTES
    offered = offered_hugepage_sizes(root=root)
    if size in offered:
        return None
    said = ", ".join(format_bytes(s) for s in offered) or "none"
    message = (f"hugetlbfs pages of {format_bytes(size)} are not offered by this kernel (it offers: {said}; "
               "/sys/kernel/mm/hugepages)")
    if hugepages == "required":
        raise HugepageSizeError(message)
    return message + ": hugepages='prefer' falls back to 4 KiB pages"


@attrs.define(eq=False)
class HostBuffer:
    """An anonymous mapping exposed as a flat ``uint8`` torch tensor of ``nbytes``.

    ``ptr`` is page (or hugepage) aligned; ``mapped_bytes`` is ``nbytes`` rounded up to the
    page. The tensor keeps the mapping alive: `free` never leaves a view dangling.
    """

    nbytes: int
    mapped_bytes: int
    page_bytes: int
    hugepage_bytes: int | None
    notes: tuple[str, ...]
    _mapping: mmap.mmap | None
    _tensor: object
    _lock: threading.Lock = attrs.field(factory=threading.Lock)

    @property
    def tensor(self):
        """The memory as a flat uint8 tensor (raises once freed)."""
        if self._tensor is None:
            raise RegistrationStateError("this HostBuffer was freed")
        return self._tensor

    @property
    def ptr(self) -> int:
        """The base address (0 for an empty buffer)."""
        return self.tensor.data_ptr() if self.nbytes else 0

    @property
    def freed(self) -> bool:
        return self._tensor is None

    def view(self, dtype, shape):
        """The memory as a tensor of ``dtype`` and ``shape`` (must cover exactly nbytes)."""
        return self.tensor.view(dtype).view(shape)

    def free(self, *, ledger: HostLedger | None = None) -> None:
        """Unmap the memory; idempotent. Refuses while any of it is registered with CUDA.

        When other tensors still view the memory, the mapping is released when the last of
        them dies (never a dangling pointer); otherwise it is unmapped now.
        """
        ledger = PROCESS_LEDGER if ledger is None else ledger
        with self._lock:
            if self._tensor is None:
                return
            if self.nbytes:
                held = ledger.overlapping(self.ptr, self.mapped_bytes)
                if held is not None:
                    raise RegistrationStateError(
                        f"refusing to unmap [0x{self.ptr:x}, +{self.mapped_bytes}): "
                        f"[0x{held[0]:x}, +{held[1]}) is still registered with CUDA"
                    )
            mapping, tensor = self._mapping, self._tensor
            base = tensor.data_ptr() if self.nbytes else 0
            self._mapping = self._tensor = None
            if mapping is not None and _sole_user(tensor):
                del tensor
                _release.give_back(base, self.mapped_bytes)  # in parallel pieces: the unmap then has little to free
                mapping.close()

    def __enter__(self) -> "HostBuffer":
        return self

    def __exit__(self, *exc_info) -> None:
        self.free()


def _sole_user(tensor) -> bool:
    """True when ``tensor`` is the only tensor on its storage (so unmapping is safe now)."""
    try:
        import torch

        storage = tensor.untyped_storage()
        # tensor + this handle, + the base the tensor views (allocate_host's slice of its
        # frombuffer tensor keeps that alive: without it, every free was left to the collector)
        return torch._C._storage_Use_Count(storage._cdata) <= 2 + (tensor._base is not None)
    except Exception:  # private API: when unsure, let the last view release the mapping
        return False


def _map(length: int, flags: int) -> mmap.mmap:
    return _release.ReleasingMapping(
        -1, length, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | flags,
        prot=mmap.PROT_READ | mmap.PROT_WRITE,
    )


def allocate_host(
    nbytes: int,
    *,
    hugepages: str = "off",
    hugepage_bytes: int = DEFAULT_HUGEPAGE_BYTES,
    sysfs_root: str = "/",
    numa_node: int | None = None,
) -> HostBuffer:
    """Map ``nbytes`` of page-aligned anonymous memory, exposed as a torch uint8 tensor.

    ``hugepages``: ``"off"``, ``"auto"`` (mapped as ``"off"``; the bring-up's pre-fault then advises each
    piece, `hicache.effects._host._thp.ThpAuto`), ``"thp"`` (normal pages with ``MADV_HUGEPAGE``: transparent huge
    pages where the kernel can assemble them), ``"prefer"`` (hugetlbfs pages of ``hugepage_bytes`` when the
    reserved pool has them, else normal pages with a note) or ``"required"`` (raise
    ``HostOutOfMemoryError`` saying how many pages are free vs needed). Transparent huge pages
    are opt-in: with THP ``always``, compaction can drop fault rates from GB/s to GB/min
    (TensorRT-LLM #15430), so by default the mapping asks for none. ``numa_node``: bind the
    mapping to that node (``mbind``) before anything faults it in.
    """
    import torch  # lazy: the plan path must not pay for it

    nbytes = check_int(PlanError, "allocate_host", "nbytes", nbytes, minimum=0)
    check_hugepages(PlanError, "allocate_host", hugepages)
    page = os_page_bytes()
    if nbytes == 0:
        return HostBuffer(0, 0, page, None, (), None, torch.empty(0, dtype=torch.uint8))
    notes: list[str] = []
    mapping = huge = None
    transparent_hugepages = hugepages == "thp"
    if transparent_hugepages or hugepages == "auto":  # auto: 4 KiB until a bring-up advises a piece (`ThpAuto`)
        hugepages = "off"
    if hugepages != "off":
        if hugepage_bytes & (hugepage_bytes - 1) or hugepage_bytes < page:
            raise PlanError(f"allocate_host.hugepage_bytes must be a power of two >= {page}, got {hugepage_bytes}")
        length = -(-nbytes // hugepage_bytes) * hugepage_bytes
        flags = MAP_HUGETLB | (hugepage_bytes.bit_length() - 1) << MAP_HUGE_SHIFT
        try:
            mapping, huge = _map(length, flags), hugepage_bytes
            # hugetlb mappings may succeed and SIGBUS on first touch when the pool runs dry;
            # MAP_POPULATE is not used, so check the reserve explicitly.
            total, free = free_hugepages(hugepage_bytes, root=sysfs_root)
            if free < length // hugepage_bytes:
                mapping.close()
                mapping = huge = None
                raise OSError(errno.ENOMEM, "not enough free hugepages")
        except OSError as error:
            total, free = free_hugepages(hugepage_bytes, root=sysfs_root)
            needed = length // hugepage_bytes
            message = (
                f"hugetlbfs mapping of {length} bytes failed ({os.strerror(error.errno or 0)}): "
                f"needs {needed} pages of {hugepage_bytes // 2**20} MiB, {free} free of {total} "
                f"reserved (/sys/kernel/mm/hugepages/hugepages-{hugepage_bytes // 1024}kB)"
            )
            if hugepages == "required":
                raise HugepagesExhaustedError(message) from error
            notes.append(message + "; using normal pages")
    if mapping is None:
        length = -(-nbytes // page) * page
        try:
            mapping = _map(length, 0)
        except OSError as error:
            if error.errno == errno.ENOMEM:
                raise HostOutOfMemoryError(f"mmap of {length} bytes failed: out of memory{commit_refusal(sysfs_root)}") from error
            raise
        advice = mmap.MADV_HUGEPAGE if transparent_hugepages else mmap.MADV_NOHUGEPAGE
        try:
            mapping.madvise(advice)
        except OSError:
            notes.append("madvise(THP) refused; the system default applies")
    try:
        # A forked child (SGLang starts workers) must not inherit pinned pages: a copy-on-write
        # fault there would move the parent's page under CUDA's pin (SGLang's own mmap
        # allocator notes registered memory needs this too).
        mapping.madvise(mmap.MADV_DONTFORK)
    except (OSError, AttributeError):
        notes.append("madvise(MADV_DONTFORK) refused: a forked child shares these pages copy-on-write")
    tensor = torch.frombuffer(mapping, dtype=torch.uint8)[:nbytes]
    mapping.mapped_at(tensor.data_ptr())  # its pages go back in parallel if it dies with its views, past `free`
    if numa_node is not None:

        try:
            bind(tensor.data_ptr(), length, numa_node)
        except BaseException:
            del tensor
            mapping.close()
            raise
        notes.append(f"bound to NUMA node {numa_node}")
    return HostBuffer(nbytes, length, page, huge, tuple(notes), mapping, tensor)


@attrs.frozen
class PrefaultReport:
    """How a pre-fault ran: method (``madvise`` or ``touch``), threads, seconds, GB/s."""

    method: str
    threads: int
    pieces: int
    seconds: float


def started_executor(workers: int, *, prefix: str = "hicache-prefault", nice: int = 0, cpus=None) -> ThreadPoolExecutor:
    """A thread pool of ``workers`` threads, all started before it is returned, ``nice`` steps
    nicer than the caller (`lower_priority`) and on ``cpus`` if given (`_numa.pin_thread`).

    Starting a thread maps its stack, which takes the mmap lock for writing: a thread started
    lazily beside a running MADV_POPULATE_WRITE waits for that call, so a pool that starts
    its threads on demand begins faulting with one thread (measured: the second of two
    started only when the first had faulted its 2 GiB).
    """
    pool = ThreadPoolExecutor(max_workers=workers, thread_name_prefix=prefix)
    barrier = threading.Barrier(workers)  # each task holds its thread until all have one

    def arrive() -> None:
        lower_priority(nice)
        pin_thread(cpus)
        barrier.wait(60.0)

    try:
        for future in [pool.submit(arrive) for _ in range(workers)]:
            future.result()
    except BaseException:
        barrier.abort()
        pool.shutdown(wait=True)
        raise
    return pool


def _run_workers(pool, workers: int, fault, items, *, stop: threading.Event | None = None) -> None:
    """Call ``fault`` on each of ``items``, in order, from ``workers`` tasks on ``pool``, each
    taking the next item. The first error (or a Ctrl-C reaching the caller) stops every task
    after its call in flight and is raised once all have ended: the memory must not be freed
    under a running call. ``stop``: set it to end the tasks early the same way (it is set on
    an error too)."""
    pending = iter(items)
    taking = threading.Lock()
    stop = threading.Event() if stop is None else stop

    def work() -> None:
        while True:
            with taking:
                item = None if stop.is_set() else next(pending, None)
            if item is None:
                return
            try:
                fault(item)
            except BaseException:
                stop.set()
                raise

    futures: list = []
    interrupted: BaseException | None = None
    while True:
        try:
            if not futures and not stop.is_set():
                with deferred_interrupts():  # a Ctrl-C lands once every task is in `futures`
                    futures.extend(pool.submit(work) for _ in range(workers))
            wait(futures)
            break
        except BaseException as interrupt:  # Ctrl-C: stop the workers started, wait for them
            stop.set()
            interrupted = interrupted or interrupt
    if interrupted is not None:
        raise interrupted
    for future in futures:
        future.result()  # a worker's error


def prefault(
    buffer: HostBuffer, *, threads: int | None = None, piece_bytes: int = PREFAULT_PIECE_BYTES,
    start: int = 0, length: int | None = None,
) -> PrefaultReport:
    """Fault every page of ``buffer`` in now, from ``threads`` threads, outside any CUDA call.

    ``MADV_POPULATE_WRITE`` through ctypes, so the GIL is released (CPython's ``mmap.madvise``
    holds it); on kernels without it (EINVAL/ENOSYS) each page is touched instead, keeping its
    contents. ENOMEM becomes ``HostOutOfMemoryError`` rather than a visit from the OOM killer.
    Pages not faulted here are faulted single-threaded inside ``cudaHostRegister``.
    ``start``/``length``: only that byte range (widened to whole pages) - one chunk of a plan,
    so that registering chunk k can overlap faulting chunk k+1. Its worker threads are all
    started before the first call (`started_executor`); calls fault at most ``piece_bytes``
    each (see `PREFAULT_PIECE_BYTES`).
    """
    began = time.perf_counter()
    if buffer.nbytes == 0:
        return PrefaultReport("none", 0, 0, 0.0)
    unit = buffer.hugepage_bytes or buffer.page_bytes
    piece = max(unit, piece_bytes // unit * unit)
    first = start // unit * unit
    end = buffer.mapped_bytes if length is None else min(buffer.mapped_bytes, -(-(start + length) // unit) * unit)
    if not 0 <= start <= buffer.nbytes or end < first:
        raise PlanError(f"prefault: range [{start}, +{length}) is outside the buffer of {buffer.nbytes} bytes")
    offsets = list(range(first, end, piece))
    if not offsets:
        return PrefaultReport("none", 0, 0, 0.0)
    workers = max(1, min(threads or min(os.cpu_count() or 1, 16), len(offsets)))
    base, tensor = buffer.ptr, buffer.tensor
    madvise = _madvise()
    methods: set[str] = set()

    def fault(offset: int) -> None:
        length = min(piece, end - offset)
        if madvise(base + offset, length, MADV_POPULATE_WRITE) == 0:
            methods.add("madvise")
            return
        code = ctypes.get_errno()
        if code in (errno.EINVAL, errno.ENOSYS):
            view = tensor[offset : min(offset + length, buffer.nbytes) : buffer.page_bytes]
            view.add_(0)  # a write fault per page that keeps the bytes
            methods.add("touch")
            return
        if code == errno.ENOMEM:
            raise HostOutOfMemoryError(
                f"pre-faulting {length} bytes at offset {offset} failed: out of memory "
                f"(buffer of {buffer.nbytes} bytes)"
            )
        raise OSError(code, f"madvise(MADV_POPULATE_WRITE) at offset {offset}: {os.strerror(code)}")

    if workers == 1:
        for offset in offsets:
            fault(offset)
    else:
        pool = started_executor(workers)
        try:
            _run_workers(pool, workers, fault, offsets)
        finally:
            pool.shutdown(wait=True)
    method = "+".join(sorted(methods)) or "none"
    return PrefaultReport(method, workers, len(offsets), time.perf_counter() - began)
