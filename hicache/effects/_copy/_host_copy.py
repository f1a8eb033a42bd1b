"""Batched host-memory block copies: many (dst, src, bytes) blocks in one call.

A CPU page transfer is hundreds of 32-256 KiB blocks. The optional C helper `_hostcopy` copies
them in one call without the GIL, over threads, streaming past the cache for large batches.
Where it was not built, or with ``HICACHE_HOST_COPY=python``, ctypes memmove from a few threads
does the same copies, about a third slower on 64-token pages (bench_transfer).
"""

from __future__ import annotations

import ctypes
import os
from concurrent.futures import ThreadPoolExecutor

import attrs

from hicache.effects._interrupts import run_each

try:
    from hicache.effects._copy import _hostcopy as _native
except ImportError:  # built without a C compiler: the memmove path below
    _native = None

ENV_VAR = "HICACHE_HOST_COPY"
MODES = ("auto", "native", "python")
PARALLEL_BYTES = 4 * 2**20  # below this one thread is faster than handing work out
STREAM_BYTES = 8 * 2**20  # above this the batch outgrows the caches: stream past them
MAX_THREADS = 8  # a socket's memory bandwidth is saturated well before this
_pool: ThreadPoolExecutor | None = None


def copy_workers(total: int, threads: int | None = None) -> int:
    """Threads a copy of ``total`` bytes uses: one below `PARALLEL_BYTES`, else ``threads`` or
    `copy_threads()` (the one rule for host copies and the node store's checksummed copies)."""
    return 1 if total < PARALLEL_BYTES else (threads or copy_threads())


def copy_threads() -> int:
    """Threads a large copy uses: the CPUs this process may run on, at most `MAX_THREADS`."""
    try:
        cpus = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        cpus = os.cpu_count() or 1
    return max(1, min(cpus, MAX_THREADS))


def host_copy_mode(env=None) -> str:
    """``"native"`` or ``"python"``: what `copy_host_blocks` will use, after ``HICACHE_HOST_COPY``."""
    from hicache.errors import EnvError
    from hicache.plan.settings import env_value

    wanted = env_value(os.environ if env is None else env, ENV_VAR) or "auto"
    if wanted == "native" and _native is None:
        raise EnvError(f"{ENV_VAR}=native but hicache.effects._copy._hostcopy was not built (no C compiler at install?)")
    if wanted == "python" or _native is None:
        return "python"
    return "native"


@attrs.frozen
class HostCopyInfo:
    """How host<->host page copies run here: ``mode`` (``native`` or ``python``), the
    ``threads`` a large copy uses, whether the C helper is ``native_built``, the ``asked`` value
    of ``env_var`` (empty when unset)."""

    mode: str
    threads: int
    native_built: bool
    asked: str
    env_var: str = ENV_VAR


def host_copy_info(env=None) -> HostCopyInfo:
    """The host copy path in use (`hicache doctor`); `EnvError` for a bad ``HICACHE_HOST_COPY``."""
    env = os.environ if env is None else env
    return HostCopyInfo(host_copy_mode(env), copy_threads(), _native is not None,
                        env.get(ENV_VAR, "").strip().lower())


def _check(name: str, tensor, count: int | None):
    import torch

    if not isinstance(tensor, torch.Tensor) or tensor.dtype != torch.int64 or tensor.dim() != 1:
        raise TypeError(f"{name} must be a 1-D int64 tensor, got {getattr(tensor, 'dtype', type(tensor).__name__)}")
    if tensor.device.type != "cpu":
        raise TypeError(f"{name} must be on the CPU, got {tensor.device}")
    if count is not None and tensor.numel() != count:
        raise ValueError(f"{name} has {tensor.numel()} entries, expected {count}")
    return tensor.contiguous()


def copy_host_blocks(dst_addrs, src_addrs, sizes, *, threads: int | None = None, mode: str | None = None) -> str:
    """Copy ``sizes[i]`` bytes from address ``src_addrs[i]`` to ``dst_addrs[i]``, for every i.

    All three are 1-D int64 CPU tensors. The addresses must stay valid for the call (the
    caller keeps the tensors they point into alive). Blocks must not overlap each other's
    destinations. ``mode``: ``"native"`` or ``"python"`` (default: `host_copy_mode()`, from
    the environment). Returns the path taken.
    """
    sizes = _check("sizes", sizes, None)
    dst_addrs = _check("dst_addrs", dst_addrs, sizes.numel())
    src_addrs = _check("src_addrs", src_addrs, sizes.numel())
    if mode is None:
        mode = host_copy_mode()
    elif mode not in ("native", "python") or (mode == "native" and _native is None):
        raise ValueError(f"mode must be 'python' or (when the helper is built) 'native', got {mode!r}")
    if sizes.numel() == 0:
        return mode
    if int(sizes.min()) < 0:
        raise ValueError(f"sizes must be >= 0, got {int(sizes.min())}")
    return copy_checked_blocks(dst_addrs, src_addrs, sizes, int(sizes.sum()), mode=mode, threads=threads)


def copy_checked_blocks(dst_addrs, src_addrs, sizes, total: int, *, mode: str, threads: int | None = None) -> str:
    """`copy_host_blocks` for descriptors already checked (contiguous int64 CPU tensors of one
    length, sizes >= 0 adding up to ``total``, ``mode`` valid): the per-call path of a
    prepared, reused batch."""
    workers = copy_workers(total, threads)
    if mode == "native":
        _native.copy_blocks(
            dst_addrs.data_ptr(), src_addrs.data_ptr(), sizes.data_ptr(), sizes.numel(), workers, total >= STREAM_BYTES
        )
    else:
        _memmove_threads(dst_addrs.tolist(), src_addrs.tolist(), sizes.tolist(), workers)
    return mode


def copy_parts(parts, total: int, *, mode: str, threads: int | None = None) -> None:
    """Copy every part ``(dst_offsets, src_offsets, sizes, total, dst_base, src_base)`` (checked
    contiguous int64 CPU tensors) in one call, the ``total`` bytes shared by the threads."""
    workers = copy_workers(total, threads)
    if mode == "native":
        native = [(d.data_ptr(), s.data_ptr(), z.data_ptr(), z.numel(), db, sb) for d, s, z, _, db, sb in parts]
        _native.copy_parts(native, workers, total >= STREAM_BYTES)
        return
    dsts, srcs, sizes = [], [], []
    for dst_offsets, src_offsets, part_sizes, _, dst_base, src_base in parts:
        dsts += [offset + dst_base for offset in dst_offsets.tolist()]
        srcs += [offset + src_base for offset in src_offsets.tolist()]
        sizes += part_sizes.tolist()
    _memmove_threads(dsts, srcs, sizes, workers)


def streaming_copier(parts):
    """A function ``(index, src_base)`` copying one checked pattern of blocks with non-temporal
    stores and a fence, in one call of the C helper: for a destination this CPU does not read
    again soon (a page written into a host pool). Each part ``(dst_offsets, src_offsets, sizes,
    dst_base, dst_step)`` (contiguous int64 CPU tensors, sizes >= 0) copies ``src_base +
    src_offsets[i]`` to ``dst_base + index * dst_step + dst_offsets[i]``. On the calling thread:
    a page write is one of many that a back end's own threads issue side by side (an 8.5 MB
    Mamba slot took 2x as long over two threads started per call as on one, on 2 cores). None
    without the helper: the caller copies another way."""
    if _native is None:
        return None
    native = [(d.data_ptr(), s.data_ptr(), z.data_ptr(), z.numel(), base, step) for d, s, z, base, step in parts]
    keep = tuple(parts)  # the tensors the addresses point into live as long as the function
    if len(native) == 1:  # one buffer (every KV page): one call, nothing built per page
        (dsts, srcs, lengths, count, base, step), = native
        copy = _native.copy_blocks

        def write(index: int, src_base: int, _keep=keep) -> None:
            copy(dsts, srcs, lengths, count, 1, True, base + index * step, src_base)

        return write
    copy_parts = _native.copy_parts

    def write_parts(index: int, src_base: int, _keep=keep) -> None:
        copy_parts([(d, s, z, n, base + index * step, src_base) for d, s, z, n, base, step in native], 1, True)

    return write_parts


def gathering_copier(part):
    """A function ``(index, dst_base)`` copying one checked pattern of host blocks into a flat
    destination, in one call of the C helper with plain stores (what it copies is read right
    away: a flat page handed to an L3 back end). ``part`` is one of `streaming_copier`'s parts
    ``(dst_offsets, src_offsets, sizes, base, step)``, read the other way: the block at ``base
    + index * step + dst_offsets[i]`` is copied to ``dst_base + src_offsets[i]``. On the calling
    thread. None without the helper."""
    if _native is None:
        return None
    dsts, srcs, sizes, base, step = part
    blocks, flat, lengths, count = dsts.data_ptr(), srcs.data_ptr(), sizes.data_ptr(), sizes.numel()
    copy = _native.copy_blocks

    def read(index: int, dst_base: int, _keep=part) -> None:
        copy(flat, blocks, lengths, count, 1, False, dst_base, base + index * step)

    return read


def _memmove_all(dsts, srcs, sizes) -> None:
    move = ctypes.memmove
    for dst, src, size in zip(dsts, srcs, sizes):
        move(dst, src, size)


def _executor() -> ThreadPoolExecutor:
    global _pool
    if _pool is None:  # threads start lazily, as many as the largest copy asked for
        _pool = ThreadPoolExecutor(max_workers=MAX_THREADS, thread_name_prefix="hicache-copy")
    return _pool


def _memmove_threads(dsts, srcs, sizes, workers: int) -> None:
    workers = min(workers, len(sizes), MAX_THREADS)
    if workers <= 1:
        _memmove_all(dsts, srcs, sizes)
        return
    # interleaved shares: every thread walks the whole range, in step with the rest; on Ctrl-C
    # every share finishes before the caller may free the memory they write into, and at the
    # interpreter's exit (no new thread work) the shares run on this thread
    run_each(_executor().submit, _memmove_all,
             [(dsts[i::workers], srcs[i::workers], sizes[i::workers]) for i in range(workers)])
