"""Giving a released buffer's pages back in parallel (issue #53 item 3): munmap frees every page of
a mapping from one thread, so 37.5 GiB of 4 KiB pages took 2.3-3.3 s to release on an H200 host;
MADV_DONTNEED takes the process's mmap lock only for reading, so several threads free pieces side
by side and the unmap after them has little left to do. Called by `HostBuffer.free` once nothing
else views the memory and nothing of it is registered.
"""

from __future__ import annotations

import os
from concurrent.futures import ThreadPoolExecutor

from hicache.effects._host._libc import madvise_function as _libc_madvise  # a name of this module: tests wrap it

#: Pieces a release gives back from each thread (MADV_DONTNEED takes the mmap lock for reading:
#: threads free pages side by side, where munmap frees them all from one; 6 GiB of 4 KiB pages
#: here: 0.20 s munmap alone, 0.13 s with 2 threads first). Below two pieces: munmap alone.
RELEASE_PIECE_BYTES = 256 * 2**20
MADV_DONTNEED = 4


def give_back(ptr: int, length: int, *, threads: int | None = None) -> int:
    """Free the pages of the mapped range ``[ptr, ptr + length)`` (about to be unmapped) from
    ``threads`` threads (default: cores, at most 16), a `RELEASE_PIECE_BYTES` piece per call;
    returns the threads used (0: the range is too small, munmap alone frees it). A refused call
    (a kernel without MADV_DONTNEED for hugetlbfs) leaves that piece to munmap."""
    pieces = range(ptr, ptr + length, RELEASE_PIECE_BYTES)
    workers = min(threads or min(os.cpu_count() or 1, 16), len(pieces))
    if len(pieces) < 2 or workers < 2:
        return 0
    madvise = _libc_madvise()

    def zap(start: int) -> None:
        madvise(start, min(RELEASE_PIECE_BYTES, ptr + length - start), MADV_DONTNEED)

    with ThreadPoolExecutor(max_workers=workers, thread_name_prefix="hicache-release") as pool:
        list(pool.map(zap, pieces))
    return workers
