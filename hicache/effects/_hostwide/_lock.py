"""A cross-process lock around "check the budget, claim", with the claims of who allocated.

Ranks on one host that start together otherwise each see the others' pools as used memory and
count them twice (sglang #38156). Each live process's claim records how many bytes it claimed
and how many of them are resident already (issue #35): a rank holds the lock only to decide -
sample the machine, take off what peers claimed but the kernel does not count yet (claimed -
resident), record its claim - and fills outside it, its pre-fault raising the claim's resident
count as it goes; so ranks fill side by side and the promise stays: a claim's pending bytes are
never counted by a peer as free. The lock file lives in a private runtime directory (mode 0700,
owned by us, not a symlink) and is opened without following symlinks. Claims are JSON
``{pid: {"claimed": n, "resident": r}}`` (a bare ``n``, the format before, reads as resident).

Giving budget back never waits on a holder in this process: `forget_soon` queues the bytes
while any `BudgetLock` of this process holds the file (each holds it through its own file
descriptor, so a second ``flock`` from this process would wait for the first forever - a pool
finalized by the garbage collector in the middle of the next pool's bring-up did), and the
holder applies the queue before it lets go. A queue rather than one shared re-entrant lock
object: the collector may run a finalizer in any thread, also one the holder is waiting for.

A waiting bring-up is never silent (issue #21): the holder writes its pid and since-when beside
the lock (``budget.lock.holder``), and a waiter logs who holds it every few seconds;
HICACHE_LOCK_TIMEOUT (seconds) turns a wait into a clean `LockTimeoutError` naming the holder.
"""

from __future__ import annotations

import errno
import fcntl
import json
import logging
import os
import threading
import time
from pathlib import Path
from typing import NamedTuple

from hicache.effects._hostwide._rundir import private_dir as _private_dir, runtime_dir
from hicache.plan.settings import env_value
from hicache.effects._interrupts import deferred_interrupts, start_daemon
from hicache.effects._trace import span
from hicache.errors import LockTimeoutError, RegistrationStateError

logger = logging.getLogger(__name__)

LOCK_TIMEOUT_ENV = "HICACHE_LOCK_TIMEOUT"
REPORT_EVERY_S = 5.0  # a waiting bring-up says who holds the lock this often
POLL_S = 0.05  # how often a waiting bring-up tries the lock again


def lock_timeout_s(env=None) -> float | None:
    """HICACHE_LOCK_TIMEOUT as seconds (None: unset, wait as long as it takes)."""
    return env_value(os.environ if env is None else env, LOCK_TIMEOUT_ENV)


#: Per lock file of this process: how many BudgetLocks hold it, and budget to give back once
#: one of them is done (guarded by _PROCESS; re-entrant, as a finalizer may run inside).
_PROCESS = threading.RLock()
_HOLDERS: dict[str, int] = {}
_PENDING: dict[str, list[tuple[int, int | None]]] = {}  # (bytes, of them resident) to forget


class _process_held:
    """``with _process_held():`` - `_PROCESS` taken with Ctrl-C held until it is let go. A
    KeyboardInterrupt landing at a plain ``with _PROCESS:`` can arrive after the acquire and
    before the block is set up, leaving the lock held by the main thread for good - and every
    faulting thread of the next bring-up then waits for it (the interrupt walk found it)."""

    def __enter__(self) -> None:
        self._held = deferred_interrupts()
        self._held.__enter__()
        _PROCESS.acquire()

    def __exit__(self, *exc_info) -> None:
        _PROCESS.release()
        self._held.__exit__(*exc_info)


class Entry(NamedTuple):
    """One process's entry in the claims file: bytes claimed, and how many are resident (its
    `_claim.Claim`s together)."""

    claimed: int
    resident: int = 0

    @property
    def pending(self) -> int:
        """Claimed bytes the kernel does not count as used yet (still to be faulted in)."""
        return max(0, self.claimed - self.resident)


def _claim(value) -> Entry:
    if isinstance(value, dict):
        claimed = int(value["claimed"])
        return Entry(claimed, min(claimed, max(0, int(value.get("resident", claimed)))))
    return Entry(int(value), int(value))  # the format before claims counted resident bytes


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


class BudgetLock:
    """Hold with ``with budget_lock() as lock:``; ``peers()`` lists live processes that
    allocated pools, ``record(nbytes)`` / ``forget()`` keep this process's entry."""

    def __init__(self, directory: Path | None = None, *, timeout_s: float | None = None,
                 report_every_s: float = REPORT_EVERY_S, clock=time.monotonic, sleep=time.sleep) -> None:
        self.path = _private_dir(directory or runtime_dir()) / "budget.lock"
        self.timeout_s = timeout_s
        self.report_every_s = report_every_s
        self._clock, self._sleep = clock, sleep  # the wait's time: injected by tests, never judged by seconds
        self._fd: int | None = None
        self._depth = 0  # re-entrant: teardown may run inside a with-block an interrupt cut short

    def reopen(self) -> "BudgetLock":
        """Another open file of the same lock (its own descriptor: a claim's faulting threads
        never share the admitting thread's, which an interrupt there may close under them)."""
        return type(self)(self.path.parent, timeout_s=self.timeout_s, report_every_s=self.report_every_s,
                          clock=self._clock, sleep=self._sleep)

    @property
    def held(self) -> bool:
        """True while this object holds the lock."""
        return self._fd is not None

    def __enter__(self) -> "BudgetLock":
        if self._fd is not None:
            self._depth += 1
            return self
        with span("budget lock wait", "lock", path=str(self.path)):
            return self._enter()

    def _enter(self) -> "BudgetLock":
        with deferred_interrupts():  # the descriptor is closed by the except below once it exists
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
        start = self._clock()
        deadline = None if self.timeout_s is None else start + self.timeout_s
        next_report = start + self.report_every_s
        try:
            while True:  # polled, not a blocking flock: a waiter reports who it waits for
                with deferred_interrupts():  # the flock and the record of who holds it, together:
                    if self._lock_now(fd):   # a Ctrl-C between them left the host's lock held by
                        break                # a descriptor nobody would ever close
                now = self._clock()
                if deadline is not None and now > deadline:
                    raise LockTimeoutError(
                        f"timed out after {self.timeout_s:g} s waiting for the host-wide budget lock {self.path}: "
                        f"{self.holder()}"
                    ) from None
                if now >= next_report:
                    logger.warning("waiting %.0f s for the host-wide budget lock %s: %s (%s sets a limit)",
                                   now - start, self.path, self.holder(), LOCK_TIMEOUT_ENV)
                    next_report = now + self.report_every_s
                self._sleep(POLL_S)
            self._say_holder()
            with _process_held():
                self._apply_pending()
        except BaseException:
            if self._fd == fd:
                self.release_all()  # let go of what this call took, a Ctrl-C included
            else:
                os.close(fd)
            raise
        return self

    def _lock_now(self, fd: int) -> bool:
        """Take the file's lock through ``fd`` if no other descriptor holds it, recording it as
        held (call with interrupts deferred); False when another holds it."""
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as error:
            if error.errno not in (errno.EWOULDBLOCK, errno.EAGAIN):
                raise
            return False
        with _process_held():
            self._fd, self._depth = fd, 1
            key = str(self.path)
            _HOLDERS[key] = _HOLDERS.get(key, 0) + 1
        return True

    @property
    def _holder_path(self) -> Path:
        return self.path.with_name(self.path.name + ".holder")

    def _say_holder(self) -> None:
        """Write who holds the lock now and since when (read by waiters; best effort)."""
        temporary = self._holder_path.with_name(f"{self._holder_path.name}.{os.getpid()}")
        try:
            with deferred_interrupts():  # a few bytes: written and closed before a Ctrl-C lands
                with os.fdopen(os.open(temporary, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW
                                       | os.O_CLOEXEC, 0o600), "w") as handle:
                    json.dump({"pid": os.getpid(), "since": time.time()}, handle)
                os.replace(temporary, self._holder_path)
        except OSError:  # a waiter then says the holder left no record; the lock itself is fine
            pass

    def holder(self) -> str:
        """Who holds the lock, as a waiter sees it: "held by pid N since HH:MM:SS (X s)"."""
        try:
            with open(self._holder_path) as handle:
                record = json.load(handle)
            pid, since = int(record["pid"]), float(record["since"])
        except (OSError, ValueError, KeyError, TypeError):
            return "held by a process that left no record"
        if not _alive(pid):
            return f"held (the last recorded holder, pid {pid}, has exited)"
        return (f"held by pid {pid} since {time.strftime('%H:%M:%S', time.localtime(since))} "
                f"({max(0.0, time.time() - since):.0f} s)")

    def __exit__(self, *exc_info) -> None:
        self._depth -= 1
        if self._depth <= 0:
            self.release_all()

    def release_all(self) -> None:
        """Let the lock go however deep it is held (after an interrupt skipped an ``__exit__``:
        CPython cannot promise ``__exit__`` runs when a KeyboardInterrupt lands at its call). A
        Ctrl-C meanwhile is held until the descriptor is closed: a descriptor dropped on the way
        would hold the host-wide lock for the life of the process."""
        with deferred_interrupts():
            with _PROCESS:
                if self._fd is None:
                    return
                try:
                    self._apply_pending()  # budget given back meanwhile by others of this process
                finally:
                    fd, self._fd, self._depth = self._fd, None, 0
                    key = str(self.path)
                    _HOLDERS[key] = _HOLDERS.get(key, 1) - 1
            try:
                fcntl.flock(fd, fcntl.LOCK_UN)
            finally:
                os.close(fd)

    def _apply_pending(self) -> None:
        pending = _PENDING.get(str(self.path))
        while pending:
            nbytes, resident = pending.pop()
            self.forget(nbytes, resident=resident)

    def forget_soon(self, nbytes: int, *, resident: int | None = None, wait: bool = True) -> None:
        """Give ``nbytes`` of this process's entry back without ever waiting on a holder in this
        process: while one holds the file the bytes are queued and it applies them before it
        lets go. Otherwise take the lock (``wait=False``, a finalizer's: only if it is free now;
        if another process holds it, a short-lived thread waits for it and applies the queue)."""
        key = str(self.path)
        with _process_held():
            if self.held:
                self.forget(nbytes, resident=resident)
                return
            if _HOLDERS.get(key, 0) > 0:
                _PENDING.setdefault(key, []).append((nbytes, resident))
                return
            if not wait:
                _PENDING.setdefault(key, []).append((nbytes, resident))
                if self._try_enter():
                    self.release_all()  # applied the queue
                    return
        if not wait:
            # no thread (the interpreter is exiting, or out of threads): the bytes stay queued for
            # this process's next holder; a process that ends first leaves an entry pruned as dead
            start_daemon(_drain, self.path.parent, name="hicache-budget-forget")
            return
        with self:
            self.forget(nbytes, resident=resident)

    def try_add_resident(self, nbytes: int) -> bool:
        """Raise this process's resident count by ``nbytes`` if the lock is free now (never
        waits: a faulting thread calls it, and a skipped update only keeps the claim's pending
        bytes counted a little longer - never too short). True when written."""
        with _process_held():  # one held region: a Ctrl-C held while the file was taken lands after it is let go
            if self.held:
                self.add_resident(nbytes)
                return True
            if _HOLDERS.get(str(self.path), 0) > 0 or not self._try_enter():
                return False
            try:
                self.add_resident(nbytes)
            finally:
                self.release_all()
        return True

    def _try_enter(self) -> bool:
        """Take the file now if no other process holds it (never waits; interrupts held while
        the descriptor and its lock are not yet recorded)."""
        with deferred_interrupts():
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
            try:
                taken = self._lock_now(fd)
            except BaseException:
                os.close(fd)
                raise
            if not taken:
                os.close(fd)
            return taken

    def _entries(self) -> dict[int, Entry]:
        if self._fd is None:
            raise RegistrationStateError("BudgetLock used outside its with-block")
        os.lseek(self._fd, 0, os.SEEK_SET)
        raw = b""
        while chunk := os.read(self._fd, 65536):
            raw += chunk
        try:
            data = json.loads(raw or b"{}")
            return {int(pid): _claim(value) for pid, value in data.items()}
        except (ValueError, AttributeError, KeyError, TypeError):
            return {}  # a torn or foreign file: start over rather than block every rank

    def _claimed(self) -> dict[int, int]:
        """pid -> bytes claimed, as the file says (dead processes too; what tests compare)."""
        return {pid: claim.claimed for pid, claim in self._entries().items()}

    def _live(self) -> dict[int, Entry]:
        return {p: c for p, c in self._entries().items() if _alive(p)}

    def _write(self, entries: dict) -> None:
        """``entries``: pid -> `Entry` (a bare byte count: a claim all resident, as before)."""
        claims = {p: c if isinstance(c, Entry) else _claim(c) for p, c in entries.items()}
        payload = json.dumps({str(p): {"claimed": c.claimed, "resident": c.resident}
                              for p, c in sorted(claims.items()) if c.claimed > 0}).encode()
        os.ftruncate(self._fd, 0)
        os.lseek(self._fd, 0, os.SEEK_SET)
        os.write(self._fd, payload)

    def snapshot(self) -> dict[int, int]:
        """Every live process's claim (pid -> bytes) as the file says now, read without taking
        the lock (for metrics: a torn read gives {} rather than a wait behind a bring-up)."""
        try:
            data = json.loads(self.path.read_bytes() or b"{}")
            return {int(pid): _claim(value).claimed for pid, value in data.items() if _alive(int(pid))}
        except (OSError, ValueError, AttributeError, TypeError, KeyError):
            return {}

    def peers(self) -> dict[int, int]:
        """Live other processes that allocated host pools: pid -> bytes claimed."""
        me = os.getpid()
        return {p: c.claimed for p, c in self._live().items() if p != me}

    def claims(self) -> dict[int, Entry]:
        """Every live process's claim, this one's included: pid -> `Entry`."""
        return self._live()

    def pending_bytes(self) -> int:
        """Bytes claimed on this host that the kernel does not count as used yet: what a sample
        of the machine's available memory still has to lose to the claims being filled."""
        return sum(claim.pending for claim in self._live().values())

    def record(self, nbytes: int, *, resident: int = 0) -> None:
        """Add a claim of ``nbytes`` (``resident`` of them already) to this process's entry
        (dead processes' entries are pruned: a rank killed mid-fill leaves no claim)."""
        entries = self._live()
        mine = entries.get(os.getpid(), Entry(0, 0))
        entries[os.getpid()] = Entry(mine.claimed + nbytes, mine.resident + min(resident, nbytes))
        self._write(entries)

    def add_resident(self, nbytes: int) -> None:
        """``nbytes`` more of this process's claim are resident now (never above the claim)."""
        entries = self._live()
        mine = entries.get(os.getpid())
        if mine is not None:
            entries[os.getpid()] = Entry(mine.claimed, min(mine.claimed, mine.resident + nbytes))
            self._write(entries)

    def forget(self, nbytes: int | None = None, *, resident: int | None = None) -> None:
        """Remove a claim of ``nbytes`` (None: all of this process's), ``resident`` of which
        were counted resident (None: all of them)."""
        entries = self._live()
        mine = entries.get(os.getpid(), Entry(0, 0))
        if nbytes is None:
            entries.pop(os.getpid(), None)
        else:
            gone = nbytes if resident is None else min(resident, nbytes)
            left = Entry(mine.claimed - nbytes, min(max(0, mine.resident - gone), max(0, mine.claimed - nbytes)))
            if left.claimed > 0:
                entries[os.getpid()] = left
            else:
                entries.pop(os.getpid(), None)
        self._write(entries)


def budget_lock(*, directory: Path | None = None, timeout_s: float | None = None, env=None) -> BudgetLock:
    """The host-wide budget lock (see `BudgetLock`); ``timeout_s`` defaults to
    HICACHE_LOCK_TIMEOUT (unset: wait as long as it takes, saying who holds it)."""
    return BudgetLock(directory, timeout_s=lock_timeout_s(env) if timeout_s is None else timeout_s)


def _drain(directory: Path) -> None:
    """Wait for the lock (another process holds it) and apply this process's queued forgets."""
    with BudgetLock(directory):
        pass
