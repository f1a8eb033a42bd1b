"""What each call of a progressive registration (`ProgressiveRegistration`) may register: only
bytes already resident - it waits for its own bytes, never registers past what the pre-fault has
made resident (a fault inside `cudaHostRegister` holds the whole driver) - in the order its key
gives from the bytes each chunk has registered, starting from none; a Ctrl-C while it waits for
its turn at the host's driver ends the wait with nothing registered; its background thread never
holds the interpreter's exit."""

from __future__ import annotations

import signal
import threading

import pytest

from hicache.effects import HostLedger
from hicache.effects._cuda._progressive import Chunk, ProgressiveRegistration
from hicache.effects._hostwide._turnstile import Turnstile
from hicache.plan import Limits
from hicache.testing import FakeRuntime

pytestmark = pytest.mark.concurrency  # a background thread, a held turn, a signal: `make test-loaded`

KiB, MiB = 2**10, 2**20
BASE = 1 << 44  # the fake driver registers addresses, it never touches them
PIECE = 256 * KiB  # what the fake pre-fault makes resident past what a chunk registered


def _chunks(count: int = 2, size: int = MiB) -> list[Chunk]:
    return [Chunk(f"kv{i}", BASE + i * size, size, 4 * KiB, Limits(chunk_limit_bytes=size)) for i in range(count)]


def test_each_call_waits_for_its_own_bytes_and_registers_no_more_than_are_resident():
    """With a pre-fault one piece ahead of each chunk's registered bytes, every call registers at
    most that piece, waits (``before_call``) for exactly the bytes it registers, and the calls tile
    every chunk once - in the order of a key that starts each chunk at 0 bytes registered."""
    runtime = FakeRuntime()
    keyed, waited = [], []

    def resident(index, done, stop):
        return done + PIECE  # one more piece resident past what is registered

    def before_call(index, end, stop):
        waited.append((index, end))

    def key(index, done):
        keyed.append((index, done))
        return (done, index)  # the chunks advance together: least registered first

    registration = ProgressiveRegistration(_chunks(), runtime=runtime, ledger=HostLedger(), max_stall_s=None,
                                           resident=resident, before_call=before_call, key=key)
    registration.start(ready=lambda: False)  # every call here, in the foreground
    try:
        assert registration.wait(60)
        calls = [(ptr, size) for kind, ptr, size, _ in (e for e in runtime.cudart.log if e[0] == "register")]
        assert len(calls) == 8 and all(size <= PIECE for _, size in calls)
        made = [((ptr - BASE) // MiB, (ptr - BASE) % MiB, size) for ptr, size in calls]
        assert made == [(i, done, PIECE) for done in range(0, MiB, PIECE) for i in (0, 1)]  # least registered first
        assert waited == [(i, done + size) for i, done, size in made]  # each call's own bytes, no fewer
        assert keyed[:2] == [(0, 0), (1, 0)]  # each chunk starts keyed at nothing registered
    finally:
        registration.release()
    assert runtime.held() == set()


def test_a_ctrl_c_while_waiting_for_the_drivers_turn_ends_the_wait_with_nothing_registered(tmp_path):
    """Another registrant holds the host's one turn: the first call waits for it, and a Ctrl-C
    landing in that wait ends it at once - KeyboardInterrupt, no call made (the other's hold is
    not waited out, and no call slips in once it lets go)."""
    turnstile = Turnstile(tmp_path, concurrency=1, poll_s=0.0005)
    holding, let_go = threading.Event(), threading.Event()

    def other():  # another registrant, holding the turn until told
        turn = Turnstile(tmp_path, concurrency=1, poll_s=0.0005).acquire()
        holding.set()
        let_go.wait(20)  # a hang guard: a wait the Ctrl-C did not end gets the turn after it
        turn.release(None)

    holder = threading.Thread(target=other, daemon=True)
    holder.start()
    assert holding.wait(60)
    waited = turnstile._wait

    def ctrl_c_in_the_wait(*args):  # the Ctrl-C lands once the call waits for its turn: an event, not a delay
        signal.raise_signal(signal.SIGINT)
        return waited(*args)

    turnstile._wait = ctrl_c_in_the_wait
    runtime = FakeRuntime()
    registration = ProgressiveRegistration(_chunks(1), runtime=runtime, ledger=HostLedger(), max_stall_s=None,
                                           turnstile=turnstile)
    try:
        with pytest.raises(KeyboardInterrupt):
            registration.start()
        assert not [e for e in runtime.cudart.log if e[0] == "register"]
        assert holder.is_alive()  # the other's hold was not waited out
    finally:
        let_go.set()
        holder.join(60)
        registration.release()
    assert runtime.held() == set()


def test_the_background_thread_never_holds_the_interpreters_exit():
    """A process that exits while its progressive registration still runs is not kept alive by
    it: the thread is a daemon (the memory goes with the process, and the driver with it)."""
    runtime = FakeRuntime()
    registration = ProgressiveRegistration(_chunks(), runtime=runtime, ledger=HostLedger(), max_stall_s=None)
    registration.start()
    try:
        assert registration._thread.daemon and registration._thread.name == "hicache-progressive"
    finally:
        registration.release()


def test_a_release_that_leaves_calls_registered_keeps_every_one_for_the_retry():
    """Three of four calls fail to unregister: the `ReleaseError` names all three, the books keep
    all three in the order they were made, and releasing again unregisters every one."""
    from hicache.errors import ReleaseError

    runtime = FakeRuntime(fail_unregister={0: 1, 1: 1, 2: 1})  # newest first: chunks 3, 2 and 1 stay
    registration = ProgressiveRegistration(_chunks(4), runtime=runtime, ledger=HostLedger(), max_stall_s=None)
    registration.start(ready=lambda: False)
    assert registration.wait(60)
    with pytest.raises(ReleaseError) as first:
        registration.release()
    stays = {(BASE + i * MiB, MiB) for i in (1, 2, 3)}
    assert set(first.value.leaked) == stays == runtime.held()
    assert [r.ranges[0].ptr for r in registration.registered()] == [BASE + i * MiB for i in (1, 2, 3)]
    registration.release()  # the retry
    assert runtime.held() == set() and registration.registered() == []


def test_a_ctrl_c_while_stop_waits_for_the_thread_is_raised_once_it_has_ended():
    """A Ctrl-C landing while `stop()` waits for the background thread is not lost: the wait goes
    on until the thread has ended (its call in flight must not be cut), then the caller gets the
    KeyboardInterrupt."""
    runtime = FakeRuntime()
    registration = ProgressiveRegistration(_chunks(), runtime=runtime, ledger=HostLedger(), max_stall_s=None)
    registration.start()
    thread, joins = registration._thread, []

    def join_interrupted_once(timeout=None):
        joins.append(timeout)
        if len(joins) == 1:
            raise KeyboardInterrupt  # the Ctrl-C, landing in the first wait
        threading.Thread.join(thread, timeout)

    thread.join = join_interrupted_once
    try:
        with pytest.raises(KeyboardInterrupt):
            registration.stop()
        assert len(joins) >= 2 and not thread.is_alive()
    finally:
        registration.release()
    assert runtime.held() == set()
