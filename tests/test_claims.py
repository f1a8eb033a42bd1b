"""A filling pool's claim on the host's memory, step by step (issue #54): the claims file never
counts bytes resident before they are faulted, an update skipped while a peer holds the lock is
counted by the next one or by `settle`, and two claims of one process - settled or forgotten -
touch only their own bytes. The update step is injected small (every test pool is smaller than
the 64 MiB production step); a peer reads the file through its own open file of the lock."""

from __future__ import annotations

import os
from types import SimpleNamespace

import pytest

from hicache.effects._bringup._claim import ClaimedFill
from hicache.effects._hostwide._lock import BudgetLock, Claim


@pytest.fixture
def lock(tmp_path):
    directory = tmp_path / "run"
    directory.mkdir(mode=0o700)
    return BudgetLock(directory, timeout_s=30)  # a hang guard, were it ever held


def _peer_view(lock) -> Claim:
    """This process's entry as a peer sampling the host reads it (its own BudgetLock)."""
    with BudgetLock(lock.path.parent, timeout_s=30) as peer:
        return peer.claims().get(os.getpid(), Claim(0, 0))


def _claimed(lock, total: int, step: int) -> ClaimedFill:
    with lock:
        lock.record(total)
    return ClaimedFill(lock, total, step=step)


def _faulted(done: int):
    return SimpleNamespace(bytes_done=done)


def test_resident_follows_the_fill_in_steps_and_is_never_ahead_of_it(lock):
    """Events of a 1000-byte claim with a 100-byte step: after each, a peer sees resident at most
    the faulted bytes and less than one step behind them; pending is exactly claimed minus
    resident; the last event and settle make it whole."""
    fill = _claimed(lock, 1000, 100)
    # (faulted, resident the file then says): updates once a step has filled since the last one
    # (a file rewrite per step, not per event), the last event whatever its size
    for done, resident in ((40, 0), (99, 0), (100, 100), (150, 100), (230, 230), (260, 230), (999, 999), (1000, 1000)):
        fill(_faulted(done))
        seen = _peer_view(lock)
        assert seen.resident == resident <= done and done - resident < 100 or done == resident == 1000, (done, seen)
        assert seen.pending == 1000 - seen.resident and fill.written == seen.resident
    fill.settle()
    assert _peer_view(lock) == Claim(1000, 1000)


def test_an_update_skipped_while_a_peer_holds_the_lock_is_counted_by_the_next_or_by_settle(lock):
    """A peer holds the lock when 300 bytes are faulted: the update is skipped (the fill never
    waits), those bytes stay pending; the next event counts them all. Skipped at the last
    event, settle counts them."""
    fill = _claimed(lock, 1000, 100)
    fill(_faulted(150))
    with BudgetLock(lock.path.parent, timeout_s=30):  # a peer sampling now
        fill(_faulted(300))
    assert _peer_view(lock).resident == 150 and fill.written == 150
    fill(_faulted(320))
    assert _peer_view(lock).resident == 320
    with BudgetLock(lock.path.parent, timeout_s=30):
        fill(_faulted(1000))
    assert _peer_view(lock).resident == 320
    fill.settle()
    assert _peer_view(lock) == Claim(1000, 1000)


def test_two_claims_of_one_process_settle_and_forget_only_their_own_bytes(lock):
    """Two pools of one process fill side by side (one entry in the file): settling the first
    adds only its own missing bytes - the second's pending bytes stay pending - and forgetting
    the first takes exactly its claim and its resident bytes out."""
    first, second = _claimed(lock, 1000, 100), _claimed(lock, 600, 100)
    first(_faulted(500))
    second(_faulted(200))
    assert _peer_view(lock) == Claim(1600, 700)
    first.settle()
    assert _peer_view(lock) == Claim(1600, 1200)  # 1000 + 200: the second's 400 still pending
    with lock:
        lock.forget(1000, resident=first.written)
    assert _peer_view(lock) == Claim(600, 200)
    second.settle()
    assert _peer_view(lock) == Claim(600, 600)
    with lock:
        lock.forget(600, resident=second.written)
    assert _peer_view(lock) == Claim(0, 0)  # the entry is gone


def test_a_released_half_filled_claim_takes_out_only_what_it_counted(lock):
    """A pool released mid-fill (interrupted): its claim goes with only the resident bytes its
    fill had counted; a second claim of the process keeps its own resident bytes."""
    first, second = _claimed(lock, 1000, 100), _claimed(lock, 400, 100)
    second.settle()
    first(_faulted(300))
    with lock:
        lock.forget(1000, resident=first.written)
    assert _peer_view(lock) == Claim(400, 400)


def test_a_released_bring_up_gives_back_exactly_what_its_fill_counted(lock):
    """The books a released bring-up keeps (`_Books.forget_budget`): its claim leaves the
    process's entry with the resident bytes its own fill counted - not all of its bytes (a
    half-filled pool) - and a second pool's claim keeps its own; forgetting twice takes nothing
    more."""
    from hicache.effects._bringup._handle import _Books

    first, second = _claimed(lock, 1000, 100), _claimed(lock, 400, 100)
    second.settle()
    first(_faulted(300))
    books = _Books(allocator=None, ledger=None, owns_memory=False)
    books.budget, books.claim = (lock, 1000), first
    books.forget_budget()
    books.forget_budget()
    assert _peer_view(lock) == Claim(400, 400)


GB = 10**9


def _admit(lock, total, **machine):
    from machine import facts

    from hicache.effects._bringup._bring_up import _admit as admit

    with lock:
        return admit(lock, total, facts(**machine), None, 1, 0)


def test_this_processs_own_claim_still_filling_is_counted_like_a_peers(lock):
    """A pool of this process still filling (its 6 GB not resident yet: not gone from the
    sampled available memory) leaves 4 GB of a 10 GB sample: a second pool of 5 GB is refused,
    one of 3 GB admitted - another thread's pool or the plug-in's admission claim counts."""
    from hicache.errors import CapacityError

    _claimed(lock, 6 * GB, GB)
    with pytest.raises(CapacityError):
        _admit(lock, 5 * GB, available_bytes=10 * GB)
    _admit(lock, 3 * GB, available_bytes=10 * GB)


def test_pending_claims_count_against_the_cgroup_as_against_available_memory(lock):
    """A cgroup of 20 GB using 10: a claim of 6 GB still filling is not in the cgroup's usage
    yet, so a 5 GB pool would overrun the limit - refused; a 3 GB one fits."""
    from hicache.errors import CapacityError

    _claimed(lock, 6 * GB, GB)
    room = dict(available_bytes=1000 * GB, cgroup_limit_bytes=20 * GB, cgroup_usage_bytes=10 * GB)
    with pytest.raises(CapacityError):
        _admit(lock, 5 * GB, **room)
    _admit(lock, 3 * GB, **room)
