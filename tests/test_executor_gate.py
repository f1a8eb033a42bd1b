"""What the transaction (hicache.effects' `_cuda._executor`) asks of its gate and reports: each
call waits for exactly its own bytes to be resident before it is made, releases its turn with the
bytes it registered (a failed call with none: no rate sample), leaves the host's registrants once
however it ends; a retry budget of N halvings allows N retries; progress events' seconds are
since the start; `apply_plan` and `apply_pool_plan` register with cudaHostRegisterDefault. And of
the `Registration` it returns (`_cuda._registration`): a rollback undoes the call an interrupt cut
short first, its GB/s and seconds, its leak message."""

from __future__ import annotations

import signal
import time

import pytest

from hicache.effects import HostLedger, apply_plan, apply_pool_plan
from hicache.effects._cuda import _executor, _gate, _registration  # the rooms under test
from hicache.errors import ApplyError
from hicache.plan import Limits, MambaLayout, plan_pool, plan_registration
from hicache.testing import FakeRuntime

pytestmark = pytest.mark.concurrency  # a real SIGINT, held by the transaction: `make test-loaded`

MiB = 2**20
BASE = 1 << 44  # the fake driver registers addresses, it never touches them
PLAN = plan_registration(8 * MiB, granularity_bytes=64 * 1024, limits=Limits(chunk_limit_bytes=2 * MiB))


class _Turn:
    def __init__(self, log: list) -> None:
        self.log = log

    def release(self, nbytes=None) -> None:
        self.log.append(("turn released", nbytes))


class RecordingGate(_gate.Gate):
    """A gate that logs, in one event list with the driver's calls, every wait for bytes, turn,
    join and leave."""

    def __init__(self, log: list) -> None:
        super().__init__(None, ready=lambda index, end, stop: log.append(("ready", index, end)))
        self.log = log

    def join(self) -> bool:
        self.log.append(("join",))
        return True

    def leave(self) -> None:
        self.log.append(("leave",))

    def turn(self, stop):
        self.log.append(("turn",))
        return _Turn(self.log)


class LoggingRuntime(FakeRuntime):
    def __init__(self, log: list, **faults) -> None:
        super().__init__(**faults)
        self.events = log

    def register(self, ptr, size, flags):
        self.events.append(("register", ptr - BASE, size))
        return super().register(ptr, size, flags)


def test_each_call_waits_for_its_own_bytes_then_its_turn_and_gives_the_turn_back_with_them():
    """Per call, in this order: wait until the buffer is resident up to the call's end, take the
    turn, register, release the turn with the call's bytes; the gate is joined once and left once."""
    log: list = []
    registration = _executor._apply([("kv", BASE, PLAN)], runtime=LoggingRuntime(log), flags=0, progress=None,
                          retry_halvings=0, ledger=HostLedger(), gate=RecordingGate(log))
    try:
        expected = [("join",)]
        for item in PLAN.ranges:
            expected += [("ready", 0, item.offset + item.size), ("turn",), ("register", item.offset, item.size),
                         ("turn released", item.size)]
        assert log == expected + [("leave",)]
    finally:
        registration.release()


def test_a_failed_call_gives_its_turn_back_with_no_bytes():
    """A call the driver refuses releases its turn with None - a failure is no sample of the
    registration rate calls are paced by - and the transaction leaves the gate once."""
    log: list = []
    with pytest.raises(ApplyError):
        _executor._apply([("kv", BASE, PLAN)], runtime=LoggingRuntime(log, fail_register={1: 1}), flags=0,
                         progress=None, retry_halvings=0, ledger=HostLedger(), gate=RecordingGate(log))
    releases = [entry for entry in log if entry[0] == "turn released"]
    assert releases == [("turn released", 2 * MiB), ("turn released", None)]
    assert log.count(("leave",)) == 1


def test_a_ctrl_c_after_the_last_call_leaves_the_gate_once():
    """A Ctrl-C held during the last call is honoured after it (the transaction rolled back, the
    error caused by the KeyboardInterrupt), and the gate, already left once no call remained, is
    not left again."""
    log: list = []

    def progress(event):
        if event.chunk_index == event.chunk_count:  # the last call: a Ctrl-C lands, held
            signal.raise_signal(signal.SIGINT)

    runtime = LoggingRuntime(log)
    with pytest.raises(ApplyError, match="after the last call failed: KeyboardInterrupt") as rolled_back:
        _executor._apply([("kv", BASE, PLAN)], runtime=runtime, flags=0, progress=progress, retry_halvings=0,
               ledger=HostLedger(), gate=RecordingGate(log))
    assert isinstance(rolled_back.value.__cause__, KeyboardInterrupt)
    assert log.count(("join",)) == 1 and log.count(("leave",)) == 1
    assert runtime.held() == set()


@pytest.mark.parametrize("halvings, failures, succeeds", [(2, 2, True), (2, 3, False), (1, 1, True), (1, 2, False)])
def test_a_budget_of_n_halvings_allows_n_retries(halvings, failures, succeeds):
    """Each refused call re-plans the rest at half the size: ``retry_halvings=N`` allows exactly N
    such retries in a buffer; the N+1st refusal is the transaction's error, everything undone."""
    runtime = FakeRuntime(fail_register={call: 1 for call in range(failures)})
    if succeeds:
        registration = _executor._apply([("kv", BASE, PLAN)], runtime=runtime, flags=0, progress=None,
                              retry_halvings=halvings, ledger=HostLedger())
        assert registration.status().retries == failures
        registration.release()
    else:
        with pytest.raises(ApplyError):
            _executor._apply([("kv", BASE, PLAN)], runtime=runtime, flags=0, progress=None, retry_halvings=halvings,
                   ledger=HostLedger())
    assert runtime.held() == set()


def test_progress_events_count_seconds_since_the_transaction_started():
    """Each event's seconds lie between 0 and the wall time around the call, never decreasing."""
    events: list = []
    before = time.perf_counter()
    registration = _executor._apply([("kv", BASE, PLAN)], runtime=FakeRuntime(), flags=0, progress=events.append,
                          retry_halvings=0, ledger=HostLedger())
    wall = time.perf_counter() - before
    registration.release()
    seconds = [event.elapsed_s for event in events]
    assert len(seconds) == 4 and seconds == sorted(seconds) and 0 <= seconds[0] and seconds[-1] <= wall


def test_apply_plan_and_apply_pool_plan_register_with_cuda_host_register_default():
    """Left to their default, both public doors pass flags 0 (cudaHostRegisterDefault: mapped and
    portable on UVA systems)."""
    runtime = FakeRuntime()
    apply_plan(PLAN, base_ptr=BASE, runtime=runtime, ledger=HostLedger()).release()
    layout = MambaLayout("page_first", layer_num=2, slots=64, temporal_shape=(4, 8), temporal_itemsize=4,
                         conv_shapes=((4, 4), (2, 8)), conv_itemsize=2)
    pool = plan_pool(layout, Limits(chunk_limit_bytes=4096, os_page_bytes=64))
    bases = [BASE + i * 2**30 for i in range(len(pool.buffers))]
    apply_pool_plan(pool, base_ptrs=bases, runtime=runtime, ledger=HostLedger()).release()
    flags = [entry[3] for entry in runtime.cudart.log if entry[0] == "register"]
    assert len(flags) > len(PLAN.ranges) and set(flags) == {0}


def test_a_rollback_undoes_the_call_an_interrupt_cut_short_first():
    """A Ctrl-C landing just after a register call took effect: the rollback unregisters that
    call first - the newest - then the journal's calls newest first; nothing stays."""
    runtime = FakeRuntime(interrupt_register={2: "after"})
    with pytest.raises(BaseException) as interrupted:
        _executor._apply([("kv", BASE, PLAN)], runtime=runtime, flags=0, progress=None, retry_halvings=0,
                         ledger=HostLedger())
    error = interrupted.value
    assert isinstance(error, KeyboardInterrupt) or isinstance(error.__cause__, KeyboardInterrupt), error
    undone = [entry[1] - BASE for entry in runtime.cudart.log if entry[0] == "unregister"]
    assert undone == [4 * MiB, 2 * MiB, 0] and runtime.held() == set()


def test_a_registrations_rates_and_seconds():
    """`status()`: GB/s is the registered bytes over the register seconds (0.0, not a division
    by zero, where a coarse clock measured none); the release's seconds lie within the wall time
    around it."""
    registration = _executor._apply([("kv", BASE, PLAN)], runtime=FakeRuntime(), flags=0, progress=None,
                                    retry_halvings=0, ledger=HostLedger())
    status = registration.status()
    assert status.register_seconds > 0
    assert status.register_gbps == pytest.approx(PLAN.total_bytes / status.register_seconds / 1e9)
    before = time.perf_counter()
    registration.release()
    assert 0 <= registration.status().release_seconds <= time.perf_counter() - before


def test_a_registration_measured_in_no_time_reports_no_rate(monkeypatch):
    """A clock that did not move (a coarse one) gives register_seconds 0 and GB/s 0.0."""
    import types

    monkeypatch.setattr(_executor, "time", types.SimpleNamespace(perf_counter=lambda: 5.0))
    registration = _executor._apply([("kv", BASE, PLAN)], runtime=FakeRuntime(), flags=0, progress=None,
                                    retry_halvings=0, ledger=HostLedger())
    try:
        status = registration.status()
        assert (status.register_seconds, status.register_gbps) == (0.0, 0.0)
    finally:
        registration.release()


def test_a_leak_message_shows_the_first_eight_ranges_and_counts_the_rest():
    """Eight leaked ranges are all shown; of nine or ten the first eight, and how many more."""
    ranges = [(BASE + i * MiB, MiB) for i in range(10)]
    eight = _registration._leak_message("release", ranges[:8])
    assert "left 8 range(s)" in eight and eight.count("(0x") == 8 and "more" not in eight
    nine = _registration._leak_message("release", ranges[:9])
    assert nine.count("(0x") == 8 and "and 1 more" in nine
    assert "and 2 more" in _registration._leak_message("release", ranges)
