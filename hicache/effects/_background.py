"""Background bring-up: pre-fault and progressive registration started and torn down as one.

Owns cutting the memory into pre-fault pieces in the order the registration will reach it,
the hooks that make each call wait for its own pieces only (and register no more than is
faulted), and the two users: `BackgroundBringUp` (progressive pools and apply) and
`ProgressiveBringUp` (`hicache apply --progressive`: map under the budget, then all of this).
"""

from __future__ import annotations

import bisect
import time

from hicache.effects._bringup import bring_up
from hicache.effects._interrupts import deferred_interrupts
from hicache.effects._pipeline import PIECE_BYTES, Prefaulter
from hicache.effects._progressive import MAX_STALL_S, Chunk, ProgressiveRegistration, chunk_order
from hicache.errors import ReleaseError

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


class BackgroundBringUp:
    """A progressive registration and its background pre-fault, started and torn down as one:
    memory is faulted in pieces in the order the calls will need it, and each call waits for
    its own bytes only. Shared by progressive pools and `ProgressiveBringUp`; ``registration``
    is assigned before anything registers, so a failing start can still be undone by
    `release`."""

    def __init__(self, chunks, order, host_buffers, *, runtime=None, ledger=None, on_chunk=None, key=None,
                 max_stall_s=MAX_STALL_S, threads=None) -> None:
        """``order``: each chunk's ``(buffer index, offset, size)`` in ``host_buffers``;
        ``key``: as `ProgressiveRegistration`'s."""
        pieces, ends = fault_pieces(order, key)
        positions = [[position for _, position in chunk_ends] for chunk_ends in ends]

        def before_call(index: int, end: int, stop) -> None:
            at = bisect.bisect_left(ends[index], (end, -1))
            self.faulter.wait_span(ends[index][at][1], stop=stop)

        def resident(index: int, done: int, stop) -> int:
            at = bisect.bisect_right(ends[index], (done, len(pieces)))  # the next piece past done
            self.faulter.wait_span(ends[index][at][1], stop=stop)
            faulted = bisect.bisect_left(positions[index], self.faulter.spans_done) - 1
            return ends[index][max(at, faulted)][0]

        self.faulter = Prefaulter(host_buffers, order=pieces, threads=threads)  # started by start()
        self.registration = ProgressiveRegistration(
            chunks, runtime=runtime, ledger=ledger, on_chunk=on_chunk, max_stall_s=max_stall_s, key=key,
            before_call=before_call, resident=resident,
        )

    def start(self, ready=None) -> "BackgroundBringUp":
        """Start the registration thread, then the pre-fault (no thread starts while a
        pre-fault call holds the mmap lock), then register until ``ready()``."""
        self.registration.start(ready, begin=self.faulter.start)
        return self

    def wait(self, timeout: float | None = None) -> bool:
        return self.registration.wait(timeout)

    def stop(self) -> None:
        """End both threads; no page may still be faulting when the memory is freed."""
        try:
            self.registration.stop()
        finally:
            self.faulter.stop()
            self.faulter.join(quiet=True)

    def release(self, books) -> None:
        """Stop, then unregister every call; on `ReleaseError` the memory's ``books`` are
        quarantined (CUDA still pins some of it: never unmap) and the error raised. Ctrl-C is
        held until both are done."""
        with deferred_interrupts():
            self.stop()
            try:
                self.registration.release()
            except ReleaseError as error:
                with books.lock:
                    books.mark_leaked(error.leaked)
                raise


class ProgressiveBringUp:
    """`hicache apply --progressive`: map (budgeted, under the lock), then fault and register
    the plan's chunks in plan order in the background, the first before this returns.
    ``first_chunk_s`` is the time to the first registered chunk; `release()` stops both
    background threads, unregisters, then frees."""

    def __init__(self, pools, *, runtime=None, allocator=None, ledger=None, max_stall_s=MAX_STALL_S, **options) -> None:
        import torch  # noqa: F401 - imported before the clock starts: servers have it loaded already

        start = time.perf_counter()
        pools = list(pools)
        self.handle = bring_up(pools, register=False, prefault=False, allocator=allocator, ledger=ledger, **options)
        self.first_chunk_s = None
        self.background = None
        chunks, order = [], []
        buffers = [b for pool in pools for b in pool.buffers]
        for index, (buffer, tensor) in enumerate(zip(buffers, self.handle.tensors)):
            for item in buffer.plan.ranges:
                chunks.append(Chunk(buffer.spec.name, tensor.data_ptr() + item.offset, item.size,
                                    buffer.plan.granularity_bytes, buffer.plan.limits))
                order.append((index, item.offset, item.size))

        def first(*_):
            if self.first_chunk_s is None:
                self.first_chunk_s = time.perf_counter() - start

        try:
            self.background = BackgroundBringUp(chunks, order, self.handle.host_buffers, runtime=runtime,
                                                ledger=ledger, on_chunk=first, max_stall_s=max_stall_s,
                                                threads=getattr(allocator, "prefault_threads", None))
            self.background.start()
        except BaseException:
            self.release()
            raise

    @property
    def registration(self) -> ProgressiveRegistration:
        return self.background.registration

    def wait(self, timeout: float | None = None) -> bool:
        return self.background.wait(timeout)

    def release(self) -> None:
        """Stop, unregister, free; Ctrl-C is held until all of it is done."""
        with deferred_interrupts():
            if self.background is not None:
                self.background.release(self.handle._books)
            self.handle.release()
