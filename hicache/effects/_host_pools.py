"""`HostPools`: what a bring-up holds (memory, registration, budget entry) and how it goes.

Owns the teardown order - unregister, then free, then drop the budget entry - and what a
failed undo means: memory CUDA may still pin is quarantined, never unmapped. The books live
apart from the handle so that a handle dropped while active is released by a finalizer in the
same order (its memory cannot be unmapped first: the finalizer holds it).
"""

from __future__ import annotations

import threading
import time
import warnings
import weakref

from hicache.effects._host_memory import quarantine
from hicache.effects._interrupts import deferred_interrupts
from hicache.errors import RegistrationStateError, ReleaseError, RollbackError


class _Books:
    """Everything teardown needs; referenced by the handle and by its finalizer."""

    def __init__(self, allocator, ledger, owns_memory: bool) -> None:
        self.lock = threading.Lock()
        self.allocator = allocator
        self.ledger = ledger
        self.owns_memory = owns_memory
        self.tensors: list = []
        self.registration = None
        self.budget = None  # (lock, bytes) while this process's budget entry holds them
        self.state = "bringing-up"
        self.leaked: tuple = ()  # (ptr, size) still registered after a failed undo
        self.release_s: float | None = None

    def quarantine(self) -> None:
        quarantine(*self.tensors, *_owned(self))

    def mark_leaked(self, leaked) -> None:
        """An undo failed and ``leaked`` ranges stay registered: keep the memory (CUDA still
        pins some of it: never unmap), say so, and drop the budget entry as a release would."""
        self.quarantine()
        self.tensors = []
        self.state, self.leaked = "leaked", tuple(leaked)
        self.forget_budget()

    def forget_budget(self) -> None:
        if self.budget is not None:
            lock, nbytes = self.budget
            with lock:
                lock.forget(nbytes)
            self.budget = None


def _owned(books: _Books) -> list:
    owned = getattr(books.allocator, "owned", None)
    return owned() if owned else []


def _release(books: _Books) -> None:
    with books.lock, deferred_interrupts():  # a Ctrl-C waits until the books are straight
        if books.state == "leaked":
            raise ReleaseError(
                f"{len(books.leaked)} range(s) stay registered; their memory is kept mapped",
                leaked=books.leaked,
            )
        if books.state == "released":
            return
        start = time.perf_counter()
        try:
            if books.registration is not None:
                books.registration.release()
        except ReleaseError as error:
            books.mark_leaked(error.leaked)
            raise
        books.tensors = []
        if books.owns_memory:
            try:
                books.allocator.free_all(ledger=books.ledger)
            except RegistrationStateError:  # a rollback left part of it registered
                books.quarantine()
        books.forget_budget()
        books.state = "released"
        books.release_s = time.perf_counter() - start


def _finalize(books: _Books) -> None:
    if books.state not in ("active", "bringing-up"):
        return
    if books.registration is None and not books.tensors and books.budget is None and not _owned(books):
        books.state = "released"  # dropped before it held anything: nothing to report
        return
    try:
        _release(books)  # first: a warning turned into an error must not skip it
    except ReleaseError as error:
        warnings.warn(str(error), ResourceWarning, stacklevel=2)
    warnings.warn("a HostPools handle was garbage-collected without release(); released it",
                  ResourceWarning, stacklevel=2)


class HostPools:
    """Host buffers brought up together: ``tensors`` (one per request, in order),
    ``registration`` (None when nothing is registered), ``plans`` (as registered),
    ``timings``, ``state`` (``bringing-up``, ``active``, ``released`` or ``leaked``).

    `release()` unregisters, then frees, then drops the budget entry; it is idempotent and
    raises `ReleaseError` when a range stays registered (that memory is quarantined). A
    handle garbage-collected while active is released the same way, with a ResourceWarning.
    """

    def __init__(self, requests, allocator, ledger, *, owns_memory: bool, nbytes) -> None:
        self.requests = tuple(requests)
        self.plans: list = []
        self.host_buffers: list = []  # the HostBuffers, when mapped without faulting
        self.timings: dict[str, float] = {}
        self._nbytes = tuple(nbytes)
        self._books = _Books(allocator, ledger, owns_memory)
        self._finalizer = weakref.finalize(self, _finalize, self._books)

    @property
    def tensors(self) -> list:
        return self._books.tensors

    @property
    def registration(self):
        return self._books.registration

    @registration.setter
    def registration(self, value) -> None:
        self._books.registration = value

    @property
    def allocator(self):
        return self._books.allocator

    @property
    def state(self) -> str:
        return self._books.state

    @property
    def leaked(self) -> tuple:
        return self._books.leaked

    @property
    def total_bytes(self) -> int:
        return sum(self._nbytes)

    def release(self) -> None:
        """Unregister, free, forget the budget; safe to call twice."""
        try:
            _release(self._books)
        finally:
            if self._books.release_s is not None:
                self.timings["release_s"] = self._books.release_s

    def detach(self):
        """Hand the registration over to the caller (who now releases it) and let the rest go
        without undoing anything: the budget entry is dropped, memory stays where it is.
        For helpers whose caller owns the tensors (compat.sglang). Returns the `Registration`
        (None when nothing was registered)."""
        books = self._books
        with deferred_interrupts(), books.lock:
            if books.state != "active":
                raise RegistrationStateError(f"cannot detach a HostPools handle that is {books.state}")
            registration, books.registration = books.registration, None
            books.tensors = []
            books.forget_budget()
            books.state = "released"
        return registration

    def _abort(self, error: BaseException) -> None:
        """Undo a bring-up that failed: memory the executor could not unregister is kept."""
        books = self._books
        rollback = error if isinstance(error, RollbackError) else error.__cause__
        if isinstance(rollback, RollbackError):
            with deferred_interrupts(), books.lock:
                books.mark_leaked(tuple(rollback.leaked) + tuple(getattr(rollback, "uncertain", ())))
            return
        self.release()

    def __enter__(self) -> "HostPools":
        return self

    def __exit__(self, *exc_info) -> None:
        self.release()

    def __repr__(self) -> str:
        return f"<HostPools {self.state}: {len(self.requests)} buffer(s), {self.total_bytes} bytes>"
