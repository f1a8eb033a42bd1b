"""Progressive registration: serve early, keep registering in the background.

Owns registering a pool chunk by chunk - each chunk its own one-range transaction, so a
failure leaves every earlier chunk registered and usable - the first ``head`` chunks before
the constructor returns and the rest from a background thread that reports each chunk done.
A stop request ends the thread after the call in flight; `release` unregisters every chunk
(newest first) once the thread has ended. The order and what "ready" means for pages are the
pool's business (hicache.pools); this module only registers.
"""

from __future__ import annotations

import logging
import threading

import attrs

from hicache.effects._executor import _apply
from hicache.effects._runtime import default_runtime
from hicache.errors import ApplyError, ReleaseError
from hicache.plan import Limits, pace, plan_registration

#: The first call of a progressive bring-up registers at most this much: its rate is unknown yet.
FIRST_CALL_BYTES = 256 * 2**20
#: Default stall budget: no single call should hold the driver lock longer (it blocks every
#: other CUDA call of the process meanwhile - a serving engine's included).
MAX_STALL_S = 0.25

logger = logging.getLogger(__name__)


@attrs.frozen
class Chunk:
    """One registration call of a progressive bring-up: ``size`` bytes at ``ptr`` (a whole range
    of the pool's plan), ``buffer`` naming it in errors."""

    buffer: str
    ptr: int
    size: int
    granularity_bytes: int | None
    limits: Limits


def _single_plan(chunk: Chunk, ptr: int, size: int):
    real = ptr & -ptr if ptr else chunk.limits.base_alignment_bytes
    limits = attrs.evolve(chunk.limits, base_alignment_bytes=min(real, chunk.limits.base_alignment_bytes))
    plan = plan_registration(size, granularity_bytes=chunk.granularity_bytes, limits=limits)
    if plan.call_count != 1:  # a chunk is one range of a plan that already obeyed every cap
        raise ApplyError(f"chunk of {size} bytes at 0x{ptr:x} would need {plan.call_count} calls")
    return plan


class ProgressiveRegistration:
    """Registers ``chunks`` in order; `start(head)` registers the first ``head`` now and the
    rest in a background thread, calling ``on_chunk(index)`` after each (from that thread)."""

    def __init__(self, chunks, *, runtime=None, ledger=None, flags: int = 0, on_chunk=None, before_chunk=None,
                 max_stall_s: float | None = MAX_STALL_S) -> None:
        """``before_chunk(index, stop)``: runs before registering chunk ``index`` and returns once
        its memory is resident (the pool's background pre-fault). ``on_chunk(index, offset,
        size)``: after each call (a paced piece of chunk ``index``). ``max_stall_s``: pace the
        calls - the first at most `FIRST_CALL_BYTES`, then what the measured rate registers in
        that many seconds (`hicache.plan.pace`: never below the plan's boundary alignment);
        None: one call per chunk."""
        self.chunks = list(chunks)
        self.before_chunk = before_chunk
        self.max_stall_s = max_stall_s
        self.calls: list[tuple[int, int, float]] = []  # (chunk index, bytes, seconds) per call
        self.completed = 0  # chunks wholly registered
        self._bytes = 0
        self._seconds = 0.0
        self.runtime = default_runtime() if runtime is None else runtime
        self.ledger = ledger
        self.flags = flags
        self.on_chunk = on_chunk
        self.registrations: list = []  # one Registration per registered chunk, in order
        self.error: BaseException | None = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()

    def _budget(self) -> int | None:
        if self.max_stall_s is None:
            return None
        if not self._seconds:
            return FIRST_CALL_BYTES
        return max(1, int(self._bytes / self._seconds * self.max_stall_s))

    def _register(self, index: int) -> None:
        chunk = self.chunks[index]
        if self.before_chunk is not None:
            self.before_chunk(index, self._stop.is_set)
            if self._stop.is_set():
                return
        whole = _single_plan(chunk, chunk.ptr, chunk.size)
        done = 0
        while done < chunk.size:
            if done and self._stop.is_set():
                return  # stop between calls: what is registered stays in the books
            budget = self._budget()
            rest = _single_plan(chunk, chunk.ptr + done, chunk.size - done) if done else whole
            piece = (pace(rest, 0, budget) if budget is not None else rest).ranges[0]
            plan = _single_plan(chunk, chunk.ptr + done, piece.size)
            registration = _apply([(chunk.buffer, chunk.ptr + done, plan)], runtime=self.runtime, flags=self.flags,
                                  progress=None, retry_halvings=0, ledger=self.ledger)
            with self._lock:
                self.registrations.append(registration)
            seconds = registration.status().register_seconds
            self._bytes += piece.size
            self._seconds += seconds
            self.calls.append((index, piece.size, seconds))
            if self.on_chunk is not None:
                self.on_chunk(index, done, piece.size)
            done += piece.size
        self.completed += 1

    def start(self, head: int) -> "ProgressiveRegistration":
        """Register chunks ``[0, head)`` here (errors raise: nothing is served yet), the rest in
        the background."""
        for index in range(min(head, len(self.chunks))):
            self._register(index)
        if head < len(self.chunks):
            self._thread = threading.Thread(target=self._run, args=(head,), name="hicache-progressive", daemon=True)
            self._thread.start()
        return self

    def _run(self, first: int) -> None:
        for index in range(first, len(self.chunks)):
            if self._stop.is_set():
                return
            try:
                self._register(index)
            except BaseException as error:  # the pool keeps working at its registered prefix
                self.error = error
                logger.error("background registration stopped at chunk %d of %d: %s", index + 1,
                             len(self.chunks), error)
                return

    @property
    def done(self) -> bool:
        return self._thread is None or not self._thread.is_alive()

    def wait(self, timeout: float | None = None) -> bool:
        """True once every chunk is registered; False on timeout; the background error if the
        registration stopped on one."""
        if self._thread is not None:
            self._thread.join(timeout)
            if self._thread.is_alive():
                return False
        if self.error is not None:
            raise self.error
        return self.completed == len(self.chunks)

    def stop(self) -> None:
        """End the background thread after the call in flight (and wait for it; a Ctrl-C
        meanwhile is re-raised once it has ended)."""
        self._stop.set()
        interrupted = None
        while self._thread is not None and self._thread.is_alive():
            try:
                self._thread.join()
            except KeyboardInterrupt as interrupt:
                interrupted = interrupted or interrupt
        if interrupted is not None:
            raise interrupted

    def release(self) -> None:
        """Stop, then unregister every chunk, newest first; `ReleaseError` lists what stays."""
        self.stop()
        leaked: list = []
        with self._lock:
            registrations, self.registrations = self.registrations, []
        for registration in reversed(registrations):
            try:
                registration.release()
            except ReleaseError as error:
                leaked.extend(error.leaked)
        if leaked:
            raise ReleaseError(f"{len(leaked)} range(s) stay registered after a progressive release", leaked=tuple(leaked))


class BackgroundBringUp:
    """A progressive registration and its background pre-fault, started and torn down as one:
    each chunk is faulted (in ``order``) just before it registers. Shared by progressive pools
    and `ProgressiveBringUp`; ``registration`` is assigned before anything registers, so a
    failing head can still be undone by `release`."""

    def __init__(self, chunks, order, host_buffers, *, runtime=None, ledger=None, on_chunk=None,
                 max_stall_s=MAX_STALL_S, threads=None) -> None:
        from hicache.effects._pipeline import Prefaulter

        self.faulter = Prefaulter(host_buffers, order=order, threads=threads).start()
        try:
            self.registration = ProgressiveRegistration(
                chunks, runtime=runtime, ledger=ledger, on_chunk=on_chunk, max_stall_s=max_stall_s,
                before_chunk=lambda position, stop: self.faulter.wait_span(position + 1, stop),
            )
        except BaseException:
            self.faulter.stop()
            self.faulter.join(quiet=True)
            raise

    def start(self, head: int) -> "BackgroundBringUp":
        self.registration.start(head)
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
        """Stop, then unregister every chunk; on `ReleaseError` the memory's ``books`` are
        quarantined (CUDA still pins some of it: never unmap) and the error raised."""
        self.stop()
        try:
            self.registration.release()
        except ReleaseError:
            books.quarantine()
            books.state = "leaked"
            raise


class ProgressiveBringUp:
    """`hicache apply --progressive`: map (budgeted, under the lock), then fault and register
    the plan's chunks in plan order in the background, the first before this returns.
    ``first_chunk_s`` is the time to the first registered chunk; `release()` stops both
    background threads, unregisters, then frees."""

    def __init__(self, pools, *, runtime=None, allocator=None, ledger=None, max_stall_s=MAX_STALL_S, **options) -> None:
        import time

        import torch  # noqa: F401 - imported before the clock starts: servers have it loaded already

        from hicache.effects._bringup import bring_up

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
            self.background.start(1)
        except BaseException:
            self.release()
            raise

    @property
    def registration(self) -> ProgressiveRegistration:
        return self.background.registration

    def wait(self, timeout: float | None = None) -> bool:
        return self.background.wait(timeout)

    def release(self) -> None:
        if self.background is not None:
            self.background.release(self.handle._books)
        self.handle.release()
