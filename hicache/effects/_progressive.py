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
from hicache.plan import Limits, plan_registration

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


def _single_plan(chunk: Chunk):
    real = chunk.ptr & -chunk.ptr if chunk.ptr else chunk.limits.base_alignment_bytes
    limits = attrs.evolve(chunk.limits, base_alignment_bytes=min(real, chunk.limits.base_alignment_bytes))
    plan = plan_registration(chunk.size, granularity_bytes=chunk.granularity_bytes, limits=limits)
    if plan.call_count != 1:  # a chunk is one range of a plan that already obeyed every cap
        raise ApplyError(f"chunk of {chunk.size} bytes at 0x{chunk.ptr:x} would need {plan.call_count} calls")
    return plan


class ProgressiveRegistration:
    """Registers ``chunks`` in order; `start(head)` registers the first ``head`` now and the
    rest in a background thread, calling ``on_chunk(index)`` after each (from that thread)."""

    def __init__(self, chunks, *, runtime=None, ledger=None, flags: int = 0, on_chunk=None, before_chunk=None) -> None:
        """``before_chunk(index, stop)``: runs before registering chunk ``index`` and returns once
        its memory is resident (the pool's background pre-fault)."""
        self.chunks = list(chunks)
        self.before_chunk = before_chunk
        self.runtime = default_runtime() if runtime is None else runtime
        self.ledger = ledger
        self.flags = flags
        self.on_chunk = on_chunk
        self.registrations: list = []  # one Registration per registered chunk, in order
        self.error: BaseException | None = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()

    def _register(self, index: int) -> None:
        chunk = self.chunks[index]
        if self.before_chunk is not None:
            self.before_chunk(index, self._stop.is_set)
            if self._stop.is_set():
                return
        registration = _apply([(chunk.buffer, chunk.ptr, _single_plan(chunk))], runtime=self.runtime,
                              flags=self.flags, progress=None, retry_halvings=0, ledger=self.ledger)
        with self._lock:
            self.registrations.append(registration)
        if self.on_chunk is not None:
            self.on_chunk(index)

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
        return len(self.registrations) == len(self.chunks)

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
