"""A filling pool's claim on the host's memory, step by step (issue #54): the claims file never
counts bytes resident before they are faulted, an update skipped while a peer holds the lock is
counted by the next one or by `settle`, and two claims of one process - settled or forgotten -
touch only their own bytes. The update step is injected small (every test pool is smaller than
the 64 MiB production step); a peer reads the file through its own open file of the lock."""

from __future__ import annotations

import os
from types import SimpleNamespace

import pytest

from hicache.effects._hostwide._claim import AdmissionPolicy, Claim as HostClaim, Refused, claim, fixed_room
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


class _Recording:
    """A stand-in for the budget lock's file as a claim's faulting threads see it: records each
    resident update (always free)."""

    def __init__(self) -> None:
        self.updates = []

    def reopen(self):
        return self

    def try_add_resident(self, nbytes: int) -> bool:
        self.updates.append(nbytes)
        return True


@pytest.mark.parametrize("nbytes, updates", [
    (2 * 2**30, [2**27] * 16),  # a sixteenth of the claim: at most 16 rewrites of the file
    (260 * 2**20, [64 * 2**20] * 4 + [4 * 2**20]),  # never under 64 MiB, then the end
])
def test_the_default_step_is_a_sixteenth_of_the_claim_and_never_under_64_mib(nbytes, updates):
    """Filled a MiB at a time with no step given: the resident count is rewritten each time a
    sixteenth of the claim (at least 64 MiB) has filled since the last update, and at the last
    byte - each update exactly the bytes faulted since."""
    file = _Recording()
    fill = HostClaim(file, nbytes, AdmissionPolicy())
    for done in range(2**20, nbytes + 1, 2**20):
        fill.filled(done)
    assert file.updates == updates and fill.written == nbytes and fill.pending == 0


def test_a_claims_pending_bytes_are_what_the_file_does_not_count_yet_and_the_last_byte_counts(lock):
    """``pending`` is the claim less what was counted resident; the fill's last event counts the
    rest at once, even less than a step after the previous update (settle has nothing left)."""
    fill = _claimed(lock, 1000, 100)
    fill.filled(350)
    assert (fill.written, fill.pending) == (350, 650)
    fill.filled(960)
    fill.filled(1000)  # 40 bytes since the last update: less than a step, but the end
    assert (fill.written, fill.pending) == (1000, 0) and _peer_view(lock) == Claim(1000, 1000)
    assert repr(fill) == "<Claim 1000 bytes, 1000 resident, filling>"
    fill.settle()
    assert repr(fill) == "<Claim 1000 bytes, 1000 resident, settled>" and fill.settled


def test_an_admission_policy_takes_keywords_only_and_reserves_nothing_by_default(lock):
    """AdmissionPolicy is keyword-only (a positional room would be read as another field); by
    default it keeps no reserve: a request of exactly the measured room is admitted, a byte more
    is not."""
    from hicache.errors import CapacityError

    with pytest.raises(TypeError):
        AdmissionPolicy(10**9)
    exact = claim(10 * GB, AdmissionPolicy(ranks_per_host=1), lock=lock, sample=lambda: _facts(available_bytes=10 * GB))
    exact.abandon()
    with pytest.raises(CapacityError, match=r"10.0 GB available - 0.0 GB reserve"):
        claim(10 * GB + 1, AdmissionPolicy(ranks_per_host=1), lock=lock,
              sample=lambda: _facts(available_bytes=10 * GB))


def test_a_room_never_goes_below_zero_and_more_peers_than_ranks_share_the_last_ranks_room(lock, monkeypatch):
    """Peers claiming more than the stated host memory leave it no room (0, not negative: nothing
    admitted, not even a byte); claims still filling beyond the measured available memory leave
    none either; and measured with more peers than stated ranks, a request is judged as the last
    rank's - all of what is left - rather than failing the arithmetic."""
    from hicache.errors import CapacityError

    assert fixed_room(10, {1: 20}, ranks=4) == 0 and fixed_room(30, {1: 20}, ranks=4) == 10
    filling = _claimed(lock, 12 * GB, GB)  # 12 GB claimed, none of it resident: pending
    with pytest.raises(CapacityError, match=r"requested 0.0 GB per rank; 0.0 GB available"):
        _admit(lock, 1, available_bytes=10 * GB)
    filling.abandon()
    peers = {os.getpid() + i: Claim(GB, GB) for i in (1, 2, 3)}
    monkeypatch.setattr(lock, "claims", lambda: peers)  # three live peers, each with its pool resident
    admitted = claim(4 * GB, AdmissionPolicy(ranks_per_host=2), lock=lock, sample=lambda: _facts(available_bytes=4 * GB))
    assert admitted.nbytes == 4 * GB


def test_a_refusal_by_the_servers_arithmetic_says_why_and_a_byte_is_a_request(lock):
    """Refused carries its message (the requester, the bytes, the allowance); a 1-byte request
    within the allowance is admitted and recorded; a 0-byte one is answered as a claim of
    nothing - 0 bytes, already given back, nothing recorded."""
    with pytest.raises(Refused, match=r"host memory budget refused: pool C requests .* the server's arithmetic allows"):
        claim(10, AdmissionPolicy(allowance=lambda nbytes, pending: 5), lock=lock, owner="pool C")
    one = claim(1, AdmissionPolicy(allowance=lambda nbytes, pending: 5), lock=lock)
    assert _peer_view(lock) == Claim(1, 0)
    one.abandon()
    nothing = claim(0, AdmissionPolicy(allowance=lambda nbytes, pending: 5), lock=lock)
    assert (nothing.nbytes, nothing.pending, nothing.closed) == (0, 0, True) and _peer_view(lock) == Claim(0, 0)


def test_the_holder_gets_the_claim_before_it_is_recorded_and_a_scope_admits_its_exact_room(lock):
    """``hold`` is called with the very claim returned, while the file does not list it yet (a
    Ctrl-C between the two leaves it with its holder); a scope's booking is held the same way,
    and a request of exactly the scope's room is admitted."""
    held = []

    def hold(admitted):  # under the lock, as the admission holds it: read through that same open file
        held.append((admitted, (lock.claims().get(os.getpid(), Claim(0, 0)) if lock.held else None)))

    admitted = claim(1000, AdmissionPolicy(host_memory_bytes=10**15, ranks_per_host=1), lock=lock, sample=_facts,
                     hold=hold)
    assert held == [(admitted, Claim(0, 0))] and _peer_view(lock) == Claim(1000, 0)
    admitted.abandon()
    scope = _Scope(4000)
    booked = claim(4000, AdmissionPolicy(scope=scope), lock=lock, hold=hold)
    assert held[-1][0] is booked and booked.nbytes == 4000
    booked.up()
    booked.release()
    assert scope.settled == [(4000, True)]  # up settled it; the release said nothing more


def _timers_of(fill) -> list:
    import threading

    return [t for t in threading.enumerate() if isinstance(t, threading.Timer) and t.function == fill._expire]


@pytest.mark.concurrency
def test_an_expiry_timer_is_a_daemon_only_where_asked_and_ends_with_its_claim(lock, caplog):
    """No timer without ``expire_s``; with one, a daemon timer (it must not hold the interpreter
    at exit) that settle, release and join each end at once (joined here: a hang guard only);
    an expiry landing after settle keeps the claim; an expiry of an unsettled claim warns and
    gives it back."""
    import logging

    policy = AdmissionPolicy(host_memory_bytes=10**15, ranks_per_host=1, expire_s=3600)
    plain = claim(10, attrs_evolve(policy, expire_s=None), lock=lock, sample=_facts)
    assert _timers_of(plain) == []
    plain.abandon()
    for end in ("settle", "release", "join"):
        fill = claim(10, policy, lock=lock, sample=_facts)
        (timer,) = _timers_of(fill)
        assert timer.daemon
        if end == "join":
            host = claim(10, attrs_evolve(policy, expire_s=None), lock=lock, sample=_facts)
            assert host.join(fill) is True
            host.abandon()
        else:
            getattr(fill, end)()
        timer.join(60)  # a hang guard: a cancelled timer ends at once
        assert not timer.is_alive(), end
        fill.abandon()
    settled = claim(10, policy, lock=lock, sample=_facts)
    settled.settle()
    settled._expire()  # a timer that fired as settle began: too late to drop it
    assert not settled.closed and _peer_view(lock) == Claim(10, 10)
    settled.release()
    late = claim(10, policy, lock=lock, sample=_facts)
    with caplog.at_level(logging.WARNING, logger="hicache"):
        late._expire()
    assert late.closed and "did not come up within 3600 s; dropping its claim" in caplog.text
    assert _peer_view(lock) == Claim(0, 0)


def test_only_a_fresh_unscoped_claim_may_be_joined_and_release_waits_by_default(lock):
    """join refuses (ValueError naming both, nothing changed) a claim already counting resident
    bytes, one given back, or a scope's booking on either side; a claim given back itself
    answers False. release and abandon wait for the lock unless told not to (a finalizer's)."""
    import inspect

    policy = AdmissionPolicy(host_memory_bytes=10**15, ranks_per_host=1)
    host = _claimed(lock, 1000, 100)
    filling = _claimed(lock, 500, 100)
    filling.filled(200)
    gone = _claimed(lock, 300, 100)
    gone.abandon()
    scoped = claim(400, AdmissionPolicy(scope=_Scope(10_000)), lock=lock)
    for other in (filling, gone, scoped):
        with pytest.raises(ValueError, match="cannot join <Claim"):
            host.join(other)
        assert host.nbytes == 1000
    with pytest.raises(ValueError, match="cannot join"):
        scoped.join(claim(10, policy, lock=lock, sample=_facts))
    host.abandon()
    assert host.join(claim(10, policy, lock=lock, sample=_facts)) is False
    for method in (HostClaim.release, HostClaim.abandon):
        assert inspect.signature(method).parameters["wait"].default is True
    filling.abandon()
    scoped.abandon()
