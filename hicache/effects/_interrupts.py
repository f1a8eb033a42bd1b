"""Holding Ctrl-C while books are kept: a SIGINT that lands mid-bookkeeping waits for it.

Owns `deferred_interrupts`, used by the executor, release and the bring-up around the few
statements that must run together (a register call and its journal entry; storing a handle).
A held interrupt is visible as ``.pending`` so long loops can stop between calls, and is
delivered to the previous handler on exit. Only the main thread receives signals; elsewhere
this does nothing. Imports signal, threading and hicache.errors only.
"""

from __future__ import annotations

import signal
import threading

from hicache.errors import caused_by_interrupt


class deferred_interrupts:
    """``with deferred_interrupts() as held:`` - SIGINT is recorded, not raised, until exit.

    On exit the recorded signal goes to the handler that was installed before (Python's
    default raises KeyboardInterrupt there). ``consume()`` takes it instead, for a caller that
    honours it itself (e.g. by rolling back and raising). Nesting works: the inner block
    delivers to the outer one's recorder.
    """

    def __init__(self) -> None:
        self.pending = False
        self._previous = None
        self._installed = False

    def _hold(self, signum, frame) -> None:
        self.pending = True  # the frame is not kept: it would keep its locals alive

    def __enter__(self) -> "deferred_interrupts":
        if threading.current_thread() is threading.main_thread():
            previous = signal.getsignal(signal.SIGINT)
            if callable(previous):  # SIG_IGN / SIG_DFL / None: nothing Python-level to defer
                self._previous = previous
                signal.signal(signal.SIGINT, self._hold)
                self._installed = True
        return self

    def consume(self) -> bool:
        """True (and forgotten) when an interrupt was held."""
        pending, self.pending = self.pending, False
        return pending

    def __exit__(self, exc_type, exc, tb) -> None:
        if not self._installed:
            return
        signal.signal(signal.SIGINT, self._previous)
        self._installed = False
        if self.consume() and not caused_by_interrupt(exc):
            self._previous(signal.SIGINT, None)  # Python's default handler: KeyboardInterrupt


def interrupt_requested(held: deferred_interrupts | None) -> None:
    """Raise KeyboardInterrupt now when ``held`` recorded one (a loop's safe stopping point)."""
    if held is not None and held.consume():
        raise KeyboardInterrupt
