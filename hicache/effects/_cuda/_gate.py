"""`Gate`: what each register call passes before it is made (issue #34 item 6) - its size paced to
the host's stall budget, its bytes ready (the pipelined pre-fault), its turn at the host's driver
(the turnstile) - so the transaction (`_executor`) and the progressive registrar ask one small
object and never call the turnstile themselves. `OPEN` passes every call at once. Imports the
host-wide room's turnstile (what a turn is) and nothing else of effects.
"""

from __future__ import annotations

from hicache.effects._hostwide import _turnstile


class _Open:
    """A turn that was never waited for (no turnstile): releasing it does nothing."""

    def release(self, nbytes: int | None = None) -> None:
        pass


_OPEN_TURN = _Open()


class Gate:
    """``turnstile``: a `Turnstile`, ``"auto"`` (HICACHE_PIN_CONCURRENCY's) or None (no turns,
    no pacing); ``ready(item_index, end_offset, stop)``: returns once that item's bytes up to
    ``end_offset`` are resident (None: they already are)."""

    def __init__(self, turnstile=None, *, ready=None) -> None:
        self._turnstile = _turnstile.resolve(turnstile)
        self._ready = ready

    def join(self) -> bool:
        """Be one of the host's registering processes from now on (auto turnstiles pace then);
        True when there was something to join (then `leave` once)."""
        if self._turnstile is None:
            return False
        self._turnstile.join()
        return True

    def leave(self) -> None:
        if self._turnstile is not None:
            self._turnstile.leave()

    def paced_bytes(self) -> int | None:
        """The most bytes the next call may hold the driver for now (None: no limit)."""
        if self._turnstile is None or not self._turnstile.paces():
            return None
        return self._turnstile.budget_bytes()

    def wait_ready(self, item_index: int, end_offset: int, stop) -> None:
        if self._ready is not None:
            self._ready(item_index, end_offset, stop)

    @property
    def waits_ready(self) -> bool:
        return self._ready is not None

    def turn(self, stop):
        """This call's turn at the host's driver (release it after the call with the bytes it
        registered), or None when ``stop()`` ended the wait first (no call may be made)."""
        if self._turnstile is None:
            return _OPEN_TURN
        return self._turnstile.acquire(stop=stop)


OPEN = Gate()
