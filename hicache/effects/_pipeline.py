"""The pipelined half of the bring-up: pre-fault chunk k+1 while chunk k registers.

Owns a background thread that faults the buffers in the order the executor registers them,
in calls of at most PREFAULT_PIECE_BYTES that its worker threads take one after another (none
waits for another at a piece's end), and tells the executor how far each buffer is resident,
in order (it waits for that before each register call, so ``cudaHostRegister`` finds its pages
already faulted and does not fault them single-threaded under the driver lock). A stop request
ends the thread after the calls in flight; `join` must run before the memory can be freed.
"""

from __future__ import annotations

import os
import threading
import time

from hicache.effects._host_memory import (
    PREFAULT_PIECE_BYTES,
    _run_workers,
    lower_priority,
    prefault,
    started_executor,
)

#: The most faulted between two progress updates (calls are at most PREFAULT_PIECE_BYTES too):
#: a chunk of a plan can be 64 GiB; the first register call should not wait for all of it.
PIECE_BYTES = 256 * 2**20
#: How much nicer the background pre-fault threads run than the process: faulting may take
#: every core, but the register calls it feeds and a progressive pool's serving threads come
#: first (on 2 cores, a progressive pool's first page: 11.3 -> 8.8 ms MLA, 13.1 -> 11.2 ms
#: MHA page_first, medians of 2 x 7 alternating runs).
BACKGROUND_NICE = 5


class Prefaulter:
    """Faults ``buffers`` (HostBuffers, in registration order) in the background."""

    def __init__(self, buffers, *, threads: int | None = None, piece_bytes: int | None = None, order=None) -> None:
        """``order``: ``(buffer index, start, length)`` spans to fault in that order (default:
        each buffer front to back); with it, wait with `wait_span`."""
        self.buffers = list(buffers)
        self.order = list(order) if order is not None else [(i, 0, b.nbytes) for i, b in enumerate(self.buffers)]
        self.spans_done = 0
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

    def _calls(self) -> list:
        """The order cut into calls of at most min(piece_bytes, PREFAULT_PIECE_BYTES), whole
        pages each, and into at least one call per thread where a span allows (a small first
        span - what the first register call waits for - is faulted by every thread):
        ``(span position, buffer index, offset, length)``; an empty span is one empty call, so
        that progress passes it in order."""
        calls = []
        for position, (index, first, span) in enumerate(self.order):
            buffer = self.buffers[index]
            unit = buffer.hugepage_bytes or buffer.page_bytes
            offset, end = first, min(first + span, buffer.nbytes)
            share = -(-(end - offset) // self._workers)
            step = max(unit, min(self.piece_bytes, PREFAULT_PIECE_BYTES, -(-share // unit) * unit) // unit * unit)
            if offset >= end:
                calls.append((position, index, offset, 0))
            while offset < end:
                length = min(step, end - offset)
                calls.append((position, index, offset, length))
                offset += length
        return calls

    def _run(self) -> None:
        start = time.perf_counter()
        pool = None
        try:
            calls = self._calls()
            finished = [False] * len(calls)
            frontier = [0]  # every call before it has finished

            def fault(number: int) -> None:
                position, index, offset, length = calls[number]
                if length:
                    prefault(self.buffers[index], threads=1, start=offset, length=length, piece_bytes=length)
                with self._changed:  # progress in order: a later call may finish first
                    finished[number] = True
                    while frontier[0] < len(calls) and finished[frontier[0]]:
                        position, index, offset, length = calls[frontier[0]]
                        if self.order[position][1] <= self.done[index]:
                            self.done[index] = max(self.done[index], offset + length)
                        frontier[0] += 1
                        if frontier[0] == len(calls) or calls[frontier[0]][0] != position:
                            self.spans_done += 1
                    self._changed.notify_all()

            if self._workers > 1:
                # threads started before the first call (a thread started beside one waits for
                # it); each takes the next call, none waits for another at a piece's end
                pool = started_executor(self._workers, nice=BACKGROUND_NICE)
                _run_workers(pool, self._workers, fault, range(len(calls)), stop=self._stop)
            else:
                lower_priority(BACKGROUND_NICE)
                for number in range(len(calls)):
                    if self._stop.is_set():
                        return
                    fault(number)
        except BaseException as error:  # reported to the waiting executor, never swallowed
            self.error = error
        finally:
            if pool is not None:
                pool.shutdown(wait=True)  # no call still faulting once this thread ends
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
