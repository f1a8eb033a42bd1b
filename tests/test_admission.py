"""The plug-in's admission around SGLang's host-memory check (hicache.effects._bringup._admission):
SGLang's own answer sampled under the host-wide budget lock, an admitted request holding the
lock until all its bytes are resident, a refused or failed one letting go at once, re-entrant
when wrapped twice, and a hold nobody finishes ending by itself. Each law is seen from outside,
as another rank sees it: whether the lock can be taken by another open file now."""

from __future__ import annotations

import fcntl
import os
import threading
import time

import pytest

from hicache.effects._bringup import _admission
from hicache.effects._hostwide._rundir import runtime_dir

pytestmark = pytest.mark.concurrency  # a timer thread lets an abandoned hold go


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


@pytest.fixture(autouse=True)
def _nothing_held_after():
    yield
    _admission.abandon()  # a failing test leaves no hold to the next
    assert not _held_by_someone()


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
    assert seen == [True] and not _held_by_someone()  # only asked (0 bytes): nothing to wait for


@pytest.mark.parametrize("requested, allowance", [(4096, 4096), (4096, 10**9)])
def test_an_admitted_request_holds_the_lock_until_every_byte_is_resident(requested, allowance):
    """An exact fit is admitted too: the lock stays until all requested bytes are resident -
    not one byte before (a second rank would sample before this one's memory is used)."""
    assert _admission.host_memory_budget_bytes(_sglang(allowance), requested) == allowance
    assert _held_by_someone()
    _admission.resident(requested - 1)
    assert _held_by_someone()
    _admission.resident(1)
    assert not _held_by_someone()


def test_requests_of_one_constructor_add_up_under_the_one_hold():
    """Pool after pool in one constructor: the second samples under the held lock and the hold
    ends when both requests are resident."""
    seen = []
    _admission.host_memory_budget_bytes(_sglang(10**9, seen), 1000)
    _admission.host_memory_budget_bytes(_sglang(10**9, seen), 500)
    assert seen == [True, True]
    _admission.resident(1000)
    assert _held_by_someone()
    _admission.resident(500)
    assert not _held_by_someone()


def test_a_refused_request_lets_the_lock_go_at_once():
    """A request SGLang's check cuts down is answered and the host-wide budget lock is free at once
    (no one waits on memory that will not come)."""
    assert _admission.host_memory_budget_bytes(_sglang(4095), 4096) == 4095
    assert not _held_by_someone()


def test_an_error_from_sglangs_check_lets_the_lock_go_and_is_raised():
    """SGLang's own check raising: its error reaches the caller unchanged and the budget lock is let
    go."""
    def failing(requested_bytes, *, auto_size=False):
        raise ValueError("Not enough host memory available")

    with pytest.raises(ValueError, match="Not enough host memory"):
        _admission.host_memory_budget_bytes(failing, 4096)
    assert not _held_by_someone()


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


def test_a_hold_nobody_finishes_ends_by_itself(monkeypatch):
    """A pool that fails between SGLang's check and its allocation never reports resident:
    the hold ends after HOLD_LIMIT_S (here 0.05 s; the test waits for the event, bounded)."""
    monkeypatch.setattr(_admission, "HOLD_LIMIT_S", 0.05)
    _admission.host_memory_budget_bytes(_sglang(10**9), 4096)
    deadline = time.monotonic() + 60  # a hang guard
    while _held_by_someone():
        assert time.monotonic() < deadline, "the hold never ended"
        time.sleep(0.01)
    # the next request of this thread takes the lock afresh (the expired hold is forgotten)
    _admission.host_memory_budget_bytes(_sglang(10**9), 10)
    assert _held_by_someone()
    _admission.resident(10)
    assert not _held_by_someone()
