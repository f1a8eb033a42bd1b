"""Holding Ctrl-C while books are kept - and SIGTERM and SIGHUP handled as Ctrl-C.

Owns `deferred_interrupts`, used by the executor, release and the bring-up around the few
statements that must run together (a register call and its journal entry; storing a handle).
A held interrupt is visible as ``.pending`` so long loops can stop between calls, and is
delivered to the previous handler on exit. Owns `terminate_as_interrupt` too: SIGTERM (what
`timeout`, systemd and Kubernetes send) and SIGHUP raise `TerminationSignal`, a
KeyboardInterrupt, so every rollback that honours Ctrl-C honours them - installed only where
the signal still has its default action (a server's own handler, or nohup's SIG_IGN, stays).
Only the main thread receives signals; elsewhere this does nothing. And `run_each`, how work
handed to threads ends: every call handed out finishes before an error or Ctrl-C goes on, and
what the interpreter's exit refuses to hand out runs on the calling thread; and `start_daemon`,
a thread start that reports a refusal instead of raising it (a finalizer's). Imports signal,
threading, concurrent.futures and hicache.errors only.
"""

from __future__ import annotations

import contextlib
import signal
import threading
from collections import deque
from concurrent.futures import wait
from itertools import compress, repeat

from hicache.errors import TerminationSignal, caused_by_interrupt

#: The signals that stop a bring-up and undo it: Ctrl-C, and the two a supervisor sends.
TERMINATING = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)


def interrupt_for(signum: int | bool) -> KeyboardInterrupt:
    """The exception a held signal is honoured with: `TerminationSignal` for SIGTERM/SIGHUP."""
    if signum in (signal.SIGTERM, signal.SIGHUP):
        return TerminationSignal(signum)
    return KeyboardInterrupt()


def _raise_termination(signum, frame) -> None:
    raise TerminationSignal(signum)


@contextlib.contextmanager
def terminate_as_interrupt():
    """``with terminate_as_interrupt():`` - SIGTERM and SIGHUP raise `TerminationSignal` inside,
    where their action is still the default (the process would die without undoing anything);
    a handler someone else installed, or SIG_IGN, is left alone. Restored on exit. Off the
    main thread it does nothing (only the main thread may set handlers)."""
    main = threading.current_thread() is threading.main_thread()
    mine = [s for s in (signal.SIGTERM, signal.SIGHUP) if main and signal.getsignal(s) is signal.SIG_DFL]
    try:  # installed and restored in one C loop each: no Python line between the two signals
        deque(map(signal.signal, mine, repeat(_raise_termination)), maxlen=0)
        yield
    finally:
        try:
            deque(map(signal.signal, mine, repeat(signal.SIG_DFL)), maxlen=0)
        except KeyboardInterrupt:  # a Ctrl-C that landed just before the restore ran: restore, then honour it
            deque(map(signal.signal, mine, repeat(signal.SIG_DFL)), maxlen=0)
            raise


class deferred_interrupts:
    """``with deferred_interrupts() as held:`` - SIGINT (and SIGTERM/SIGHUP where a Python
    handler takes them, as `terminate_as_interrupt` installs) is recorded, not raised, until exit.

    On exit the recorded signal goes to the handler that was installed before it (Python's
    default raises KeyboardInterrupt there). ``consume()`` takes it instead, for a caller that
    honours it itself (e.g. by rolling back and raising `interrupt_for` of it). Nesting works:
    the inner block delivers to the outer one's recorder.
    """

    def __init__(self) -> None:
        self.pending = 0  # the first held signal's number (0: none)
        self._previous: dict = {}

    def _hold(self, signum, frame) -> None:
        self.pending = self.pending or signum  # the frame is not kept: it would keep its locals alive

    def __enter__(self) -> "deferred_interrupts":
        if threading.current_thread() is threading.main_thread():
            # The three signals in C loops (map, compress): no Python line runs between one
            # signal's handler and the next, so a signal lands before the block or after its
            # handlers are all in place - and the block stays as cheap as it was for one signal.
            handlers = dict(zip(TERMINATING, map(signal.getsignal, TERMINATING)))
            # SIG_IGN / SIG_DFL / None: nothing Python-level to defer
            self._previous = dict(compress(handlers.items(), map(callable, handlers.values())))
            deque(map(signal.signal, self._previous, repeat(self._hold)), maxlen=0)
        return self

    def consume(self) -> int:
        """The held signal's number (and forgotten), 0 when none was held."""
        pending, self.pending = self.pending, 0
        return pending

    def __exit__(self, exc_type, exc, tb) -> None:
        if not self._previous:
            return
        previous, self._previous = self._previous, {}
        deque(map(signal.signal, previous.keys(), previous.values()), maxlen=0)  # as in __enter__: all at once
        signum = self.consume()
        if signum and not caused_by_interrupt(exc):
            previous[signum](signum, None)  # Python's default: KeyboardInterrupt; ours: TerminationSignal


def interrupt_requested(held: deferred_interrupts | None) -> None:
    """Raise the held interrupt now when ``held`` recorded one (a loop's safe stopping point)."""
    if held is not None and (signum := held.consume()):
        raise interrupt_for(signum)


def run_each(submit, function, argument_lists) -> None:
    """``function(*arguments)`` for each of ``argument_lists``, handed to threads by ``submit`` (an
    executor's), and wait for every one; the first error is raised once all have ended. Where
    the pool refuses work - the interpreter is exiting: from atexit handlers on, an executor
    schedules nothing and (Python 3.12) no thread can start at all - the calls it
    refused run on the calling thread: a pool destroyed in a shutdown hook must still give its
    memory back, not raise from its destroy()."""
    futures, refused = [], []
    for arguments in argument_lists:
        if refused:
            refused.append(arguments)
            continue
        try:
            futures.append(submit(function, *arguments))
        except RuntimeError:  # "cannot schedule new futures after interpreter shutdown", "can't create new thread"
            refused.append(arguments)
    try:
        for arguments in refused:
            function(*arguments)
        for future in futures:
            future.result()
    except BaseException:
        # an error or Ctrl-C here: every call handed out ends before the caller goes on (they
        # may write into memory it is about to free), then it is raised
        wait(futures)
        raise


def start_daemon(target, *args, name: str) -> bool:
    """Start ``target(*args)`` on a daemon thread named ``name``; False where no thread can
    start - the interpreter is exiting (Python 3.12 refuses new threads from its atexit handlers on)
    or the process is out of threads - so a finalizer takes its fallback instead of raising
    into "Exception ignored" with its work undone."""
    try:
        threading.Thread(target=target, args=args, name=name, daemon=True).start()
    except RuntimeError:  # "can't create new thread at interpreter shutdown", "can't start new thread"
        return False
    return True
