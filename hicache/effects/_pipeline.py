"""The pipelined half of the bring-up: pre-fault chunk k+1 while chunk k registers.

Owns a background thread that faults the buffers in the order the executor registers them,
piece by piece, and tells the executor how far each buffer is resident (it waits for that
before each register call, so ``cudaHostRegister`` finds its pages already faulted and does not
fault them single-threaded under the driver lock). A stop request ends the thread after the
piece in flight; `join` must run before the memory can be freed.
"""

from __future__ import annotations

import os
import threading
import time

from hicache.effects._host_memory import PREFAULT_PIECE_BYTES, prefault, started_executor

#: Pieces faulted between two progress updates: a chunk of a plan can be 64 GiB; the first
#: register call should not wait for all of it.
PIECE_BYTES = 256 * 2**20


class Prefaulter:
    """Faults ``buffers`` (HostBuffers, in registration order) in the background."""

    def __init__(self, buffers, *, threads: int | None = None, piece_bytes: int | None = None, order=None) -> None:
        """``order``: ``(buffer index, start, length)`` spans to fault in that order (default:
        each buffer front to back); with it, wait with `wait_span`."""
        self.buffers = list(buffers)
        self.order = list(order) if order is not None else [(i, 0, b.nbytes) for i, b in enumerate(self.buffers)]
        self.spans_done = 0
        self.threads = threads
        self.piece_bytes = PIECE_BYTES if piece_bytes is None else piece_bytes
        self._workers = threads or min(os.cpu_count() or 1, 16)
        self.done = [0] * len(self.buffers)  # bytes faulted from the start of each buffer
        self.seconds = 0.0
        self.error: BaseException | None = None
        self._stop = threading.Event()
        self._changed = threading.Condition()
        self._thread = threading.Thread(target=self._run, name="hicache-prefault-pipeline", daemon=True)

    def start(self) -> "Prefaulter":
        self._thread.start()
        return self

    def _run(self) -> None:
        start = time.perf_counter()
        pool = None
        try:
            # threads started before the first call (a thread started beside one waits for it)
            pool = started_executor(self._workers) if self._workers > 1 else None
            for index, first, span in self.order:
                buffer, offset, end = self.buffers[index], first, min(first + span, self.buffers[index].nbytes)
                while offset < end:
                    if self._stop.is_set():
                        return
                    length = min(self.piece_bytes, end - offset)
                    # every thread takes a share of the piece, no call more than PREFAULT_PIECE_BYTES
                    # (each holds the process's mmap lock for its whole range)
                    share = max(buffer.page_bytes, min(PREFAULT_PIECE_BYTES, length // self._workers))
                    prefault(buffer, threads=self.threads, start=offset, length=length, piece_bytes=share,
                             executor=pool)
                    offset += length
                    with self._changed:
                        self.done[index] = max(self.done[index], offset) if first <= self.done[index] else self.done[index]
                        self._changed.notify_all()
                with self._changed:
                    self.spans_done += 1
                    self._changed.notify_all()
        except BaseException as error:  # reported to the waiting executor, never swallowed
            self.error = error
        finally:
            if pool is not None:
                pool.shutdown(wait=True)  # no share of a piece still faulting once this thread ends
            self.seconds = time.perf_counter() - start
            with self._changed:
                self._changed.notify_all()

    def wait(self, index: int, end: int, stop=None) -> None:
        """Return once buffer ``index`` is faulted up to ``end`` (or the faulting failed: its
        error is raised here), or as soon as ``stop()`` says to give up waiting."""
        self._wait_until(lambda: self.done[index] >= min(end, self.buffers[index].nbytes), stop)

    def wait_span(self, position: int, stop=None) -> None:
        """Return once span ``position`` of ``order`` (and every span before it) is faulted
        (see `wait`)."""
        self._wait_until(lambda: self.spans_done > position, stop)

    def _wait_until(self, resident, stop) -> None:
        with self._changed:
            while not resident():
                if self.error is not None:
                    raise self.error
                if stop is not None and stop():
                    return
                if not self._thread.is_alive() and not resident():
                    raise RuntimeError("the pre-fault thread ended before the memory was resident")
                self._changed.wait(0.05)

    def stop(self) -> None:
        self._stop.set()

    def join(self, *, quiet: bool = False) -> None:
        """Wait for the thread (after the piece in flight); raise what faulting raised unless
        ``quiet`` (another error is already on its way). A Ctrl-C meanwhile is re-raised only
        once the thread has ended: the memory it faults must not be freed under it."""
        interrupted = None
        while self._thread.is_alive():
            try:
                self._thread.join()
            except KeyboardInterrupt as interrupt:
                self._stop.set()
                interrupted = interrupted or interrupt
        if interrupted is not None:
            raise interrupted
        if self.error is not None and not quiet:
            raise self.error
