"""The copy engine: where a pool's batched page copies go, and how to wait for them.

Owns the dispatch of (dst, src, bytes) descriptor batches - host<->host through the batched
host copy (`_host_copy`, mode resolved once), anything touching a CUDA device through
cudaMemcpyBatchAsync on that device's current torch stream (`_device`; per page on drivers
without it) - and synchronizing the devices before pinned memory is let go. Pools call this;
they make no CUDA call themselves. ``cuda`` (torch.cuda) and ``binding`` (cuda-python) are
parameters so tests stand in for both.
"""

from __future__ import annotations

from hicache.effects._copy._host_copy import (
    copy_host_blocks, copy_parts, gathering_copier, host_copy_mode, streaming_copier,
)
from hicache.effects._copy._gather import WARMTH, GatherCopy, triton_ready, word_of
from hicache.errors import CudaCallError, PlanError, TransferError
from hicache.plan.checks import check_int
from hicache.plan.transfer import GATHER_RUNNERS, MAX_PROGRAMS, TRANSFER_MODES, choose_engine


def cuda_copy(dsts, srcs, sizes, *, stream: int, binding=None) -> str:
    """Enqueue the copies on ``stream`` with cudaMemcpyBatchAsync (per page on an old driver).

    Asynchronous, as SGLang's transfers are: the caller orders later work after them on the
    stream (or waits on an event). Returns ``"batched"`` or ``"per-page"``.
    """
    if binding is None:
        from cuda.bindings import runtime as binding

    from hicache.effects._copy._device import FALLBACK_CODES, memcpy, memcpy_batch

    try:
        memcpy_batch(dsts, srcs, sizes, stream=stream, binding=binding)
        return "batched"
    except CudaCallError as error:
        if error.code not in FALLBACK_CODES:
            raise
    for dst, src, size in zip(dsts, srcs, sizes):  # old driver: one copy per page
        memcpy(dst, src, size, stream=stream, binding=binding)
    return "per-page"


class CopyEngine:
    """Issues batched page copies and waits for them.

    ``host_copy_mode``: ``"native"`` or ``"python"`` (default: `host_copy_mode()`, which reads
    ``HICACHE_HOST_COPY`` once, here). ``cuda``: torch.cuda or a stand-in; ``binding``:
    cuda-python's runtime or a stand-in (both looked up on first CUDA use). ``transfer`` and
    ``programs``: HICACHE_TRANSFER and HICACHE_TRANSFER_PROGRAMS unless given; ``gather_runner``:
    what runs a gather, Triton where it is (``auto``) or torch's index kernels (``torch``).
    """

    def __init__(self, *, host_copy_mode: str | None = None, cuda=None, binding=None, transfer: str | None = None,
                 programs: int | None = None, gather_runner: str = "auto") -> None:
        self.host_copy_mode = host_copy_mode if host_copy_mode is not None else _probe_mode()
        self._cuda = cuda
        self._binding = binding
        self._side_streams: dict = {}  # device -> stream, for copies issued from the NULL stream
        setting, count = transfer_settings()
        self.transfer = transfer if transfer is not None else setting
        self.programs = check_int(PlanError, "CopyEngine", "programs", programs if programs is not None else count,
                                  minimum=1, maximum=MAX_PROGRAMS)
        if self.transfer not in TRANSFER_MODES:
            raise ValueError(f"transfer must be one of {TRANSFER_MODES}, got {self.transfer!r}")
        if gather_runner not in GATHER_RUNNERS:
            raise PlanError(f"CopyEngine.gather_runner must be one of {GATHER_RUNNERS}, got {gather_runner!r}")
        self.last_choice = None  # the EngineChoice of the last batch prepared with a direction
        self.gather_runner = gather_runner  # "auto" (Triton where it is), "triton" or "torch"

    def __repr__(self) -> str:
        return f"CopyEngine(host_copy_mode={self.host_copy_mode!r}, transfer={self.transfer!r})"

    def _torch_cuda(self):
        if self._cuda is None:
            import torch

            self._cuda = torch.cuda
        return self._cuda

    def copy(self, dsts, srcs, sizes, *, device=None) -> str:
        """Copy ``sizes[i]`` bytes ``srcs[i]`` -> ``dsts[i]`` (1-D int64 CPU tensors). ``device``:
        the CUDA device when either side is on one (asynchronous, on its current stream), else
        None (a host copy, done when this returns). Returns the path taken."""
        if device is None:
            return copy_host_blocks(dsts, srcs, sizes, mode=self.host_copy_mode)
        return self.issue_cuda_copies(device, dsts.tolist(), srcs.tolist(), sizes.tolist())

    def prepare(self, dsts, srcs, sizes, *, device=None, total: int | None = None) -> "PreparedCopy":
        """Check a batch once, for issuing it many times (SGLang loads the same pages layer by
        layer, batch after batch): `PreparedCopy.run()` then costs one call. ``total``: the
        bytes of ``sizes`` when the caller built them non-negative and knows their sum."""
        import torch

        for name, tensor in (("dsts", dsts), ("srcs", srcs), ("sizes", sizes)):
            if not isinstance(tensor, torch.Tensor) or tensor.dtype != torch.int64 or tensor.dim() != 1 or tensor.device.type != "cpu":
                raise TypeError(f"{name} must be a 1-D int64 CPU tensor")
        if not dsts.numel() == srcs.numel() == sizes.numel():
            raise ValueError(f"{dsts.numel()} dsts, {srcs.numel()} srcs and {sizes.numel()} sizes")
        if total is None:
            if sizes.numel() and int(sizes.min()) < 0:
                raise ValueError(f"sizes must be >= 0, got {int(sizes.min())}")
            total = int(sizes.sum()) if sizes.numel() else 0
        return PreparedCopy(self, [(dsts.contiguous(), srcs.contiguous(), sizes.contiguous(), total, 0, 0)], device)

    def prepare_parts(self, parts, *, device=None, direction: str | None = None, registered=None):
        """Like `prepare`, for parts ``(dst_offsets, src_offsets, sizes, total, dst_base,
        src_base)`` built by the caller (contiguous int64 CPU tensors, sizes >= 0 adding up to
        ``total``): each block goes from ``src_base + src_offsets[i]`` to ``dst_base + ...``.

        ``direction`` ("load": the sources are host memory, "backup": the destinations are)
        lets the engine table (`hicache.plan.choose_engine`) pick the copy engine or the GPU's
        gather for this batch; without it the copy engine (or the host copy) runs it. The
        result's ``choice`` says which and why. ``registered``: a callable giving the ``(ptr,
        size)`` host ranges registered now; a gather on a GPU refuses any host piece outside them."""
        if direction is None:
            return PreparedCopy(self, parts, device)
        total = sum([part[3] for part in parts])
        count = sum([int(part[2].numel()) for part in parts if part[3]])
        choice = choose_engine(direction, total // max(count, 1), on_gpu=device is not None, setting=self.transfer,
                               gather_ready=device is not None or triton_ready())
        self.last_choice = choice
        if choice.engine != "gather":
            return PreparedCopy(self, parts, device, choice=choice)
        host_pointer = None if device is None else self._host_pointer
        batch = GatherCopy(parts, device, programs=self.programs, host_side="src" if direction == "load" else "dst",
                           host_pointer=host_pointer, runner=self.gather_runner,
                           registered=None if device is None or registered is None else registered())
        return PreparedGather(batch, choice, self, device)

    def warm_gather(self, device, groups):
        """Compile and load the gather kernel in the background for each word size a pool's
        batches will use, at its build: each of ``groups`` holds the numbers (base addresses,
        steps, piece sizes) one stream's pieces are sums and multiples of, so the widest word
        dividing them all is the word of its every batch. ``device``: the pool's CUDA device
        (None: host memory, where only HICACHE_TRANSFER=gather runs the kernel, interpreted).
        A transfer that comes first waits for that word's compile, never runs it twice. Returns
        the thread (None where no gather will run: ``dma``, the torch runner, nothing to copy)."""
        words = sorted({word_of(group) for group in groups if group})
        if not words or self.transfer == "dma" or self.gather_runner == "torch" or (
                device is None and self.transfer != "gather"):
            return None
        return WARMTH.start(device, words)

    def _host_pointer(self, address: int) -> int:
        """The device's address of registered host memory (UVA); a TransferError for memory no
        registration covers - a GPU reading it would fault or read another process's pages."""
        binding = self._binding
        if binding is None:
            from cuda.bindings import runtime as binding

            self._binding = binding
        result = binding.cudaHostGetDevicePointer(address, 0)
        code = int(result[0])
        if code:
            binding.cudaGetLastError()
            raise TransferError(f"host address {address:#x} is not in registered memory (cudaHostGetDevicePointer: "
                                f"{code}); the GPU cannot read or write it, nothing was copied")
        return int(result[1])

    def streaming_copier(self, parts):
        """A function ``(index, src_base)`` writing one pattern of host blocks with streaming
        stores, for a page written into a host pool (parts as _host_copy's `streaming_copier`
        takes them, built by the caller); None in the ``python`` host copy mode or
        without the C helper (the caller copies with torch)."""
        if self.host_copy_mode != "native":
            return None
        return streaming_copier(parts)

    def gathering_copier(self, part):
        """A function ``(index, dst_base)`` gathering one pattern of host blocks into a flat
        destination (a page read out of a host pool; part as _host_copy's `gathering_copier`
        takes it); None in the ``python`` host copy mode or without the C helper."""
        if self.host_copy_mode != "native":
            return None
        return gathering_copier(part)

    def issue_cuda_copies(self, device, dsts, srcs, sizes) -> str:
        """Copies on ``device``'s current torch stream, ordered after the work already queued.

        cudaMemcpyBatchAsync rejects the legacy NULL stream (torch's default stream), so from it
        the copies go on a side stream that first waits for the current one, and the current one
        then waits for the side stream: to the caller it is as if they ran on its stream.
        """
        cuda = self._torch_cuda()
        with cuda.device(device):
            current = cuda.current_stream(device)
            if current.cuda_stream != 0:
                return cuda_copy(dsts, srcs, sizes, stream=current.cuda_stream, binding=self._binding)
            side = self._side_streams.get(device)
            if side is None:
                side = self._side_streams.setdefault(device, cuda.Stream(device))
            side.wait_stream(current)
            try:
                return cuda_copy(dsts, srcs, sizes, stream=side.cuda_stream, binding=self._binding)
            finally:
                current.wait_stream(side)  # even after an error: whatever was enqueued is ordered

    def synchronize(self) -> None:
        """Wait for every copy in flight on every CUDA device (before memory is unpinned)."""
        cuda = self._torch_cuda()
        if cuda.is_available() and cuda.is_initialized():
            for index in range(cuda.device_count()):
                cuda.synchronize(index)


class PreparedGather:
    """A checked batch the GPU moves itself (`GatherCopy`), issued by `run()` as often as needed;
    ``choice``: the table's `EngineChoice` that sent it here."""

    def __init__(self, batch: GatherCopy, choice, copy_engine: CopyEngine, device) -> None:
        self.batch, self.choice, self.copy_engine, self.device = batch, choice, copy_engine, device
        self.total = batch.bytes

    def run(self) -> str:
        if self.device is None:
            return self.batch.run()
        cuda = self.copy_engine._torch_cuda()
        with cuda.device(self.device):
            return self.batch.run()


class PreparedCopy:
    """One checked batch of copies, issued by `run()` as often as needed. The caller keeps the
    memory its addresses point into alive and unchanged."""

    def __init__(self, engine: CopyEngine, parts, device, *, choice=None) -> None:
        self.engine, self.device, self.parts = engine, device, parts
        self.choice = choice  # the table's EngineChoice, when prepared with a direction
        self.total = sum([part[3] for part in parts])
        if device is not None:  # cudaMemcpyBatchAsync takes Python int lists: built once
            dsts, srcs, sizes = [], [], []
            for dst_offsets, src_offsets, part_sizes, _, dst_base, src_base in self.parts:
                dsts += [offset + dst_base for offset in dst_offsets.tolist()]
                srcs += [offset + src_base for offset in src_offsets.tolist()]
                sizes += part_sizes.tolist()
            self.lists = (dsts, srcs, sizes)

    def run(self) -> str:
        if not self.total:
            return "empty"
        if self.device is not None:
            return self.engine.issue_cuda_copies(self.device, *self.lists)
        mode = self.engine.host_copy_mode
        copy_parts(self.parts, self.total, mode=mode)  # every layer and stream in one call
        return mode


def _probe_mode() -> str:
    return host_copy_mode()


def transfer_settings(env=None) -> tuple[str, int]:
    """(HICACHE_TRANSFER, HICACHE_TRANSFER_PROGRAMS) as set, or their defaults; `EnvError` for a
    bad value, naming it."""
    import os

    from hicache.plan.settings import env_value
    from hicache.plan.transfer import DEFAULT_PROGRAMS

    env = os.environ if env is None else env
    return env_value(env, "HICACHE_TRANSFER") or "auto", env_value(env, "HICACHE_TRANSFER_PROGRAMS") or DEFAULT_PROGRAMS
