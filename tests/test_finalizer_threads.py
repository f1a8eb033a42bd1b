"""A finalizer that hands its work to a thread, where no thread can start.

Two finalizers start threads: a `HostPools` handle collected on one of hicache's own threads
releases from a thread of its own (joining its threads from there would wait forever), and a
budget give-back that another process's lock holds up waits for it on a thread. Python 3.12
refuses new threads once the interpreter runs its atexit handlers (weakref's, which runs
finalizers left at exit, among them), and any Python refuses
them when the process is out of threads; there, neither finalizer may raise into
"Exception ignored", hang, or lose what it gives back. The refusals are injected with Python
3.12's message and an out-of-threads one; a real interpreter's exit runs too (on 3.12 - the GPU
machine's Python - the code before printed 3.12's refusal there; 3.11 still starts the thread).
"""

from __future__ import annotations

import fcntl
import gc
import os
import subprocess
import sys
import threading
from pathlib import Path

import pytest
from machine import ROOMY

from hicache.effects import BudgetLock, HostLedger, HostSetup, HostTensorAllocator, bring_up
from hicache.plan import Limits, MHALayout, plan_pool
from hicache.testing import FakeRuntime

pytestmark = pytest.mark.concurrency  # threads and locks: `make test-loaded`

torch = pytest.importorskip("torch")
LAYOUT = MHALayout("page_first_direct", layer_num=2, head_num=2, head_dim=64, page_size=4, page_num=32, itemsize=2)
PLAN = plan_pool(LAYOUT, Limits(chunk_limit_bytes=64 * 1024))
#: What Python 3.12's threading says from its finalizers on, and any Python out of threads.
REFUSALS = ["can't create new thread at interpreter shutdown", "can't start new thread"]


@pytest.fixture
def hicache_threads(monkeypatch):
    """``hicache_threads(refusal)``: from then on every thread started is recorded (a list of
    them is returned), and those named ``hicache-*`` are refused with ``refusal``'s message
    (None: all start; the test's own collector thread always starts)."""
    real = threading.Thread.start

    def record(refusal=None):
        started = []

        def start(thread):
            started.append(thread)
            if refusal and thread.name.startswith("hicache-") and thread.name != "hicache-test-collector":
                raise RuntimeError(refusal)
            return real(thread)

        monkeypatch.setattr(threading.Thread, "start", start)
        return started

    return record


@pytest.fixture
def unraisable(monkeypatch):
    """What reached sys.unraisablehook ("Exception ignored in ..."), as a list."""
    import sys

    seen = []
    monkeypatch.setattr(sys, "unraisablehook", lambda report: seen.append(report.exc_value))
    return seen


def _other_process_holds(lock: BudgetLock) -> int:
    """Take the lock's file through a descriptor of its own (for flock, as another process would)."""
    lock.path.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(lock.path, os.O_RDWR | os.O_CREAT, 0o600)
    fcntl.flock(fd, fcntl.LOCK_EX)
    return fd


def _let_go(fd: int) -> None:
    fcntl.flock(fd, fcntl.LOCK_UN)
    os.close(fd)


def _claimed(directory) -> dict:
    with BudgetLock(directory) as lock:
        return lock._claimed()


def _budgeted(directory, nbytes: int) -> BudgetLock:
    lock = BudgetLock(directory)
    with lock:
        lock.record(nbytes)
    return lock


def test_a_give_back_held_up_by_another_process_is_applied_by_a_thread_once_it_lets_go(tmp_path, hicache_threads):
    """forget_soon(wait=False) returns at once while another process holds the lock, and a
    thread of its own applies it once that process lets go (the path the refusal falls back from)."""
    lock = _budgeted(tmp_path, 100)
    started = hicache_threads()
    fd = _other_process_holds(lock)
    try:
        lock.forget_soon(40, wait=False)  # a finalizer's: never waits
        waiter, = started
        assert waiter.name == "hicache-budget-forget"
    finally:
        _let_go(fd)
    waiter.join(30)
    assert not waiter.is_alive()
    assert _claimed(tmp_path) == {os.getpid(): 60}


@pytest.mark.parametrize("message", REFUSALS)
def test_a_give_back_with_no_thread_to_wait_stays_queued_for_the_next_holder(tmp_path, hicache_threads,
                                                                              unraisable, message):
    """Where no thread can start, forget_soon(wait=False) neither raises nor waits: the bytes stay
    queued and the next holder in this process applies them, once (a process that exits instead
    leaves an entry the ledger prunes as dead)."""
    lock = _budgeted(tmp_path, 100)
    started = hicache_threads(message)
    fd = _other_process_holds(lock)
    try:
        lock.forget_soon(40, wait=False)
    finally:
        _let_go(fd)
    assert [t.name for t in started] == ["hicache-budget-forget"] and unraisable == []
    assert _claimed(tmp_path) == {os.getpid(): 60}  # applied as this process took the lock again
    assert _claimed(tmp_path) == {os.getpid(): 60}  # and only once


def _handle(tmp_path, runtime, ledger):
    return bring_up(PLAN, host=HostSetup(runtime=runtime, machine=ROOMY, lock=BudgetLock(tmp_path), ledger=ledger,
                                         allocator=HostTensorAllocator()))


def _drop_on_a_hicache_thread(handles: list) -> None:
    """Drop the last reference on a thread named as hicache's own are (its finalizer runs there)."""
    collector = threading.Thread(target=lambda: (handles.clear(), gc.collect()), name="hicache-test-collector")
    collector.start()
    collector.join(30)
    assert not collector.is_alive()


def test_a_handle_collected_on_a_hicache_thread_is_released_from_a_thread_of_its_own(tmp_path, hicache_threads,
                                                                                       recwarn):
    """The fallback's normal path: released on a "hicache-release" thread, with the warning."""
    runtime, ledger = FakeRuntime(), HostLedger()
    handles = [_handle(tmp_path, runtime, ledger)]
    assert runtime.held()
    started = hicache_threads()
    _drop_on_a_hicache_thread(handles)
    releasers = [t for t in started if t.name == "hicache-release"]
    assert len(releasers) == 1
    releasers[0].join(30)
    assert not releasers[0].is_alive()
    assert runtime.held() == set() and ledger.held() == ()
    assert _claimed(tmp_path) == {}
    assert any("garbage-collected without release" in str(w.message) for w in recwarn.list)


@pytest.mark.parametrize("message", REFUSALS)
def test_a_handle_collected_where_no_thread_can_start_stays_held_and_says_so(tmp_path, hicache_threads,
                                                                           unraisable, recwarn, monkeypatch, message):
    """Where no thread can start, the finalizer raises nothing and never releases on the thread it
    runs in (that could wait on itself forever): the memory stays registered and mapped - safe,
    as the dying process gives it back - whole (nothing of it goes alone: a release of what was
    kept still ends clean), and a ResourceWarning says why."""
    import sys

    kept = []
    monkeypatch.setattr("hicache.effects._bringup._handle._KEPT", kept)
    runtime, ledger = FakeRuntime(), HostLedger()
    handles = [_handle(tmp_path, runtime, ledger)]
    held = runtime.held()
    allocator = handles[0].allocator
    started = hicache_threads(message)
    _drop_on_a_hicache_thread(handles)
    assert unraisable == [] and "hicache-release" in [t.name for t in started]
    assert runtime.held() == held and sum(size for _, size in ledger.held()) == sum(size for _, size in held)
    assert allocator.owned() and all(not b.freed for b in allocator.owned())  # CUDA pins it: never unmapped
    said = [str(w.message) for w in recwarn.list if issubclass(w.category, ResourceWarning)]
    assert any("not released" in s and "no thread could start" in s for s in said), said
    books, = kept
    sys.modules["hicache.effects._bringup._handle"]._release(books)
    assert runtime.held() == set() and ledger.held() == () and _claimed(tmp_path) == {}


_EXIT_CHILD = r"""
import fcntl, os, sys, warnings
from pathlib import Path
sys.path.insert(0, {tests!r})
warnings.simplefilter("ignore", ResourceWarning)  # the dropped handle's finalizer says so
from machine import ROOMY
from hicache.effects import BudgetLock, HostLedger, HostSetup, HostTensorAllocator, bring_up
from hicache.plan import Limits, MHALayout, plan_pool
from hicache.testing import FakeRuntime

directory = Path({directory!r})
layout = MHALayout("page_first_direct", layer_num=2, head_num=2, head_dim=64, page_size=4, page_num=32, itemsize=2)
handle = bring_up(plan_pool(layout, Limits(chunk_limit_bytes=64 * 1024)),
                  host=HostSetup(runtime=FakeRuntime(), machine=ROOMY, lock=BudgetLock(directory),
                                 ledger=HostLedger(), allocator=HostTensorAllocator()))
fd = os.open(BudgetLock(directory).path, os.O_RDWR)
fcntl.flock(fd, fcntl.LOCK_EX)  # held to the end, as another process would hold it
print("up", flush=True)
# the handle is still referenced: its finalizer runs as the interpreter exits
"""


def test_a_handle_left_to_the_interpreters_exit_releases_without_a_traceback(tmp_path):
    """A real exit: a handle still referenced when the interpreter ends is released by its
    finalizer while another holder keeps the budget lock - exit 0, no traceback (Python 3.12
    refuses the give-back's thread there: the code before printed "can't create new thread at
    interpreter shutdown")."""
    code = _EXIT_CHILD.format(tests=str(Path(__file__).parent), directory=str(tmp_path))
    child = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                           cwd=Path(__file__).parents[1])
    assert child.returncode == 0 and child.stdout.split() == ["up"], child.stderr[-3000:]
    assert "Traceback" not in child.stderr and "Exception ignored" not in child.stderr, child.stderr[-3000:]
