"""Progressive registration: serve early, keep registering in the background.

Owns registering a pool call by call - each call its own one-range transaction, so a failure
leaves every earlier call registered and usable - in the foreground until the caller says
enough is ready (a pool: its first page), then from a background thread that reports each
call. Calls are paced (no call holds the driver longer than the stall budget at the measured
rate), go in the caller's order (a pool's: the page they reach), and wait only for their own
bytes of the background pre-fault, registering no more than is already faulted. A stop request
ends the thread after the call in flight; `release` unregisters every call (newest first) once
the thread has ended. What "ready" means for pages is the pool's business (hicache.pools);
faulting the memory alongside is the bring-up room's (`_bringup._faulting`).
"""

from __future__ import annotations

import heapq
import math
import logging
import threading

import attrs

from hicache.effects._cuda._executor import _apply
from hicache.effects._cuda._gate import Gate
from hicache.effects._hostwide import _turnstile
from hicache.effects._interrupts import deferred_interrupts, interrupt_requested
from hicache.effects._cuda._runtime import default_runtime
from hicache.errors import ApplyError, PlanError, ReleaseError
from hicache.plan import Limits, pace, plan_registration
from hicache.plan.checks import is_real

#: The first call of a progressive bring-up registers at most this much: its rate is unknown
#: yet (the issue's cap is 256 MiB), and the first page waits for it and for faulting its bytes
#: (hicache.effects._bringup._faulting.FIRST_PIECE_BYTES, the same 16 MiB) - not for 256 MiB of both.
FIRST_CALL_BYTES = _turnstile.FIRST_CALL_BYTES
#: Default stall budget: no single call should hold the driver lock longer (it blocks every
#: other CUDA call of the process meanwhile - a serving engine's included).
MAX_STALL_S = _turnstile.DEFAULT_MAX_STALL_S

logger = logging.getLogger(__name__)


MIN_STALL_S = 0.001  # shorter budgets pace a pool into one call per page (a 64 MiB pool: 3,073 calls)


def check_max_stall(value, owner: str = "Progressive") -> float | None:
    """``max_stall_s`` as seconds (None: unpaced), or `PlanError` naming the field and the value:
    a real number (numpy's included), finite, at least `MIN_STALL_S`."""
    if value is None:
        return None
    if not is_real(value):
        raise PlanError(f"{owner}.max_stall_s must be seconds (a number) or None, got {value!r}")
    seconds = float(value)
    if not math.isfinite(seconds) or seconds < MIN_STALL_S:
        raise PlanError(f"{owner}.max_stall_s must be a finite number of seconds >= {MIN_STALL_S} (or None: "
                        f"unpaced), got {value!r}")
    return seconds


def chunk_order(index: int, done: int) -> int:
    """The default order of calls: chunk by chunk, as given."""
    return index


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
    """Registers ``chunks`` call by call, always the call whose chunk has the smallest
    ``key(index, done)`` next (default: chunk order); `start(ready)` registers in the
    foreground until ``ready()`` and the rest in a background thread, calling
    ``on_chunk(index, offset, size)`` after each call."""

    def __init__(self, chunks, *, runtime=None, ledger=None, flags: int = 0, on_chunk=None, before_call=None,
                 resident=None, key=None, max_stall_s: float | None = MAX_STALL_S, turnstile=None) -> None:
        """``before_call(index, end, stop)``: runs before each call on chunk ``index`` and returns
        once the chunk's first ``end`` bytes are resident (the pool's background pre-fault): a
        paced call waits for its own bytes, not the whole chunk's. ``resident(index, done,
        stop)``: how far from its start chunk ``index`` is resident now (waiting for at least
        one more piece past ``done``) - a call registers no more than that, so registering never
        waits for faulting it could overlap with. ``key(index, done)``: the
        order calls go in, given the bytes of chunk ``index`` already registered - a pool passes
        the page they reach, so K and V halves (and every buffer) advance together and the
        first page needs one call on each, not a whole 64 GiB chunk of K first. ``max_stall_s``:
        pace the calls - the first at most `FIRST_CALL_BYTES`, then what the measured rate
        registers in that many seconds (`hicache.plan.pace`: never below the plan's boundary
        alignment); None: one call per chunk. ``turnstile``: each call waits for its turn at
        the host's driver and is paced to the turnstile's stall budget too (`_turnstile`)."""
        self.chunks = list(chunks)
        self.gate = Gate(turnstile)  # turns and the host's pacing: the gate asks the turnstile
        self.before_call = before_call
        self.resident = resident
        self.key = key if key is not None else chunk_order
        self.max_stall_s = check_max_stall(max_stall_s, "ProgressiveRegistration")
        self.calls: list[tuple[int, int, float]] = []  # (chunk index, bytes, seconds) per call
        self._done = [0] * len(self.chunks)  # bytes registered from the start of each chunk
        self._queue = [(self.key(index, 0), index) for index, chunk in enumerate(self.chunks) if chunk.size]
        heapq.heapify(self._queue)
        self.completed = len(self.chunks) - len(self._queue)  # chunks wholly registered
        self._bytes = 0
        self._seconds = 0.0
        self.runtime = default_runtime() if runtime is None else runtime
        self.ledger = ledger
        self.flags = flags
        self.on_chunk = on_chunk
        self.registrations: list = []  # one Registration per call, in order
        self.leaked: tuple = ()  # (ptr, size) a release could not unregister
        self.error: BaseException | None = None
        self._stop = threading.Event()
        self._go = threading.Event()  # the background thread's turn: the foreground part ended
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()
        self.at: tuple[int, int] = (0, 0)  # (chunk index, bytes into it) of the call in progress

    def _budget(self) -> int | None:
        own = None
        if self.max_stall_s is not None:
            own = FIRST_CALL_BYTES if not self._seconds else max(1, int(self._bytes / self._seconds * self.max_stall_s))
        host = self.gate.paced_bytes()  # the host's stall budget too
        if host is not None:
            return host if own is None else min(own, host)
        return own

    def _step(self) -> bool:
        """Register the next call; False once nothing is left or a stop was asked for (the
        call not made stays queued)."""
        if not self._queue or self._stop.is_set():
            return False
        index = self._queue[0][1]
        chunk, done = self.chunks[index], self._done[index]
        rest = _single_plan(chunk, chunk.ptr + done, chunk.size - done)
        budget = self._budget()
        if self.resident is not None:
            faulted = self.resident(index, done, self._stop.is_set) - done
            if self._stop.is_set():
                return False
            budget = faulted if budget is None else min(budget, faulted)
        piece = (pace(rest, 0, budget) if budget is not None else rest).ranges[0]
        if self.before_call is not None:
            self.before_call(index, done + piece.size, self._stop.is_set)
            if self._stop.is_set():
                return False  # nothing of this call registered yet
        plan = _single_plan(chunk, chunk.ptr + done, piece.size)
        self.at = (index, done)  # what a failure names: the chunk of the whole bring-up, not "1 of 1"
        with deferred_interrupts() as held:  # a Ctrl-C between the call and its book entry would drop it
            # waited for here: a stop ends the wait, not as a failed call
            turn = self.gate.turn(lambda: held.pending or self._stop.is_set())
            if turn is None:
                interrupt_requested(held)
                return False  # stopped: nothing of this call registered
            registration = None
            try:
                registration = _apply([(chunk.buffer, chunk.ptr + done, plan)], runtime=self.runtime,
                                      flags=self.flags, progress=None, retry_halvings=0, ledger=self.ledger,
                                      gate=self.gate)  # the same turn, re-entered
            finally:  # a registered call's time measures the rate calls are paced by
                turn.release(piece.size if registration is not None else None)
            with self._lock:
                self.registrations.append(registration._owner_releases())  # released in this one's order
        seconds = registration.status().register_seconds
        self._bytes += piece.size
        self._seconds += seconds
        self.calls.append((index, piece.size, seconds))
        self._done[index] = done + piece.size
        if self._done[index] < chunk.size:
            heapq.heapreplace(self._queue, (self.key(index, self._done[index]), index))
        else:
            heapq.heappop(self._queue)
            self.completed += 1
        if self.on_chunk is not None:
            self.on_chunk(index, done, piece.size)
        return True

    def start(self, ready=None, begin=None) -> "ProgressiveRegistration":
        """Register here until ``ready()`` says enough is (default: after the first call;
        errors raise: nothing is served yet), the rest in the background. ``begin()`` runs
        first, once the background thread exists (a pool's pre-fault: starting a thread maps
        its stack, which waits behind any pre-fault call in flight - the mmap lock)."""
        if ready is None:
            ready = lambda: bool(self.calls)  # noqa: E731
        self._thread = threading.Thread(target=self._run, name="hicache-progressive", daemon=True)
        self.gate.join()  # a member until the background thread ends (it leaves)
        try:
            self._thread.start()  # it waits for the foreground part to end
        except BaseException:
            self.gate.leave()
            raise
        try:
            if begin is not None:
                begin()
            while not ready() and self._step():
                pass
        except BaseException:
            self._stop.set()  # the thread ends without a call
            raise
        finally:
            self._go.set()
        return self

    def _run(self) -> None:
        try:
            self._go.wait()
            while self._step():
                pass
        except BaseException as error:  # the pool keeps working at its registered prefix
            self.error = error
            index, done = self.at
            logger.error("background registration stopped at chunk %d of %d (%s, %d bytes into it); %d of %d "
                         "chunks wholly registered: %s", index + 1, len(self.chunks), self.chunks[index].buffer, done,
                         self.completed, len(self.chunks), error)
        finally:
            self.gate.leave()

    def registered(self) -> list:
        """The `Registration` of every call made and not yet released, in order."""
        # with Ctrl-C held: one landing at the with's exit (after the body, before __exit__)
        # would leave the lock held, and the release that follows would wait on it forever
        with deferred_interrupts(), self._lock:
            return list(self.registrations)

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
        self._go.set()
        interrupted = None
        if self._thread is threading.current_thread():
            return  # asked from its own thread (a finalizer there): it ends after this call
        while self._thread is not None and self._thread.is_alive():
            try:
                self._thread.join()
            except KeyboardInterrupt as interrupt:
                interrupted = interrupted or interrupt
        if interrupted is not None:
            raise interrupted

    def release(self) -> None:
        """Stop, then unregister every call, newest first; `ReleaseError` lists what stays
        registered, and a second call retries it. An interrupt raised meanwhile (by the runtime
        too) is re-raised once every call was attempted; a Ctrl-C is held until then (a
        half-done release would drop registrations from the books)."""
        leaked: list = []
        kept: list = []
        interrupt = None
        with deferred_interrupts():
            self.stop()
            with self._lock:
                registrations = list(self.registrations)
            for registration in reversed(registrations):
                try:
                    registration.release()
                except ReleaseError as error:
                    leaked.extend(error.leaked)
                    kept.append(registration)
                except BaseException as error:  # e.g. KeyboardInterrupt from inside the runtime
                    interrupt = interrupt or error
                    status = registration.status()
                    if status.state != "released":
                        leaked.extend(status.leaked)
                        kept.append(registration)
            with self._lock:
                self.registrations = kept[::-1]
        self.leaked = tuple(sorted(leaked))
        if interrupt is not None:
            raise interrupt
        if leaked:
            raise ReleaseError(f"{len(leaked)} range(s) stay registered after a progressive release", leaked=self.leaked)
