"""The budget lock's own books: a nested hold lets go at the outermost exit only; no descriptor
outlives a hold, a refusal or a timeout; the waiter's reports and deadline on an injected clock;
forgets queued (never waited for) while this process holds the file, applied when it lets go;
a resident update taken only when the file is free; another user's process counts as alive;
a torn file reads as no claims; the files are 0600; who holds it, as a waiter is told."""

from __future__ import annotations

import contextlib
import errno
import json
import logging
import os
import stat
import subprocess
import sys
import threading

import pytest
from test_store_creators import _descriptors_of

from hicache.errors import LockTimeoutError, RegistrationStateError

pytestmark = pytest.mark.concurrency  # processes, threads or waits: `make test-loaded`

_HOLD_UNTIL_TOLD = (
    "import sys; from pathlib import Path; from hicache.effects._hostwide._lock import budget_lock\n"
    "with budget_lock(directory=Path(sys.argv[1])):\n"
    "    print('held', flush=True); sys.stdin.read()\n"
)


def _lock_module():
    return sys.modules["hicache.effects._hostwide._lock"]


@pytest.fixture
def directory(tmp_path):
    """A private lock directory (mode 0700, as the lock requires)."""
    import hicache.effects.admission  # noqa: F401 - loads the lock's module

    tmp_path.chmod(0o700)
    return tmp_path


@contextlib.contextmanager
def _held_elsewhere(directory):
    """Another process holds the lock until the block ends."""
    holder = subprocess.Popen([sys.executable, "-c", _HOLD_UNTIL_TOLD, str(directory)], stdin=subprocess.PIPE,
                              stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "held"
        yield holder
    finally:
        holder.communicate(timeout=60)  # its stdin closed: it lets go and ends


def _mine(directory) -> tuple[int, int] | None:
    """This process's (claimed, resident) as the file says, read under the lock."""
    with _lock_module().BudgetLock(directory) as lock:
        entry = lock.claims().get(os.getpid())
    return None if entry is None else (entry.claimed, entry.resident)


def test_a_nested_hold_lets_go_at_the_outermost_exit_only(directory):
    """``with lock:`` inside ``with lock:`` (teardown in a block an interrupt cut short) gives
    the same object and keeps the file held when it ends; the outer exit lets go, and a plain
    hold lets go at its exit."""
    BudgetLock = _lock_module().BudgetLock
    lock, other = BudgetLock(directory), BudgetLock(directory)
    with lock as outer:
        with lock as inner:
            assert inner is outer is lock
        assert lock.held and not other._try_enter()
    assert not lock.held and other._try_enter()
    other.release_all()
    with lock:
        pass
    assert not lock.held and other._try_enter()
    other.release_all()
    assert _descriptors_of(str(lock.path)) == 0


def test_no_descriptor_outlives_a_hold_a_refused_try_or_a_timeout(directory):
    """The lock file's descriptors: none left after a hold, after a try while another process
    holds it, or after a wait that timed out - a leaked one would hold the host-wide lock for
    the life of the process once it was taken."""
    BudgetLock = _lock_module().BudgetLock
    path = str(directory / "budget.lock")
    with BudgetLock(directory):
        pass
    assert _descriptors_of(path) == 0
    with _held_elsewhere(directory):
        assert not BudgetLock(directory)._try_enter()
        assert _descriptors_of(path) == 0
        now = [0.0]
        waiter = BudgetLock(directory, timeout_s=1.0, clock=lambda: now[0], sleep=lambda s: now.__setitem__(0, now[0] + s))
        with pytest.raises(LockTimeoutError):
            waiter.__enter__()
        assert _descriptors_of(path) == 0 and not waiter.held


def test_an_interrupt_after_the_flock_lets_the_lock_go(directory, monkeypatch):
    """A Ctrl-C landing after the file was taken but before the enter returned (here: while it
    records who holds it) comes out of the enter with the lock let go and its descriptor closed -
    else the host-wide lock stayed held for the life of the process."""
    module = _lock_module()

    def interrupted(self):
        raise KeyboardInterrupt

    monkeypatch.setattr(module.BudgetLock, "_say_holder", interrupted)
    lock = module.BudgetLock(directory)
    with pytest.raises(KeyboardInterrupt):
        lock.__enter__()
    assert not lock.held and _descriptors_of(str(lock.path)) == 0
    monkeypatch.undo()
    again = module.BudgetLock(directory)
    assert again._try_enter()
    again.release_all()


def test_a_flock_failing_otherwise_than_busy_is_raised_and_its_descriptor_closed(directory, monkeypatch):
    """``flock`` failing with anything but "held elsewhere" (ENOLCK here) is no wait: the error
    comes out of the enter and out of a try, and neither keeps the descriptor."""
    module = _lock_module()

    def no_locks(fd, operation):
        raise OSError(errno.ENOLCK, "No locks available")

    monkeypatch.setattr(module.fcntl, "flock", no_locks)
    lock = module.BudgetLock(directory)
    for call in (lock.__enter__, lock._try_enter):
        with pytest.raises(OSError, match="No locks available"):
            call()
        assert _descriptors_of(str(lock.path)) == 0 and not lock.held


def test_a_waiter_reports_each_period_after_the_first_and_times_out_past_the_deadline(directory, caplog):
    """On an injected clock that each poll's sleep moves on by a whole second: the first report
    comes one period after the wait began (none at once), then one each period; a timeout of 3 s
    raises at the first poll past it (4 s), not at it."""
    module = _lock_module()
    now = [100.0]
    reported = []

    class Stamp(logging.Handler):
        def emit(self, record):
            reported.append((now[0] - 100.0, record.getMessage().split(" for ")[0]))

    handler = Stamp(level=logging.WARNING)
    logging.getLogger(module.__name__).addHandler(handler)
    try:
        with _held_elsewhere(directory):
            lock = module.BudgetLock(directory, timeout_s=3.0, report_every_s=1.0, clock=lambda: now[0],
                                     sleep=lambda s: now.__setitem__(0, now[0] + 1.0))
            with pytest.raises(LockTimeoutError, match="timed out after 3 s"):
                lock.__enter__()
    finally:
        logging.getLogger(module.__name__).removeHandler(handler)
    assert reported == [(t, f"waiting {t:.0f} s") for t in (1.0, 2.0, 3.0)] and now[0] - 100.0 == 4.0


def test_using_the_books_outside_a_hold_is_refused(directory):
    """Reading or writing the claims without holding the file would race every other rank:
    RegistrationStateError, and the file is unchanged."""
    lock = _lock_module().BudgetLock(directory)
    for call in (lock.peers, lock.claims, lock.pending_bytes, lambda: lock.record(5), lambda: lock.forget(5)):
        with pytest.raises(RegistrationStateError, match="outside its with-block"):
            call()
    assert not (directory / "budget.lock").exists() or (directory / "budget.lock").read_bytes() == b""


def test_claims_add_up_and_a_forget_down_to_nothing_drops_the_entry(directory):
    """Two records add their claimed and resident bytes; a forget takes off its bytes and the
    resident ones it names (all of them when it names none), never below zero; the last byte
    forgotten removes the entry, and a claim of nothing writes none (no zero entries kept)."""
    with _lock_module().BudgetLock(directory) as lock:
        lock.record(0)
        assert json.loads((directory / "budget.lock").read_bytes()) == {}
        lock.record(100, resident=30)
        lock.record(50, resident=10)
        assert lock.claims()[os.getpid()] == (150, 40)
        lock.forget(100, resident=10)
        assert lock.claims()[os.getpid()] == (50, 30)
        lock.forget(20)
        assert lock.claims()[os.getpid()] == (30, 10)
        lock.forget(10)
        assert lock.claims()[os.getpid()] == (20, 0)
        lock.forget(19, resident=0)
        assert lock.claims()[os.getpid()] == (1, 0)
        lock.forget(1, resident=1)
        assert os.getpid() not in lock.claims()
        lock.record(100, resident=100)
        lock.forget(50, resident=0)  # resident bytes never above what is left claimed
        assert lock.claims()[os.getpid()] == (50, 50)
        lock.forget(50)
    assert json.loads((directory / "budget.lock").read_bytes()) == {}


def test_forgets_while_this_process_holds_the_file_are_queued_and_applied_at_its_exit(directory):
    """A forget from another BudgetLock of this process while one holds the file never waits
    (a second flock from this process would wait for itself forever): it returns at once, the
    holder applies it as it lets go, and with no holder left the next forget applies at once.
    A forget through the holding object itself applies at once."""
    BudgetLock = _lock_module().BudgetLock
    with BudgetLock(directory) as lock:
        lock.record(300, resident=300)
    holder, finalizer = BudgetLock(directory), BudgetLock(directory)
    with holder:
        done = threading.Event()
        thread = threading.Thread(target=lambda: (finalizer.forget_soon(100), done.set()), daemon=True)
        thread.start()
        assert done.wait(60), "forget_soon waited on this process's own holder"
        assert holder.claims()[os.getpid()] == (300, 300)  # queued, not yet applied
        holder.forget_soon(50)
        assert holder.claims()[os.getpid()] == (250, 250)  # the holder's own: at once
    assert _mine(directory) == (150, 150)  # the queue, applied at the exit
    finalizer.forget_soon(100)
    assert _mine(directory) == (50, 50)


def test_a_finalizers_forget_takes_the_file_if_free_and_else_leaves_it_to_a_daemon(directory):
    """``forget_soon(wait=False)``: with the file free, applied before it returns; with another
    process holding it, it returns at once and a daemon thread applies it once the holder lets go."""
    BudgetLock = _lock_module().BudgetLock
    claim = {str(os.getpid()): {"claimed": 300, "resident": 300}}
    (directory / "budget.lock").write_text(json.dumps(claim))  # this process never held this lock yet
    BudgetLock(directory).forget_soon(100, wait=False)
    assert BudgetLock(directory).snapshot() == {os.getpid(): 200}  # read without taking the lock
    with _held_elsewhere(directory):
        BudgetLock(directory).forget_soon(100, wait=False)
    for thread in [t for t in threading.enumerate() if t.name == "hicache-budget-forget"]:
        thread.join(60)
    assert _mine(directory) == (100, 100)


def test_a_resident_update_is_taken_only_when_the_file_is_free_now(directory):
    """``try_add_resident`` (a faulting thread's): True and written when this object holds the
    file or it is free; False and nothing written when another process holds it, or another
    BudgetLock of this process does (never a wait)."""
    BudgetLock = _lock_module().BudgetLock
    with BudgetLock(directory) as lock:
        lock.record(1000)
        assert lock.try_add_resident(100) is True and lock.claims()[os.getpid()] == (1000, 100)
    assert BudgetLock(directory).try_add_resident(100) is True
    assert _mine(directory) == (1000, 200)
    with _held_elsewhere(directory):
        assert BudgetLock(directory).try_add_resident(100) is False
    with BudgetLock(directory):
        assert BudgetLock(directory).try_add_resident(100) is False
    assert _mine(directory) == (1000, 200)


def test_another_users_process_counts_as_alive(directory, monkeypatch):
    """A peer the kernel will not let us signal (another user's rank: EPERM) is alive: its claim
    stays counted - in peers, claims, the pending bytes and the lock-free snapshot - not pruned."""
    module = _lock_module()
    theirs = 4_000_000
    (directory / "budget.lock").write_text(json.dumps({str(theirs): {"claimed": 70, "resident": 20}}))
    real_kill = os.kill

    def kill(pid, signal):
        if pid == theirs:
            raise PermissionError(errno.EPERM, "Operation not permitted")
        return real_kill(pid, signal)

    monkeypatch.setattr(module.os, "kill", kill)
    lock = module.BudgetLock(directory)
    assert lock.snapshot() == {theirs: 70}
    with lock:
        assert lock.peers() == {theirs: 70} and lock.pending_bytes() == 50
        lock.record(5)
        assert set(lock.claims()) == {theirs, os.getpid()}


@pytest.mark.parametrize("torn", [b'{"12": {"claim', b"[1, 2]", b'{"x": 5}', b"\xff\xfe", b'{"12": {"resident": 1}}'])
def test_a_torn_or_foreign_file_reads_as_no_claims_and_is_rewritten_whole(directory, torn):
    """Claims the file cannot give (cut short, another shape, not text): no claims, with or
    without the lock, rather than a rank blocked; the next record writes a whole file."""
    lock = _lock_module().BudgetLock(directory)
    (directory / "budget.lock").write_bytes(torn)
    assert lock.snapshot() == {}
    with lock:
        assert lock.claims() == {}
        lock.record(10)
    assert json.loads((directory / "budget.lock").read_bytes()) == {str(os.getpid()): {"claimed": 10, "resident": 0}}


def test_the_lock_and_its_holder_record_are_private_files(directory):
    """The claims and the holder's record are 0600: other users may neither read who allocated
    nor write claims."""
    BudgetLock = _lock_module().BudgetLock
    with BudgetLock(directory):
        pass
    for name in ("budget.lock", "budget.lock.holder"):
        assert stat.S_IMODE(os.stat(directory / name).st_mode) == 0o600, name
    fresh = directory / "fresh"
    fresh.mkdir(mode=0o700)
    assert BudgetLock(fresh).try_add_resident(1) is True  # a faulting thread's try made the file
    assert stat.S_IMODE(os.stat(fresh / "budget.lock").st_mode) == 0o600


def test_who_holds_the_lock_as_a_waiter_is_told(directory):
    """The holder's record names a live pid and since when; a record of an exited pid says so;
    no record, or a torn one, says the holder left none."""
    lock = _lock_module().BudgetLock(directory)
    record = directory / "budget.lock.holder"
    record.write_text(json.dumps({"pid": os.getpid(), "since": 0}))
    assert lock.holder().startswith(f"held by pid {os.getpid()} since ")
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    record.write_text(json.dumps({"pid": int(dead.stdout), "since": 0}))
    assert lock.holder() == f"held (the last recorded holder, pid {int(dead.stdout)}, has exited)"
    for text in ('{"pid": 1', '{"since": 0}'):
        record.write_text(text)
        assert lock.holder() == "held by a process that left no record"
    record.unlink()
    assert lock.holder() == "held by a process that left no record"
