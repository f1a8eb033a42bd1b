"""A filling pool's claim on the host's memory, step by step (issue #54): the claims file never
counts bytes resident before they are faulted, an update skipped while a peer holds the lock is
counted by the next one or by `settle`, and two claims of one process - settled or forgotten -
touch only their own bytes. The update step is injected small (every test pool is smaller than
the 64 MiB production step); a peer reads the file through its own open file of the lock."""

from __future__ import annotations

import os
from types import SimpleNamespace

import pytest

from hicache.effects._hostwide._claim import AdmissionPolicy, Claim as HostClaim, Refused, claim
from hicache.effects._hostwide._lock import BudgetLock, Entry as Claim


@pytest.fixture
def lock(tmp_path):
    directory = tmp_path / "run"
    directory.mkdir(mode=0o700)
    return BudgetLock(directory, timeout_s=30)  # a hang guard, were it ever held


def _peer_view(lock) -> Claim:
    """This process's entry as a peer sampling the host reads it (its own BudgetLock)."""
    with BudgetLock(lock.path.parent, timeout_s=30) as peer:
        return peer.claims().get(os.getpid(), Claim(0, 0))


def _claimed(lock, total: int, step: int) -> HostClaim:
    """A claim of ``total`` bytes admitted by the one admission (a stated room that fits)."""
    return claim(total, AdmissionPolicy(host_memory_bytes=10**15, ranks_per_host=1), lock=lock,
                 sample=lambda: _facts(), step=step)


def _facts(**machine):
    from machine import facts

    return facts(**machine)


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
    books.claim = first
    books.forget_budget()
    books.forget_budget()
    assert _peer_view(lock) == Claim(400, 400)


GB = 10**9


def _admit(lock, total, **machine):
    return claim(total, AdmissionPolicy(ranks_per_host=1), lock=lock, sample=lambda: _facts(**machine))


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


class _Scope:
    """A server's budget scope: books requests against ``room``, hears how each ended."""

    name = "test-server"

    def __init__(self, room) -> None:
        self.room, self.settled = room, []

    def book_host_memory(self, nbytes):
        return self.room

    def host_memory_settled(self, nbytes, *, up):
        self.settled.append((nbytes, up))


@pytest.mark.concurrency
def test_a_scope_in_force_books_the_request_and_hears_once_how_it_ended(lock):
    """The one admission with a server's scope (issue #55 item 3): the scope books the request and
    the host file records nothing; a fill reported from another thread settles nothing; `up`
    settles it as up once, and a later give-back says nothing more; a failed one is settled as
    failed; a request past the scope's room is refused naming the requester and the server."""
    import threading

    from hicache.errors import CapacityError

    scope = _Scope(10_000)
    served = claim(4000, AdmissionPolicy(scope=scope), lock=lock, owner="pool A")
    worker = threading.Thread(target=served.filled, args=(4000,))
    worker.start()
    worker.join(30)  # a hang guard
    assert scope.settled == [] and _peer_view(lock) == Claim(0, 0)
    served.up()
    served.release()
    assert scope.settled == [(4000, True)]
    failed = claim(4000, AdmissionPolicy(scope=scope), lock=lock)
    failed.settle()  # a scope's booking waits for up: a failure after the fill is still a failure
    failed.abandon()
    failed.abandon()
    assert scope.settled == [(4000, True), (4000, False)]
    with pytest.raises(CapacityError, match="pool B needs .*the test-server process's budget"):
        claim(20_000, AdmissionPolicy(scope=scope), lock=lock, owner="pool B")
    assert len(scope.settled) == 2


def test_a_servers_own_arithmetic_decides_and_a_refusal_carries_its_allowance(lock):
    """``allowance``: the server's answer, asked under the lock with the pending claims; admitted
    only when ``0 < nbytes <= allowance``; a refusal records nothing and carries the answer; a
    request of 0 bytes is answered, not recorded."""

    asked = []

    def allowance(nbytes, pending):
        asked.append((nbytes, pending, lock.held))
        return 5000

    assert claim(0, AdmissionPolicy(allowance=allowance), lock=lock).allowance == 5000
    with pytest.raises(Refused) as refused:
        claim(6000, AdmissionPolicy(allowance=allowance), lock=lock)
    assert refused.value.allowance == 5000 and _peer_view(lock) == Claim(0, 0)
    kept = claim(5000, AdmissionPolicy(allowance=allowance, until="resident"), lock=lock)
    assert _peer_view(lock) == Claim(5000, 0) and all(held for _, _, held in asked)
    kept.settle()  # kept only until resident: settling gives it back
    assert _peer_view(lock) == Claim(0, 0) and kept.pending == 0


@pytest.mark.concurrency
def test_joined_claims_go_together_and_an_unsettled_one_expires(lock):
    """Two requests of one constructor joined are one claim (given back together, once); a claim
    with ``expire_s`` that nobody settles is dropped by itself (the test waits for the event)."""
    import time

    policy = AdmissionPolicy(host_memory_bytes=10**15, ranks_per_host=1, until="resident", expire_s=0.05)
    first = claim(1000, policy, lock=lock, sample=_facts)
    second = claim(500, attrs_evolve(policy, expire_s=None), lock=lock, sample=_facts)
    assert first.join(second) and first.nbytes == 1500 and second.pending == 0
    deadline = time.monotonic() + 60  # a hang guard
    while _peer_view(lock) != Claim(0, 0):
        assert time.monotonic() < deadline, "the claim never expired"
        time.sleep(0.01)
    assert first.closed and not first.join(claim(10, attrs_evolve(policy, expire_s=None), lock=lock, sample=_facts))


def attrs_evolve(value, **changes):
    import attrs

    return attrs.evolve(value, **changes)
