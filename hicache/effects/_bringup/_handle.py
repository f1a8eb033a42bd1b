"""`HostPools`: the one handle of a bring-up, in every mode, and its one teardown.

Owns what a bring-up holds - the memory, the budget entry, the registration (one transaction,
or the calls of a progressive one and its background pre-fault) - and the one release: stop
the threads, unregister newest first, free, then give the budget back. What a failed or
interrupted undo means is written here once: memory CUDA may still pin is quarantined, never
unmapped, and `state`/`leaked` say exactly what stays registered; releasing again retries it.
The books live apart from the handle (and never leave this module) so that a handle dropped
while active is released by a finalizer in the same order - one that never waits on the
budget lock (`BudgetLock.forget_soon`) nor joins the thread it runs in.
"""

from __future__ import annotations

import threading
import time
import warnings
import weakref

from hicache.effects._cuda._registration import Registration, _leak_message
from hicache.effects._hostwide._turnstile import wait_histogram
from hicache.effects._host._memory import quarantine, unquarantine
from hicache.effects._host._tiers import buffer_tiers, read_smaps
import hicache.effects._trace as _trace
from hicache.effects._interrupts import deferred_interrupts, start_daemon
from hicache.effects._bringup import _report
from hicache.errors import RegistrationStateError, ReleaseError, RollbackError

class _Books:
    """Everything teardown needs; referenced by the handle and by its finalizer."""

    def __init__(self, allocator, ledger, owns_memory: bool) -> None:
        self.lock = threading.Lock()
        self.allocator = allocator
        self.ledger = ledger
        self.owns_memory = owns_memory
        self.tensors: list = []
        self.registration: Registration | None = None  # the blocking or pipelined transaction
        self.progressive = None  # the progressive mode's ProgressiveRegistration
        self.faulting = None  # its background pre-fault (ProgressiveFaulting)
        self.claim = None  # the bring-up's `Claim` on the host's memory (`_hostwide._claim`), until given back
        self.state = "bringing-up"
        self.leaked: tuple = ()  # (ptr, size) still registered after a failed undo
        self.orphans: tuple = ()  # leaked by a rollback: no Registration left to retry them
        self.quarantined: list = []
        self.release_s: float | None = None

    def owned(self) -> list:
        return self.allocator.owned()

    def holds_anything(self) -> bool:
        return bool(self.registration is not None or self.progressive is not None or self.tensors
                    or (self.claim is not None and not self.claim.closed) or self.owned())

    def stop(self) -> None:
        """End the background threads (registration after its call in flight, pre-fault after
        its calls in flight): nothing may register or fault while memory is let go. A Ctrl-C
        while waiting is re-raised with everything still held."""
        try:
            if self.progressive is not None:
                self.progressive.stop()
        finally:
            if self.faulting is not None:
                self.faulting.stop()

    def forget_budget(self, *, wait: bool = True, failed: bool = False) -> None:
        """Give the claim back with the resident bytes it counted (idempotent; ``wait=False``,
        a finalizer's, never waits for the lock; ``failed``: the bring-up failed - a server's
        scope hears it was not admitted after all)."""
        if self.claim is not None:
            (self.claim.abandon if failed else self.claim.release)(wait=wait)

    def keep_mapped(self) -> None:
        """Some of the memory stays registered: keep all of it mapped until the process exits."""
        if not self.quarantined:
            self.quarantined = [*self.tensors, *self.owned()]
            quarantine(*self.quarantined)


def _unregister(books: _Books) -> tuple[list, BaseException | None]:
    """Unregister everything registered, newest first; returns what stays registered and an
    interrupt raised meanwhile (by the runtime too), for after the books are straight."""
    leaked: list = []
    interrupt = None
    for holder in (books.progressive, books.registration):
        if holder is None:
            continue
        try:
            holder.release()  # idempotent; a second call retries what stayed registered
        except ReleaseError as error:
            leaked.extend(error.leaked)
        except BaseException as error:  # an interrupt from inside the runtime: its books are kept
            interrupt = interrupt or error
            leaked.extend(holder.leaked)
    return sorted(set(leaked) | set(books.orphans)), interrupt


def _release(books: _Books, *, finalizing: bool = False, failed: bool = False, before_free=None) -> None:
    """The one teardown: stop the threads, unregister, (``before_free()``,) free, give the budget back."""
    with books.lock, deferred_interrupts():  # a Ctrl-C waits until the books are straight
        if books.state == "released":
            return
        start = time.perf_counter()
        books.stop()
        leaked, interrupt = _unregister(books)
        if leaked:
            books.keep_mapped()
            books.state, books.leaked = "leaked", tuple(leaked)
            books.forget_budget(wait=not finalizing, failed=failed)  # the handle no longer counts as a pool
            if interrupt is not None:
                raise interrupt
            raise ReleaseError(_leak_message("release", books.leaked) + " (release again to retry)", leaked=books.leaked)
        books.tensors = []
        try:
            if before_free is not None:  # the owner's views go now: the free below can give pages back at once
                before_free()
        finally:
            if books.owns_memory:
                try:
                    books.allocator.free_all(ledger=books.ledger)
                except RegistrationStateError:  # part of it is still registered elsewhere
                    books.keep_mapped()
        if books.quarantined and not books.owned():  # an earlier leak was undone after all
            unquarantine(*books.quarantined)
            books.quarantined = []
        books.forget_budget(wait=not finalizing, failed=failed)
        books.registration = books.progressive = books.faulting = None
        books.state, books.leaked, books.orphans = "released", (), ()
        books.release_s = time.perf_counter() - start
        if interrupt is not None:
            raise interrupt


#: Books a finalizer could not release (no thread could start to do it): held to the process's end.
_KEPT: list[_Books] = []


def _finalize(books: _Books) -> None:
    if books.state not in ("active", "bringing-up"):
        return
    if not books.holds_anything():
        books.state = "released"  # dropped before it held anything: nothing to report
        return
    if threading.current_thread().name.startswith("hicache-"):
        # collected in one of its own threads (or another hicache worker): joining them from
        # here would wait forever - release from a thread of its own instead
        if not start_daemon(_release_quietly, books, name="hicache-release"):
            # none can start (the interpreter is exiting, or out of threads): it stays held - the
            # process gives it back as it ends - rather than a release that may wait on itself;
            # kept referenced, so that no part of it (its registration's own finalizer) goes alone
            _KEPT.append(books)
            warnings.warn("a HostPools handle was garbage-collected without release() on one of hicache's threads, "
                          "where no thread could start to release it: not released (its memory and registration "
                          "stay until the process exits)", ResourceWarning, stacklevel=2)
            return
    else:
        _release_quietly(books)
    warnings.warn("a HostPools handle was garbage-collected without release(); released it",
                  ResourceWarning, stacklevel=2)


def _release_quietly(books: _Books) -> None:
    try:
        _release(books, finalizing=True)  # first: a warning turned into an error must not skip it
    except ReleaseError as error:
        warnings.warn(str(error), ResourceWarning, stacklevel=2)


class HostPools:
    """Host buffers brought up together, in any mode (see `bring_up`): ``tensors`` (one per
    request, in order), ``registration`` (the transaction's `Registration`; None when nothing
    is registered or the mode is progressive), ``plans`` (as registered), ``timings``,
    ``state`` (``bringing-up``, ``active``, ``released`` or ``leaked``) and ``leaked`` (the
    ``(ptr, size)`` ranges that stay registered).

    `release()` stops the background threads, unregisters newest first, frees, then gives
    the budget back; it is idempotent, raises `ReleaseError` when a range stays registered
    (that memory is kept mapped) and, called again, retries it. A handle garbage-collected
    while active is released the same way, with a ResourceWarning.
    """

    def __init__(self, requests, allocator, ledger, *, owns_memory: bool, nbytes, mode: str = "blocking",
                 report=None) -> None:
        self.requests = tuple(requests)
        self.mode = mode
        self.report = report  # how the metrics show it (`_report.Report`; None: not shown)
        self.plans: list = []
        self.host_buffers: list = []  # the HostBuffers, when mapped without faulting
        self.timings: dict[str, float] = {}
        self._first_call: list = []  # progressive: seconds to the first registered call, once made
        self._nbytes = tuple(nbytes)
        self._books = _Books(allocator, ledger, owns_memory)
        self.thp = None  # hugepages="auto": the `ThpAuto` that decided each pre-fault piece's page size
        self._finalizer = weakref.finalize(self, _finalize, self._books)

    # -- what the bring-up records (hicache.effects._bringup._bring_up only) -----------------
    def _hold_budget(self, claim) -> None:
        """The bring-up's admitted `Claim`, given back with the handle's memory."""
        self._books.claim = claim

    def _hold_registration(self, registration) -> None:
        self._books.registration = registration._owner_releases()  # released in the handle's order, at exit too

    def _hold_progressive(self, progressive, faulting) -> None:
        self._books.progressive, self._books.faulting = progressive, faulting

    def _activate(self) -> None:
        self._books.state = "active"

    def _abort(self, error: BaseException) -> None:
        """Undo a bring-up that failed; ranges its rollback could not undo stay counted."""
        books = self._books
        rollback = error if isinstance(error, RollbackError) else error.__cause__
        if isinstance(rollback, RollbackError):
            books.orphans = tuple(rollback.leaked) + tuple(rollback.uncertain)
        try:
            _release(books, failed=True)
        except ReleaseError as release:
            if not set(release.leaked) <= set(books.orphans):
                raise  # more stays registered than the bring-up's error says: this names it all
            # only what the rollback already reports stays registered: its error says so

    # -- what callers read ----------------------------------------------------------------
    @property
    def first_call_s(self) -> float | None:
        """Progressive: seconds from the start of the bring-up to its first registered call."""
        return self._first_call[0] if self._first_call else None

    @property
    def tensors(self) -> list:
        return self._books.tensors

    @property
    def registration(self) -> Registration | None:
        """The blocking or pipelined transaction; None when nothing is registered (map-only) or
        the mode is progressive."""
        return self._books.registration

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

    @property
    def calls(self) -> list:
        """Progressive: ``(chunk index, bytes, seconds)`` per call made so far; otherwise one
        entry per registered range."""
        progressive = self._books.progressive
        if progressive is not None:
            return list(progressive.calls)
        registration = self._books.registration
        if registration is None:
            return []
        return [(r.index, r.size, 0.0) for r in registration.ranges]

    def registered_ranges(self) -> tuple[tuple[int, int], ...]:
        """``(ptr, size)`` of every range this handle holds registered now, by address."""
        books = self._books
        held = list(books.orphans)
        registrations = list(books.progressive.registered()) if books.progressive is not None else []
        if books.registration is not None:
            registrations.append(books.registration)
        for registration in registrations:
            status = registration.status()
            if status.state == "active":
                held += [(r.ptr, r.size) for r in status.ranges]
            elif status.state == "leaked":
                held += status.leaked
        return tuple(sorted(held))

    def budget_claims(self) -> dict[int, int]:
        """This host's budget claims (pid -> bytes, this process's included) as the host-wide
        budget file says now; {} when this bring-up took no budget."""
        claim = self._books.claim
        snapshot = getattr(claim.lock, "snapshot", None) if claim is not None else None
        return snapshot() if snapshot is not None else {}

    @staticmethod
    def turnstile_waits() -> dict:
        """How long this process's register calls waited for their turn at the host's
        registration turnstile (every bring-up together): ``buckets`` of ``(upper bound,
        cumulative count)``, ``count``, ``sum`` seconds (`hicache_turnstile_wait_seconds`)."""
        return wait_histogram()

    def tiers(self, smaps_text: str | None = None) -> list:
        """``(buffer name, PageTiers)`` per buffer: the bytes the kernel backs with hugetlbfs
        pages, transparent huge pages and base pages right now (``/proc/self/smaps``) - the tier
        obtained, not the one asked for (a hugepage fallback is a 2-5x bring-up cliff).
        ``smaps_text``: one read of it shared by several handles (`read_smaps`; a scrape of many pools)."""
        return buffer_tiers(self.buffer_spans(), smaps_text)  # one read for every buffer

    def buffer_spans(self) -> list:
        """``(buffer name, ptr, bytes)`` of each buffer this handle holds."""
        return [(request.name, tensor.data_ptr(), tensor.numel() * tensor.element_size())
                for request, tensor in zip(self.requests, self.tensors)]

    def page_rules(self) -> tuple:
        """``(buffer name, rule, bytes)``: under ``hugepages="auto"``, which rule decided how many
        bytes of each buffer (`hicache.plan._thp.RULES`; "brake" names why in `thp_brake`); empty
        for any other mode."""
        if self.thp is None:
            return ()
        rules = self.thp.summary()["rules"]
        return tuple((self.requests[index].name, rule, nbytes) for index, counts in sorted(rules.items())
                     for rule, nbytes in sorted(counts.items()))

    @property
    def thp_brake(self) -> str | None:
        """Why ``hugepages="auto"`` turned THP off for the rest of this bring-up (None: it did not)."""
        return None if self.thp is None else self.thp.summary()["brake"]

    def record(self, *, tiers: bool = True, smaps_text: str | None = None):
        """This bring-up as a frozen `hicache._bringup_record.BringupRecord` (what the metrics show): state, bytes,
        calls, phase seconds, page tiers (``tiers=False``: not read) and the host's claims."""
        from hicache._bringup_record import make_record

        timings = dict(self.timings)
        faulting = self._books.faulting
        if faulting is not None:  # progressive: the background pre-fault so far, not up to the first call
            timings["prefault_s"] = faulting.faulter.elapsed() or None
        return make_record(
            state=self.state, total_bytes=self.total_bytes,
            registered_bytes=sum(size for _, size in self.registered_ranges()), calls=self.calls,
            timings=timings, allocator=self.allocator, progressive=self.mode == "progressive",
            tiers=self.tiers(smaps_text=smaps_text) if tiers else (), claims=self.budget_claims(),
            page_rules=self.page_rules(),
        )

    @staticmethod
    def read_smaps() -> str:
        """``/proc/self/smaps`` once, for `tiers` of several handles."""
        return read_smaps()

    def wait(self, timeout: float | None = None) -> bool:
        """True once everything is registered (at once unless progressive); False on timeout;
        raises the error that stopped a background registration."""
        progressive = self._books.progressive
        return True if progressive is None else progressive.wait(timeout)

    def stop(self) -> None:
        """Stop the background threads (progressive) and keep everything else held: what a pool
        does before waiting for copies in flight, then `release()`. Interruptible."""
        self._books.stop()

    def release(self, *, before_free=None) -> None:
        """Stop, unregister, free, give the budget back; safe to call twice (again after a
        `ReleaseError`: retries what stayed registered). ``before_free()``: called once every
        range is unregistered, just before the memory is freed, and only then - where a pool
        drops its own views of the buffers: memory another tensor still views is unmapped only
        with the last view, by one munmap, instead of given back in parallel pieces now."""
        try:
            with _trace.span("release", "phase", bytes=self.total_bytes):
                _release(self._books, before_free=before_free)
        finally:
            if self._books.release_s is not None:
                self.timings["release_s"] = self._books.release_s
            _trace.flush()
            if self._books.state == "released":
                _report.released(self.report, self)

    def detach(self):
        """Hand the registration over to the caller (who now releases it) and let the rest go
        without undoing anything: the budget entry is given back, memory stays where it is.
        For helpers whose caller owns the tensors (compat.sglang). Returns the `Registration`
        (None when nothing was registered)."""
        books = self._books
        snapshot = _report.before_detach(self.report, self) if books.state == "active" else None
        with deferred_interrupts(), books.lock:
            if books.state != "active" or books.progressive is not None:
                raise RegistrationStateError(f"cannot detach a {self.mode} HostPools handle that is {books.state}")
            registration, books.registration = books.registration, None
            if registration is not None:  # the caller's now: its own finalizer covers the exit again
                registration._owner_releases(False)
            books.tensors = []
            books.forget_budget()
            books.state = "released"
        _report.detached(self.report, registration, snapshot)
        return registration

    def __enter__(self) -> "HostPools":
        return self

    def __exit__(self, *exc_info) -> None:
        self.release()

    def __repr__(self) -> str:
        return f"<HostPools {self.mode} {self.state}: {len(self.requests)} buffer(s), {self.total_bytes} bytes>"
