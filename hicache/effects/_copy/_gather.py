"""The GPU's own transfer: a kernel that reads (load) or writes (backup) registered host memory
over PCIe, many pieces in flight per program (issue #52).

Owns the Triton kernel (one program walks tiles of ``ROWS`` pieces, each piece in chunks of
``CHUNK`` words, grid-stride over the batch), its tables (absolute word addresses and sizes, built
and moved to the device once per prepared batch), the torch fallback (index kernels over
word views of the same ranges) and the word size (the widest of 8, 4, 2, 1 bytes dividing every
address and size). The same kernel runs on CPU tensors through Triton's interpreter, so the
suite runs the code the GPU runs. Callers bounds-check every piece against its tensors first
(`hicache.pools._transfer.Descriptors`); this module checks the tables' own consistency and,
on a GPU, that every host range is registered (`host_pointer` raises for one that is not).
"""

from __future__ import annotations

import ctypes
import functools
import logging
import operator
import threading

from hicache.errors import TransferError

ROWS = 16  # pieces in flight per program (8-32 reached the link on the H200)
CHUNK_BYTES = 1024  # bytes of each piece a program moves per step

log = logging.getLogger(__name__)
WARM_THREAD = "hicache-gather-warm"  # the name of a pool build's warm-up thread
#: held around every launch of the kernel: a pool's warm-up launches on its own thread, and neither
#: Triton's interpreter (it patches triton.language while it runs) nor a compile beside a launch of
#: the same JIT function is safe from two threads at once
_LAUNCH = threading.Lock()


@functools.lru_cache(maxsize=None)
def triton_ready() -> bool:
    """Triton imports here (the kernel can run: compiled on a GPU, interpreted on CPU)."""
    try:
        import triton  # noqa: F401
        import triton.language  # noqa: F401
    except Exception:  # noqa: BLE001 - a broken install is as absent as a missing one
        return False
    return True


@functools.lru_cache(maxsize=2)
def _kernel(interpret: bool):
    """The kernel: Triton-compiled for a GPU, or interpreted for CPU tensors (without needing
    TRITON_INTERPRET set before triton was imported)."""
    import triton

    from hicache.effects._copy._gather_kernel import copy_pieces

    if interpret:
        from triton.runtime.interpreter import InterpretedFunction

        return InterpretedFunction(copy_pieces)
    # the piece count and chunk count change with every batch: specialized (==1, divisible by 16)
    # each value class would be another compile, on the first transfer that meets it
    return triton.jit(copy_pieces, do_not_specialize=["count", "chunks"])


class KernelWarmth:
    """Which (device, word size) kernels this process has compiled, loaded and launched - over
    no pieces, so nothing is read or written - and why one could not be: the first transfer of a
    pool then pays no compile (Triton compiles on the launch that first meets a word size, a
    second or more on a cold cache), and a Triton that cannot build its kernel here shows when
    the pool is built, its words moved by torch's index kernels instead, not at a transfer.
    Process-wide, as Triton's own cache of compiled kernels is; ``launch(device, word)``: the
    empty launch (`launch_empty`; tests put a stand-in here)."""

    def __init__(self, launch=None) -> None:
        self.launch = launch if launch is not None else launch_empty
        self._lock = threading.Lock()  # held through a compile: one per pair
        self._states: dict[tuple[str, int], str | None] = {}  # (device, word) -> None (ready) or why not
        self._started = threading.Lock()  # never held through a compile, so start() does not wait on one
        self._threads: list[threading.Thread] = []

    def start(self, device, words):
        """`warm` each of ``words`` on ``device`` in a background thread (a pool's build); returns it."""
        thread = threading.Thread(target=lambda: [self.warm(device, word) for word in words], name=WARM_THREAD,
                                  daemon=True)
        with self._started:
            self._threads = [t for t in self._threads if t.is_alive()] + [thread]
        thread.start()
        return thread

    def settle(self, timeout: float | None = None) -> bool:
        """Wait for every warm-up started so far (``timeout`` each); True when none still runs - a
        benchmark's or a test's clean start."""
        with self._started:
            threads = list(self._threads)
        for thread in threads:
            thread.join(timeout)
        return not any(thread.is_alive() for thread in threads)

    def warm(self, device, word: int) -> str | None:
        """None once the kernel for ``word``-byte words runs on ``device`` (None: CPU tensors,
        Triton's interpreter), else the reason it cannot; tried once per process and pair."""
        if word not in _WORDS:
            raise ValueError(f"word must be one of {sorted(_WORDS)}, got {word!r}")
        key = ("cpu" if device is None else str(device), word)
        with self._lock:  # one compile per pair, whoever asks first (a pool's build, a transfer)
            if key not in self._states:
                self._states[key] = self._try(device, word)
            return self._states[key]

    def states(self) -> dict[tuple[str, int], str | None]:
        """Every pair tried so far: None where the kernel runs, else why not."""
        with self._lock:
            return dict(self._states)

    def forget(self) -> None:
        """Try every pair again (a test's clean slate; Triton keeps its own cache)."""
        with self._lock:
            self._states.clear()

    def _try(self, device, word: int) -> str | None:
        if not triton_ready():
            return "Triton does not import here"
        try:
            self.launch(device, word)
        except Exception as error:  # noqa: BLE001 - any failure to build or launch means: not this runner
            reason = f"{type(error).__name__}: {str(error).strip().splitlines()[0] if str(error).strip() else ''}"[:300]
            log.warning("hicache: the gather kernel for %d-byte words does not run on %s (%s); torch's index "
                        "kernels move those pieces instead", word, device or "cpu", reason)
            return reason
        return None


def launch_empty(device, word: int) -> None:
    """Launch the kernel over no pieces on ``device`` (None: the interpreter), exactly as a batch
    of ``word``-byte words launches it, and wait for it: compiled, loaded and launched once."""
    import torch

    chunk = max(1, CHUNK_BYTES // word)
    dtype = getattr(torch, _WORDS[word][0])
    if device is None:
        tables = [torch.zeros(1, dtype=torch.int64) for _ in range(3)]
        with _LAUNCH:
            _kernel(True)[(1,)](*tables, 0, 0, torch.empty(1, dtype=dtype), ROWS=ROWS, CHUNK=chunk)
        return
    with torch.cuda.device(device):
        stream = torch.cuda.Stream(device)  # its own: the legacy stream would wait for all other work
        with torch.cuda.stream(stream):
            tables = [torch.zeros(1, dtype=torch.int64, device=device) for _ in range(3)]
            like = torch.empty(1, dtype=dtype, device=device)
            with _LAUNCH:
                _kernel(False)[(1,)](*tables, 0, 0, like, ROWS=ROWS, CHUNK=chunk)
        stream.synchronize()  # a launch error surfaces here, not at a transfer


#: the process's record: one Triton cache per process, one record of what it holds
WARMTH = KernelWarmth()


def word_bytes(dsts, srcs, sizes) -> int:
    """The widest word (8, 4, 2 or 1 bytes) dividing every address and size."""
    merged = dsts | srcs | sizes
    return next((word for word in (8, 4, 2) if not bool((merged % word).any())), 1)


def word_of(numbers) -> int:
    """`word_bytes` of plain integers: the widest word dividing each of ``numbers``."""
    merged = functools.reduce(operator.or_, (int(number) for number in numbers), 0)
    return next((word for word in (8, 4, 2) if not merged % word), 1)


#: word bytes -> (torch dtype name, __cuda_array_interface__ typestr)
_WORDS = {8: ("int64", "<i8"), 4: ("int32", "<i4"), 2: ("int16", "<i2"), 1: ("uint8", "|u1")}


class GatherCopy:
    """One prepared batch for the gather engine. ``parts``: ``(dst_offsets, src_offsets, sizes,
    total, dst_base, src_base)`` as `CopyEngine.prepare_parts` takes them; ``device``: the CUDA
    device, or None (host memory on both sides: the interpreter); ``host_side``: which side of
    every part is host memory on a GPU ("dst" for a backup, "src" for a load); ``host_pointer``:
    host address -> the device's address of it (raises for an unregistered one); ``registered``:
    the ``(ptr, size)`` host ranges the caller's handle holds registered now - every host piece
    must lie inside them (a hole in the middle of a range whose ends are registered included)."""

    def __init__(self, parts, device, *, programs: int, host_side: str | None = None, host_pointer=None,
                 runner: str = "auto", registered=None) -> None:
        import torch

        if programs < 1:
            raise ValueError(f"programs must be >= 1, got {programs}")
        self.device, self.programs = device, programs
        self._views = None  # the torch runner's word views and indices, built on its first run
        parts = [part for part in parts if part[3]]
        if device is not None and host_side is not None and registered is not None and parts:
            # every part's host pieces in one pass against the ranges (merged once), before any is translated
            side = 0 if host_side == "dst" else 1
            check_registered(torch.cat([part[side] + part[4 + side] for part in parts]),
                             torch.cat([part[2] for part in parts]), registered)
        dsts, srcs, sizes = [], [], []
        for dst_offsets, src_offsets, part_sizes, total, dst_base, src_base in parts:
            if device is not None and host_side is not None:
                reach = int((part_sizes + (dst_offsets if host_side == "dst" else src_offsets)).max())
                base = dst_base if host_side == "dst" else src_base
                moved = _translate(host_pointer, base, reach)
                dst_base, src_base = (moved, src_base) if host_side == "dst" else (dst_base, moved)
            dsts.append(dst_offsets + dst_base)
            srcs.append(src_offsets + src_base)
            sizes.append(part_sizes)
        self.count = sum(int(s.numel()) for s in sizes)
        if not self.count:
            self.tables, self.bytes = None, 0
            return
        dsts, srcs, sizes = torch.cat(dsts), torch.cat(srcs), torch.cat(sizes)
        self.word = word_bytes(dsts, srcs, sizes)
        dtype = getattr(torch, _WORDS[self.word][0])
        chunk = max(1, CHUNK_BYTES // self.word)
        sizes = sizes // self.word
        self.chunks = -(-int(sizes.max()) // chunk)
        self.chunk = chunk
        if runner == "auto":  # Triton where its kernel runs for this word here, else torch's index kernels
            runner = "triton" if WARMTH.warm(device, self.word) is None else "torch"
        self.runner = runner
        target = "cpu" if device is None else device
        self.tables = tuple(t.contiguous().to(target) for t in (dsts, srcs, sizes))
        self.like = torch.empty(1, dtype=dtype, device=target)
        self.bytes = int(sizes.sum()) * self.word

    def run(self) -> str:
        """Launch (asynchronous on a GPU, on the current stream; finished on return on CPU)."""
        if self.tables is None:
            return "empty"
        if self.runner == "torch":
            _torch_copy(self)
            return "gather-torch"
        grid = (max(1, min(self.programs, -(-self.count // ROWS))),)
        with _LAUNCH:  # asynchronous on a GPU: held for the enqueue only
            _kernel(self.device is None)[grid](*self.tables, self.count, self.chunks, self.like,
                                              ROWS=ROWS, CHUNK=self.chunk)
        return "gather-triton" if self.device is not None else "gather-interpreted"


def check_registered(addresses, sizes, registered) -> None:
    """Every piece ``[addresses[i], + sizes[i])`` (int64 tensors) lies inside one of the
    ``(ptr, size)`` ``registered`` ranges (adjacent ones merged: one device mapping on UVA);
    a `TransferError` naming the first that does not - one vectorized pass per batch."""
    import torch

    merged: list[list[int]] = []
    for ptr, size in sorted(registered):
        if merged and merged[-1][1] >= ptr:
            merged[-1][1] = max(merged[-1][1], ptr + size)
        else:
            merged.append([ptr, ptr + size])
    if not merged:
        outside = torch.ones_like(addresses, dtype=torch.bool)
    else:
        bounds = torch.tensor(merged, dtype=torch.int64)
        at = torch.searchsorted(bounds[:, 0].contiguous(), addresses, right=True) - 1
        ends = bounds[at.clamp(min=0), 1]
        outside = (at < 0) | (addresses + sizes > ends)
    outside &= sizes > 0
    if bool(outside.any()):
        first = int(outside.nonzero()[0, 0])
        raise TransferError(
            f"host piece [{int(addresses[first]):#x}, +{int(sizes[first])}) is not inside a registered range "
            f"({len(merged)} held, merged); the GPU cannot read or write it, nothing was copied")


def _translate(host_pointer, base: int, reach: int) -> int:
    """The device address of host range [base, base + reach): both ends must be registered
    and map to one contiguous device range."""
    if host_pointer is None:
        return base
    start = host_pointer(base)
    end = host_pointer(base + max(reach, 1) - 1)
    if end - start != max(reach, 1) - 1:
        raise TransferError(f"host range [{base:#x}, +{reach}) is not one registered range; nothing was copied")
    return start


def _torch_copy(batch: GatherCopy) -> None:
    """The fallback: each piece as word indices, one index kernel per batch over word views of
    the whole address span each side touches (a device view of registered host memory on a GPU).
    The views and indices are built on the first run and kept: a prepared batch runs again and
    again (SGLang loads the same pages layer by layer)."""
    if batch._views is None:
        batch._views = _torch_views(batch)
    dst_span, dst_index, src_span, src_index = batch._views
    dst_span[dst_index] = src_span[src_index]


def _torch_views(batch: GatherCopy) -> tuple:
    import torch

    dsts, srcs, sizes = (t.cpu() for t in batch.tables)
    step = torch.repeat_interleave(torch.arange(sizes.numel()), sizes)
    within = torch.arange(step.numel()) - torch.repeat_interleave(torch.cumsum(sizes, 0) - sizes, sizes)
    word = batch.word
    dst_words, src_words = dsts // word, srcs // word
    dst_span, dst_low = _span_of(dst_words, sizes, word, batch)
    src_span, src_low = _span_of(src_words, sizes, word, batch)
    return (dst_span, (dst_words[step] + within - dst_low).to(dst_span.device),
            src_span, (src_words[step] + within - src_low).to(src_span.device))


def _span_of(words, sizes, word: int, batch: GatherCopy):
    """A word view over the range one side's pieces cover, and its first word."""
    low, high = int(words.min()), int((words + sizes).max())
    return _word_view(low * word, (high - low) * word, batch.like.dtype, batch.device), low


class _DeviceSpan:
    """`__cuda_array_interface__` over raw device (or registered host, UVA) memory."""

    def __init__(self, ptr: int, count: int, typestr: str) -> None:
        self.__cuda_array_interface__ = {"shape": (count,), "typestr": typestr, "data": (ptr, False), "version": 3}


def _word_view(address: int, nbytes: int, dtype, device):
    """A 1-D tensor of ``dtype`` words over [address, address + nbytes)."""
    import torch

    word = torch.empty(0, dtype=dtype).element_size()
    if device is None:
        raw = (ctypes.c_char * nbytes).from_address(address)
        return torch.frombuffer(raw, dtype=dtype)
    return torch.as_tensor(_DeviceSpan(address, nbytes // word, _WORDS[word][1]), device=device)
