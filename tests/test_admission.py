"""The plug-in's admission around SGLang's host-memory check (hicache.effects._bringup._admission,
issue #35): SGLang's own answer sampled under the host-wide budget lock against the machine less
the claims still filling; an admitted request claimed before the lock goes - and the lock free
at once; its claim paid off as its bytes become resident, dropped when all are (or when it
fails, or after HOLD_LIMIT_S); a refused or failed one claims nothing; re-entrant when wrapped
twice. Each law is seen from outside, as another rank sees it: whether the lock can be taken by
another open file now, and what the claims file says."""

from __future__ import annotations

import fcntl
import logging
import os
import threading
import time

import pytest
from machine import ROOMY

from hicache.effects import admission
from hicache.effects._bringup import _admission
from hicache.effects._host import _release
from hicache.effects import BudgetLock
from hicache.effects._hostwide._rundir import runtime_dir

pytestmark = pytest.mark.concurrency  # a timer thread drops an abandoned claim


def _held_by_someone() -> bool:
    """Whether the host-wide budget lock is held (by any open file, this process's included)."""
    fd = os.open(runtime_dir() / "budget.lock", os.O_RDWR | os.O_CREAT, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return True
    finally:
        os.close(fd)  # closing also drops the lock taken just now
    return False


def _pending() -> int:
    """What another rank would take off its sample now: the host's claims not yet resident."""
    with BudgetLock(runtime_dir(), timeout_s=60) as peer:  # a hang guard, were it held
        return peer.pending_bytes()


@pytest.fixture(autouse=True)
def _nothing_held_after():
    yield
    _admission.abandon()  # a failing test leaves no claim to the next
    assert not _held_by_someone() and _pending() == 0


def _sglang(allowance: int, seen: list | None = None):
    """SGLang's check, answering ``allowance``; records whether the lock was held while it sampled."""

    def check(requested_bytes, *, auto_size=False):
        if seen is not None:
            seen.append(_held_by_someone())
        return allowance

    return check


def test_sglangs_answer_is_sampled_under_the_lock_and_returned_as_is():
    """The lock is held while SGLang's check samples free memory, and its answer comes back."""
    seen = []
    assert _admission.host_memory_budget_bytes(_sglang(5000, seen), 0, auto_size=True) == 5000
    assert seen == [True] and not _held_by_someone() and _pending() == 0  # only asked: nothing claimed


@pytest.mark.parametrize("requested, allowance", [(4096, 4096), (4096, 10**9)])
def test_an_admitted_request_is_claimed_and_the_lock_goes_at_once(requested, allowance):
    """An exact fit is admitted too: the lock is free as soon as the check returns, the request
    counts as pending for every other rank until all its bytes are resident - not one byte before."""
    assert _admission.host_memory_budget_bytes(_sglang(allowance), requested) == allowance
    assert not _held_by_someone() and _pending() == requested
    _admission.resident(requested - 1)
    assert _pending() == requested
    _admission.resident(1)
    assert _pending() == 0


def test_requests_of_one_constructor_add_up_to_one_claim():
    """Pool after pool in one constructor: both requests are claimed; the claim goes when both
    are resident."""
    _admission.host_memory_budget_bytes(_sglang(10**9), 1000)
    _admission.host_memory_budget_bytes(_sglang(10**9), 500)
    assert _pending() == 1500
    _admission.resident(1000)
    assert _pending() == 1500
    _admission.resident(500)
    assert _pending() == 0


def test_the_sample_is_the_machine_less_the_claims_still_filling():
    """While SGLang's check samples, its own `available_host_memory_bytes` (wrapped) comes back
    less every pending claim on the host - a peer's too; outside a check it is SGLang's as is."""
    def machine(*, allow_cgroup_fallback=False):
        return 10_000

    with BudgetLock(runtime_dir()) as lock:  # a peer's claim, nothing of it resident yet
        lock._write({os.getppid(): {"claimed": 3000, "resident": 1000}})
    try:
        sampled = []

        def check(requested_bytes, *, auto_size=False):
            sampled.append(_admission.available_host_memory_bytes(machine, allow_cgroup_fallback=True))
            return sampled[-1]

        assert _admission.host_memory_budget_bytes(check, 4000) == 8000  # the peer's 2000 still to come
        assert _pending() == 2000 + 4000
        assert _admission.host_memory_budget_bytes(check, 0) == 8000 - 4000  # this thread's own claim too
        assert _admission.available_host_memory_bytes(machine) == 10_000
        _admission.resident(4000)
    finally:
        with BudgetLock(runtime_dir()) as lock:
            lock._write({})


def test_a_refused_request_claims_nothing():
    """A request SGLang's check cuts down is answered and nothing is claimed (no one counts memory
    that will not come)."""
    assert _admission.host_memory_budget_bytes(_sglang(4095), 4096) == 4095
    assert not _held_by_someone() and _pending() == 0


def test_an_error_from_sglangs_check_claims_nothing_and_is_raised():
    """SGLang's own check raising: its error reaches the caller unchanged, the lock is let go and
    nothing is claimed."""
    def failing(requested_bytes, *, auto_size=False):
        raise ValueError("Not enough host memory available")

    with pytest.raises(ValueError, match="Not enough host memory"):
        _admission.host_memory_budget_bytes(failing, 4096)
    assert not _held_by_someone() and _pending() == 0


def test_an_abandoned_request_drops_its_claim():
    """The allocation after an admission failed: `abandon()` drops the claim at once."""
    _admission.host_memory_budget_bytes(_sglang(10**9), 4096)
    _admission.abandon()
    assert _pending() == 0


def test_wrapped_twice_the_inner_call_samples_under_the_outer_lock():
    """The AROUND hook applied twice (two plug-in loads): the inner call must not wait for
    the lock its own outer call holds - it runs SGLang's check directly."""
    inner = _sglang(10**9)

    def outer(requested_bytes, *, auto_size=False):
        return _admission.host_memory_budget_bytes(inner, requested_bytes, auto_size=auto_size)

    done = []
    worker = threading.Thread(target=lambda: done.append(_admission.host_memory_budget_bytes(outer, 0)), daemon=True)
    worker.start()
    worker.join(60)  # a hang guard: without re-entry the thread waits for itself forever
    assert done == [10**9]


def test_a_claim_nobody_finishes_ends_by_itself(monkeypatch):
    """A pool that fails between SGLang's check and its allocation never reports resident: its
    claim is dropped after HOLD_LIMIT_S (here 0.05 s; the test waits for the event, bounded)."""
    monkeypatch.setattr(_admission, "HOLD_LIMIT_S", 0.05)
    _admission.host_memory_budget_bytes(_sglang(10**9), 4096)
    deadline = time.monotonic() + 60  # a hang guard
    while _pending():
        assert time.monotonic() < deadline, "the claim never ended"
        time.sleep(0.01)
    # the next request of this thread is claimed afresh (the expired one is forgotten)
    _admission.host_memory_budget_bytes(_sglang(10**9), 10)
    assert _pending() == 10
    _admission.resident(10)
    assert _pending() == 0


def test_sglangs_check_samples_only_after_this_process_s_dropped_mappings_are_given_back(monkeypatch):
    """A mapping dropped just before (SGLang's last view of a seam-mode pool, given back on the
    release thread) still holds its pages until that thread is done: SGLang's check samples free
    memory only once it is - events: the release ends, then the sample - not beside it, where a
    pool rebuilt at once would be judged short of its predecessor's memory."""
    events: list = []
    started, finish = threading.Event(), threading.Event()

    def slow_give_back(ptr, length):
        events.append("give back starts")
        started.set()
        assert finish.wait(60)
        events.append("given back")

    monkeypatch.setattr(_release, "RELEASE_PIECE_BYTES", 64 * 1024)
    monkeypatch.setattr(_release, "give_back", slow_give_back)
    try:
        _sampled_after_the_release(monkeypatch, events, started, finish)
    finally:
        finish.set()  # never leave the release thread parked in the stand-in: later waits would hang on it


def _sampled_after_the_release(monkeypatch, events: list, started, finish) -> None:
    mapping = _release.ReleasingMapping(-1, 1024 * 1024)
    mapping.mapped_at(1)  # any non-zero address: give_back is the stand-in
    del mapping  # its finalizer hands it to the release thread
    assert started.wait(60)

    progressed = threading.Event()  # the asking thread sampled, or waits for the release thread
    wait = _release.RELEASER.wait

    def waiting(timeout=None):
        events.append("waits")
        progressed.set()
        return wait(timeout)

    monkeypatch.setattr(_release.RELEASER, "wait", waiting)

    def check(requested_bytes, *, auto_size=False):
        events.append("sampled")
        progressed.set()
        return 10**9

    asking = threading.Thread(target=lambda: events.append(_admission.host_memory_budget_bytes(check, 0)))
    asking.start()
    assert progressed.wait(60)  # it sampled beside the release, or it waits for it: either way, now end it
    finish.set()
    asking.join(60)
    assert events == ["give back starts", "waits", "given back", "sampled", 10**9]


def test_the_one_admission_through_the_face_waits_for_this_process_s_releases_before_it_samples(monkeypatch):
    """`hicache.effects.admission.claim` - what the node store's creation asks, as a pool's
    bring-up and SGLang's check do - waits for the release thread before it samples the machine
    (events: the wait, then the sample), outside the budget lock."""
    events: list = []

    def waiting(timeout=None):
        events.append(("waits", _held_by_someone()))
        return True

    def sample():
        events.append(("sampled", _held_by_someone()))
        return ROOMY

    monkeypatch.setattr(_release.RELEASER, "wait", waiting)
    claimed = admission.claim(4096, admission.AdmissionPolicy(), lock=BudgetLock(runtime_dir()), sample=sample)
    claimed.release()
    assert events == [("waits", False), ("sampled", True)]


def test_an_admission_whose_wait_for_the_release_thread_runs_out_says_so_and_goes_on(monkeypatch, caplog):
    """The release thread still busy after RELEASE_WAIT_S: the admission is made against what the
    kernel counts free now, and a warning says why the bring-up waited and what it decided on."""

    monkeypatch.setattr(_release.RELEASER, "wait", lambda timeout=None: False)
    with caplog.at_level(logging.WARNING, logger="hicache.effects._bringup._admission"):
        claimed = admission.claim(4096, admission.AdmissionPolicy(), lock=BudgetLock(runtime_dir()),
                                  sample=lambda: ROOMY)
    claimed.release()
    assert [r.getMessage() for r in caplog.records] == [
        f"hicache: this process's dropped host memory is still being given back after "
        f"{_release.RELEASE_WAIT_S:.0f} s; admitting 4096 bytes against what the kernel counts free now"]
