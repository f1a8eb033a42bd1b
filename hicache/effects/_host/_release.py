"""Giving a released buffer's pages back in parallel (issue #53 item 3): munmap frees every page of
a mapping from one thread, so 37.5 GiB of 4 KiB pages took 2.3-3.3 s to release on an H200 host;
MADV_DONTNEED takes the process's mmap lock only for reading, so several threads free pieces side
by side and the unmap after them has little left to do. Called by `HostBuffer.free` once nothing
else views the memory and nothing of it is registered - and, for a mapping that outlives its
`HostBuffer` in the tensors viewing it (the plug-in's seam mode: SGLang's own pool keeps the
tensor and drops it after its destroy(); a free deferred to its views), by this module's release
thread once the last view is gone (`ReleasingMapping`).
"""

from __future__ import annotations

import logging
import mmap
import os
import queue
import threading
from concurrent.futures import ThreadPoolExecutor

from hicache.effects._host._libc import madvise_function as _libc_madvise  # a name of this module: tests wrap it
from hicache.effects._interrupts import run_each

logger = logging.getLogger(__name__)

#: Pieces a release gives back from each thread (MADV_DONTNEED takes the mmap lock for reading:
#: threads free pages side by side, where munmap frees them all from one; 6 GiB of 4 KiB pages
#: here: 0.20 s munmap alone, 0.13 s with 2 threads first). Below two pieces: munmap alone.
RELEASE_PIECE_BYTES = 256 * 2**20
MADV_DONTNEED = 4
#: The longest an admission waits for this process's dropped mappings to be given back before it
#: samples free memory (`wait_for_releases`): 37.5 GiB of 4 KiB pages took 2.3-3.3 s to unmap from
#: one thread on an H200 host, so a TB-sized pool's release in pieces fits well inside it.
RELEASE_WAIT_S = 120.0


def give_back(ptr: int, length: int, *, threads: int | None = None) -> int:
    """Free the pages of the mapped range ``[ptr, ptr + length)`` (about to be unmapped) from
    ``threads`` threads (default: cores, at most 16), a `RELEASE_PIECE_BYTES` piece per call;
    returns the threads used (0: the range is too small, munmap alone frees it). A refused call
    (a kernel without MADV_DONTNEED for hugetlbfs) leaves that piece to munmap."""
    pieces = range(ptr, ptr + length, RELEASE_PIECE_BYTES)
    workers = min(threads or min(os.cpu_count() or 1, 16), len(pieces))
    if not in_pieces(length) or workers < 2:
        return 0
    madvise = _libc_madvise()

    def zap(start: int) -> None:
        madvise(start, min(RELEASE_PIECE_BYTES, ptr + length - start), MADV_DONTNEED)

    with ThreadPoolExecutor(max_workers=workers, thread_name_prefix="hicache-release") as pool:
        run_each(pool.submit, zap, [(start,) for start in pieces])  # at the interpreter's exit: on this thread
    return workers


def in_pieces(length: int) -> bool:
    """Whether a range of ``length`` bytes is given back in parallel pieces: two or more of them
    (below that munmap alone frees it)."""
    return length > RELEASE_PIECE_BYTES


class ReleasingMapping(mmap.mmap):
    """An anonymous mapping whose pages go back in parallel pieces (`give_back`) when it dies still
    mapped - when the last tensor viewing it is dropped - rather than by the unmap alone from one
    thread. ``base``: its address, set once mapped (0: not known, an ordinary unmap). Its
    finalizer starts nothing and takes no lock (the garbage collector may run it anywhere): it
    hands the mapping, alive again, to the release thread, which gives its pages back and closes
    it; where that thread is not running (mappings under two pieces, a forked child, the
    interpreter's exit) the unmap alone frees it, as for any mmap."""

    base = 0

    def mapped_at(self, base: int) -> None:
        """Record the mapping's address (known once a tensor views it) and, for one given back in
        pieces, start the release thread now: never from the finalizer."""
        self.base = base
        if in_pieces(len(self)):
            RELEASER.start()

    def __del__(self) -> None:
        try:
            if not self.closed and self.base and in_pieces(len(self)):
                RELEASER.take(self)
        except Exception:  # the interpreter's exit may have cleared this module: the unmap alone
            pass


class _Releaser:
    """The release thread: takes dropped `ReleasingMapping`s in order, gives each one's pages back
    and closes it."""

    def __init__(self) -> None:
        self._queue: queue.SimpleQueue = queue.SimpleQueue()  # put() is safe from a finalizer
        self._lock = threading.Lock()
        self._thread: threading.Thread | None = None
        self._pid = 0

    def _running(self) -> bool:
        thread = self._thread
        return thread is not None and self._pid == os.getpid() and thread.is_alive()

    def start(self) -> None:
        """Start the thread in this process if it is not running (from a mapping's owner, never
        from a finalizer: starting a thread takes locks)."""
        with self._lock:
            if not self._running():
                self._thread = threading.Thread(target=self._run, name="hicache-release", daemon=True)
                self._pid = os.getpid()
                self._thread.start()

    def take(self, mapping: ReleasingMapping) -> bool:
        """From the mapping's finalizer: queue it for the thread (False: no thread here; it is
        unmapped as it dies)."""
        if not self._running():
            return False
        self._queue.put(mapping)
        return True

    def _run(self) -> None:
        while True:  # a daemon: it ends with the process
            item = self._queue.get()
            if isinstance(item, threading.Event):
                item.set()
                continue
            try:
                give_back(item.base, len(item))
            except Exception:  # the unmap still frees every page, from one thread
                logger.exception("hicache: giving a dropped mapping's pages back in parallel failed")
            finally:
                item.close()  # nothing views it any more: the unmap cannot be refused
                del item

    def wait(self, timeout: float | None = None) -> bool:
        """Return once every mapping dropped before this call has been released (True), or False
        on timeout: for a caller that needs the memory back before it maps again."""
        if not self._running():
            return True
        marker = threading.Event()
        self._queue.put(marker)
        return marker.wait(timeout)


#: This process's release thread.
RELEASER = _Releaser()


def wait_for_releases(timeout: float | None = RELEASE_WAIT_S) -> bool:
    """Every mapping dropped so far (its last view gone) has given its pages back and is unmapped:
    True, or False on timeout. An admission calls it before it samples free memory: a pool rebuilt
    right after its predecessor's last view died must not be judged short of that memory, which the
    kernel counts as used until the release thread is done."""
    return RELEASER.wait(timeout)
