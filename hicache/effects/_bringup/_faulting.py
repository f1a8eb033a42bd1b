"""What is faulted when: the background pre-fault that the pipelined and progressive bring-ups
register behind (and that a blocking one waits for, where its allocator maps unfaulted).

Owns a background thread that faults the buffers in the order the executor registers them,
in calls of at most PREFAULT_PIECE_BYTES that its worker threads take one after another (none
waits for another at a piece's end), and tells the executor how far each buffer is resident,
in order (it waits for that before each register call, so ``cudaHostRegister`` finds its pages
already faulted and does not fault them single-threaded under the driver lock). A stop request
ends the thread after the calls in flight; `join` must run before the memory can be freed.
For progressive bring-ups it also owns cutting each chunk into pieces in the order the calls
will reach them (`fault_pieces`) and the hooks that make each call wait for its own pieces
only (`ProgressiveFaulting`). Imports the host room only.
"""

from __future__ import annotations

import bisect
import os
import threading
import time

from hicache.effects._cuda._progressive import chunk_order
from hicache.effects._trace import span
from hicache.effects._host._threads import lower_priority, pin_thread
from hicache.effects._host._memory import (
    PREFAULT_PIECE_BYTES,
    _run_workers,
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


def _cpus_text() -> str | None:
    """The CPUs the calling thread may run on, as the kernel lists them ("0-3,8"), for the trace."""
    try:
        cpus = sorted(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return None
    runs: list[list[int]] = []
    for cpu in cpus:
        if runs and runs[-1][1] == cpu - 1:
            runs[-1][1] = cpu
        else:
            runs.append([cpu, cpu])
    return ",".join(str(a) if a == b else f"{a}-{b}" for a, b in runs)


class Prefaulter:
    """Faults ``buffers`` (HostBuffers, in registration order) in the background."""

    def __init__(self, buffers, *, threads: int | None = None, piece_bytes: int | None = None, order=None,
                 on_piece=None, cpus=None, nice: int = BACKGROUND_NICE, thp=None) -> None:
        """``order``: ``(buffer index, start, length)`` spans to fault in that order (default:
        each buffer front to back); with it, wait with `wait_span`. ``on_piece(nbytes)``: after
        each piece, from the thread that faulted it (progress reports). ``cpus``: every
        faulting thread runs on these only (the pool's node's, `_numa.fault_share`). ``nice``:
        how much nicer its threads run than the process (0 where nothing of ours runs beside
        them: a blocking bring-up waits for them). ``thp``: a `ThpAuto` deciding each piece's
        page size just before it faults (``hugepages="auto"``), or None (the mapping's own advice)."""
        self.nice = nice
        self.thp = thp
        self.buffers = list(buffers)
        self.on_piece = on_piece
        self.order = list(order) if order is not None else [(i, 0, b.nbytes) for i, b in enumerate(self.buffers)]
        self.spans_done = 0
        self.piece_bytes = PIECE_BYTES if piece_bytes is None else piece_bytes
        self._workers = threads or min(os.cpu_count() or 1, 16)
        self.cpus = tuple(cpus) if cpus else None
        self.done = [0] * len(self.buffers)  # bytes faulted from the start of each buffer
        self.seconds = 0.0  # the whole pre-fault's, once it has ended (`elapsed()` meanwhile)
        self._started: float | None = None
        self._ended = False
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
        for position, (index, first, extent) in enumerate(self.order):
            buffer = self.buffers[index]
            unit = buffer.hugepage_bytes or buffer.page_bytes
            offset, end = first, min(first + extent, buffer.nbytes)
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
        start = self._started = time.perf_counter()
        pool = None
        try:
            calls = self._calls()
            finished = [False] * len(calls)
            frontier = [0]  # every call before it has finished

            def fault(number: int) -> None:
                position, index, offset, length = calls[number]
                if length:
                    with span("pre-fault", "prefault", buffer=index, offset=offset, size=length) as args:
                        if args is not None:  # tracing: where the kernel ran it (issue #35 item 2)
                            args["cpus"] = _cpus_text()
                        buffer = self.buffers[index]

                        def populate(start: int, nbytes: int) -> None:
                            prefault(buffer, threads=1, start=offset + start, length=nbytes, piece_bytes=nbytes)

                        if self.thp is None:
                            populate(0, length)
                        else:  # decided, faulted (a THP piece in steps) and judged on this thread
                            self.thp.fault(index, buffer.ptr + offset, length, populate)
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
                if length and self.on_piece is not None:
                    self.on_piece(length)

            if self._workers > 1:
                # threads started before the first call (a thread started beside one waits for
                # it); each takes the next call, none waits for another at a piece's end
                pool = started_executor(self._workers, nice=self.nice, cpus=self.cpus)
                _run_workers(pool, self._workers, fault, range(len(calls)), stop=self._stop)
            else:
                lower_priority(self.nice)
                pin_thread(self.cpus)
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
            self._ended = True
            with self._changed:
                self._changed.notify_all()

    def elapsed(self) -> float:
        """Seconds of faulting so far: the whole pre-fault's once it has ended (a progressive
        bring-up's metrics follow its background pre-fault, issue #54), 0 before it starts."""
        if self._ended or self._started is None:
            return self.seconds
        return time.perf_counter() - self._started

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


#: The first pre-fault piece of each chunk; each next one doubles up to the pipeline's
#: PIECE_BYTES (256 MiB), so the first call of every chunk waits for little faulting - and the
#: last pieces halve back down to it, so the last call, made once the last piece is faulted,
#: registers little (not up to 256 MiB after all faulting is done).
FIRST_PIECE_BYTES = 16 * 2**20


def piece_sizes(size: int) -> list[int]:
    """A chunk of ``size`` bytes cut into pre-fault pieces: `FIRST_PIECE_BYTES` first, doubling
    up to `PIECE_BYTES`, then as many of those as fit, and halving again towards the end."""
    front, back, rest, piece = [], [], size, min(FIRST_PIECE_BYTES, PIECE_BYTES)
    while piece < PIECE_BYTES and rest:
        for side in (front, back):
            take = min(piece, rest)
            if take:
                side.append(take)
                rest -= take
        piece *= 2
    middle = [PIECE_BYTES] * (rest // PIECE_BYTES) + ([rest % PIECE_BYTES] if rest % PIECE_BYTES else [])
    return front + middle + back[::-1]


def fault_pieces(spans, key=None) -> tuple[list, list]:
    """Cut each chunk's span ``(buffer index, offset, size)`` into pre-fault pieces
    (`piece_sizes`) and order them as the registration will reach them (``key(index, offset in
    chunk)``, then chunk, then offset). Returns the pieces and, per chunk, ``[(end in chunk,
    position in the order)]`` in offset order (positions rise with it): a call on chunk i
    ending at e waits for the piece whose end is the first at or past e."""
    key = key if key is not None else chunk_order
    cut = []
    for index, (buffer, offset, size) in enumerate(spans):
        done = 0
        for length in piece_sizes(size):
            cut.append((key(index, done), index, done, buffer, offset + done, length))
            done += length
    cut.sort(key=lambda c: (c[0], c[1], c[2]))
    ends: list[list] = [[] for _ in spans]
    for position, (_, index, done, _, _, length) in enumerate(cut):
        ends[index].append((done + length, position))
    return [(buffer, offset, length) for *_, buffer, offset, length in cut], ends


class ProgressiveFaulting:
    """The background pre-fault of a progressive bring-up: ``order`` (each chunk's ``(buffer
    index, offset, size)`` in ``buffers``) cut into pieces in the order the calls reach them
    (``key`` as `ProgressiveRegistration`'s), and the two hooks its calls wait through."""

    def __init__(self, buffers, order, *, key=None, threads: int | None = None, on_piece=None, cpus=None,
                 thp=None) -> None:
        pieces, self._ends = fault_pieces(order, key)
        self._positions = [[position for _, position in chunk_ends] for chunk_ends in self._ends]
        self._count = len(pieces)
        self.faulter = Prefaulter(buffers, order=pieces, threads=threads, on_piece=on_piece, cpus=cpus,
                                  thp=thp)  # started by start()

    def start(self) -> None:
        self.faulter.start()

    def before_call(self, index: int, end: int, stop) -> None:
        """Return once chunk ``index`` is faulted up to ``end`` (its piece reaching ``end``)."""
        ends = self._ends[index]
        at = bisect.bisect_left(ends, (end, -1))
        self.faulter.wait_span(ends[at][1], stop=stop)

    def resident(self, index: int, done: int, stop) -> int:
        """How far chunk ``index`` is faulted from its start, waiting for one piece past ``done``."""
        ends = self._ends[index]
        at = bisect.bisect_right(ends, (done, self._count))  # the next piece past done
        self.faulter.wait_span(ends[at][1], stop=stop)
        faulted = bisect.bisect_left(self._positions[index], self.faulter.spans_done) - 1
        return ends[max(at, faulted)][0]

    def stop(self) -> None:
        """End the faulting after the calls in flight and wait for it (no page may still be
        faulting when the memory is freed; a Ctrl-C meanwhile is re-raised after)."""
        self.faulter.stop()
        self.faulter.join(quiet=True)
