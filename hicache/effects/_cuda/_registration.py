"""`Registration`: what an applied plan holds, and how it is let go.

Owns the undo rules shared by rollback and release (reverse order, every undo attempted, stop at
a sticky code, an interrupt re-raised only after the books are straight), the idempotent
release, the frozen status snapshot and the finalizer for forgotten registrations.
"""

from __future__ import annotations

import threading
import time
import warnings
import weakref

import attrs

from hicache.effects._interrupts import deferred_interrupts
from hicache.effects._cuda._ledger import PROCESS_LEDGER, HostLedger
from hicache.effects._cuda._runtime import HostRuntime
from hicache.errors import HostNotRegisteredError, ReleaseError, StickyCudaError


@attrs.frozen
class RegisteredRange:
    """One successful ``cudaHostRegister``: which buffer, which chunk, where."""

    buffer: str
    index: int
    ptr: int
    size: int


@attrs.frozen
class RegistrationStatus:
    """A frozen snapshot of a `Registration`.

    ``state`` is ``"active"``, ``"released"`` or ``"leaked"`` (a release left ranges
    registered: ``leaked`` lists them as ``(ptr, size)``).
    """

    state: str
    ranges: tuple[RegisteredRange, ...]
    registered_bytes: int
    call_count: int
    retries: int
    register_seconds: float
    register_gbps: float
    release_seconds: float | None
    leaked: tuple[tuple[int, int], ...]


class _State:
    """Everything release needs, kept apart from `Registration` so its finalizer can run."""

    def __init__(self, runtime, ledger, entries, spans, retries, seconds) -> None:
        self.lock = threading.Lock()
        self.runtime = runtime
        self.ledger = ledger
        self.entries: list[RegisteredRange] = entries
        self.spans = spans  # ledger claims: (ptr, size) per buffer
        self.retries = retries
        self.register_seconds = seconds
        self.registered_bytes = sum(e.size for e in entries)
        self.state = "active"
        self.leaked: tuple[tuple[int, int], ...] = ()
        self.release_seconds: float | None = None


def _undo(runtime, entries, uncertain=None, undone: list | None = None):
    """Unregister ``entries`` in reverse order, attempting every one.

    Returns ``(leaked, unknown, interrupt)``: ranges certainly still registered; the
    interrupted in-flight range (``uncertain``) when its fate cannot be known; and a
    KeyboardInterrupt/SystemExit that arrived meanwhile, for the caller to re-raise once the
    books are straight. A sticky error poisons the context: nothing after it can succeed, so
    the rest is reported without further calls. Any other failure leaves that range counted as
    registered and moves on. A 713 (not registered) means the range is not pinned: undone.
    ``uncertain`` - a register call an interrupt cut short - is undone first. ``undone``: a list
    that gets every entry CUDA really unregistered (an interrupted call that had taken effect
    included), for a message that counts what was rolled back.
    """
    leaked: list[tuple[int, int]] = []
    unknown: list[tuple[int, int]] = []
    interrupt = None
    pending = list(reversed(entries))
    if uncertain is not None:
        pending.insert(0, uncertain)
    while pending:
        entry = pending.pop(0)
        bucket = unknown if entry is uncertain else leaked
        try:
            runtime.unregister(entry.ptr)
            if undone is not None:
                undone.append(entry)
        except HostNotRegisteredError:
            pass  # CUDA holds no registration there: nothing is pinned
        except StickyCudaError:
            bucket.append((entry.ptr, entry.size))
            leaked.extend((e.ptr, e.size) for e in pending)
            break
        except Exception:  # every undo is attempted; this range stays counted as held
            bucket.append((entry.ptr, entry.size))
        except BaseException as error:  # Ctrl-C mid-undo: finish the undo, then re-raise
            bucket.append((entry.ptr, entry.size))  # its outcome is unknown: assume pinned
            interrupt = interrupt or error
    return sorted(leaked), unknown, interrupt


def _release(state: _State) -> None:
    with state.lock, deferred_interrupts():  # a Ctrl-C waits until the books are straight
        if state.state == "released":
            return
        start = time.perf_counter()
        if state.state == "leaked":  # a second release retries what the first left (713: undone)
            still = set(state.leaked)
            leaked, _, interrupt = _undo(state.runtime, [e for e in state.entries if (e.ptr, e.size) in still])
            state.ledger.replace([ptr for ptr, _ in state.leaked], leaked)
        else:
            leaked, _, interrupt = _undo(state.runtime, state.entries)
            state.ledger.replace([ptr for ptr, _ in state.spans], leaked)
        state.release_seconds = time.perf_counter() - start
        state.leaked = tuple(leaked)
        state.state = "leaked" if leaked else "released"
        if interrupt is not None:
            raise interrupt
        if leaked:
            raise ReleaseError(_leak_message("release", state.leaked), leaked=state.leaked)


def _leak_message(what: str, leaked) -> str:
    shown = ", ".join(f"(0x{p:x}, {s})" for p, s in leaked[:8])
    more = f" and {len(leaked) - 8} more" if len(leaked) > 8 else ""
    return (
        f"{what} left {len(leaked)} range(s) registered: {shown}{more}; the memory behind "
        "them must not be unmapped or freed"
    )


def _finalize(state: _State) -> None:
    if state.state != "active":
        return
    try:
        _release(state)  # first: a warning turned into an error must not skip it
    except ReleaseError as error:
        warnings.warn(str(error), ResourceWarning, stacklevel=2)
    warnings.warn(
        f"a Registration of {state.registered_bytes} bytes in {len(state.entries)} call(s) "
        "was garbage-collected without release(); released it",
        ResourceWarning,
        stacklevel=2,
    )


class Registration:
    """Host memory registered by `apply_plan` / `apply_pool_plan`; release it when done.

    A context manager. `release()` attempts every unregister, is idempotent, and raises
    `ReleaseError` (``.leaked``) when some range stays registered; calling it again retries
    those (a range CUDA no longer holds, 713, counts as undone). A registration that is
    garbage-collected unreleased is released by a finalizer, with a `ResourceWarning`.
    """

    def __init__(self, state: _State) -> None:
        self._state = state
        self._finalizer = weakref.finalize(self, _finalize, state)

    def _owner_releases(self, owned: bool = True) -> "Registration":
        """``owned``: its owner (a bring-up's handle, a progressive registration) releases it, in the
        owner's order - at the interpreter's exit too: weakref runs every finalizer still pending
        there, newest first, so this one would unregister ahead of its owner, before the owner
        stops the threads that still register. Collected while active, it is still released by its
        own finalizer. False: no owner any more (a handle's `detach`) - its own covers the exit."""
        self._finalizer.atexit = not owned
        return self

    def __enter__(self) -> "Registration":
        return self

    def __exit__(self, *exc_info) -> None:
        self.release()

    def release(self) -> None:
        """Unregister every range (in reverse); safe to call twice."""
        _release(self._state)

    @property
    def leaked(self) -> tuple[tuple[int, int], ...]:
        """``(ptr, size)`` a release could not unregister (empty unless ``state == "leaked"``)."""
        return self._state.leaked

    @property
    def ranges(self) -> tuple[RegisteredRange, ...]:
        """The registered ranges, in the order they were registered."""
        return tuple(self._state.entries)

    def status(self) -> RegistrationStatus:
        """A frozen snapshot: state, ranges, bytes, calls, timings, GB/s, leaks."""
        state = self._state
        seconds = state.register_seconds
        return RegistrationStatus(
            state=state.state,
            ranges=tuple(state.entries),
            registered_bytes=state.registered_bytes,
            call_count=len(state.entries),
            retries=state.retries,
            register_seconds=seconds,
            register_gbps=state.registered_bytes / seconds / 1e9 if seconds > 0 else 0.0,
            release_seconds=state.release_seconds,
            leaked=state.leaked,
        )

    def __repr__(self) -> str:
        s = self._state
        return f"<Registration {s.state}: {s.registered_bytes} bytes in {len(s.entries)} call(s)>"


def unregister_ranges(runtime: HostRuntime, ranges, *, ledger: HostLedger | None = None) -> list[tuple[int, int]]:
    """Unregister ``(ptr, size)`` ranges in reverse order with the executor's undo rules.

    For ranges registered outside a `Registration` (records kept elsewhere, e.g. on an SGLang
    tensor). Attempts every one, stops at a sticky error; returns those still registered. What
    was unregistered is no longer held in ``ledger`` (default: this process's), so the same
    memory can be registered again; what leaked stays held.
    """
    ledger = PROCESS_LEDGER if ledger is None else ledger
    entries = [RegisteredRange("range", i, int(ptr), int(size)) for i, (ptr, size) in enumerate(ranges)]
    leaked, _, interrupt = _undo(runtime, entries)  # an interrupt comes back as a value
    still = set(leaked)
    ledger.forget([(e.ptr, e.size) for e in entries if (e.ptr, e.size) not in still])
    if interrupt is not None:
        raise interrupt
    order = {(e.ptr, e.size): e.index for e in entries}
    return sorted(leaked, key=lambda pair: order[pair])
