"""Progress that moves (issue #21 item 4): a bring-up reports pre-fault and registration bytes,
rates and ETAs while it runs - `hicache apply`'s display redraws at least every second (a call
in flight shows its seconds), the pre-fault reports every piece, the library logs both phases."""

from __future__ import annotations

import io
import logging
import time

import pytest
from machine import ROOMY

from hicache.cli._progress import BringupProgress, wait_progressive
from hicache.effects import BufferRequest, HostTensorAllocator, Progressive, bring_up
from hicache.effects import HostSetup, Report
from hicache.plan import Limits, plan_registration
from hicache.testing import FakeCudart, FakeRuntime

pytestmark = pytest.mark.concurrency  # processes, threads, signals or waits: `make test-loaded`

MiB = 2**20


def _request(total: int, chunk: int) -> BufferRequest:
    plan = plan_registration(total, granularity_bytes=4096, limits=Limits(chunk_limit_bytes=chunk))
    return BufferRequest("kv", (total,), None, plan)


def test_a_pipelined_bring_up_reports_every_pre_fault_piece_and_every_call():
    """A pipelined bring-up reports every pre-fault piece in order up to the total, and every
    register call's running bytes."""
    prefault, calls = [], []
    handle = bring_up([_request(64 * MiB, 16 * MiB)], mode="pipelined",
                      host=HostSetup(runtime=FakeRuntime(), machine=ROOMY,
                                     allocator=HostTensorAllocator(prefault_threads=2)),
                      report=Report(progress=calls.append, prefault_progress=prefault.append))
    handle.release()
    done = [e.bytes_done for e in prefault]
    assert len(prefault) >= 2 and done == sorted(done) and done[-1] == 64 * MiB
    assert all(e.bytes_total == 64 * MiB for e in prefault)
    assert [e.bytes_done for e in calls] == [16 * MiB, 32 * MiB, 48 * MiB, 64 * MiB]


def test_the_library_logs_both_phases_with_rate_and_eta(caplog):
    """The library's log shows the pre-fault and registration phases to 100 % with their rate and
    ETA."""
    with caplog.at_level(logging.INFO, logger="hicache.effects._bringup._progress"):
        bring_up([_request(32 * MiB, 8 * MiB)], mode="pipelined", host=HostSetup(runtime=FakeRuntime(), machine=ROOMY,
                                                                                 allocator=HostTensorAllocator())).release()
    lines = [r.getMessage() for r in caplog.records if r.name == "hicache.effects._bringup._progress"]
    assert any("pre-faulted 32 MiB / 32 MiB (100 %)" in line for line in lines), lines
    assert any("registered 32 MiB / 32 MiB (100 %)" in line and "GB/s" in line and "ETA" in line for line in lines)


def test_a_progressive_bring_up_logs_its_background_calls(caplog):
    """A progressive bring-up logs its background registration to 100 %."""
    with caplog.at_level(logging.INFO, logger="hicache.effects._bringup._progress"):
        handle = bring_up([_request(32 * MiB, 32 * MiB)], mode=Progressive(max_stall_s=0.001),
                          host=HostSetup(runtime=FakeRuntime(FakeCudart(register_bytes_per_s=4e9)), machine=ROOMY,
                                         turnstile=None, allocator=HostTensorAllocator()))
        try:
            assert handle.wait(30)
        finally:
            handle.release()
    lines = [r.getMessage() for r in caplog.records if r.name == "hicache.effects._bringup._progress"]
    assert any("registered 32 MiB / 32 MiB (100 %)" in line for line in lines), lines


class _Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


class _Event:
    def __init__(self, done, total, elapsed, **call) -> None:
        self.bytes_done, self.bytes_total, self.elapsed_s = done, total, elapsed
        self.__dict__.update(call)


def test_the_display_says_bytes_rate_eta_and_how_long_the_call_in_flight_has_taken():
    """apply's progress line says the phase, bytes, rate and ETA, and which call waits and for how
    long (an injected clock)."""
    clock = _Clock()
    progress = BringupProgress(4, stream=io.StringIO(), clock=clock)
    assert progress.line().startswith("preparing: budget lock")
    progress(_Event(512 * MiB, 2048 * MiB, 0.5))  # a pre-fault piece
    assert "pre-faulted 512 MiB / 2 GiB (25 %) 1.07 GB/s ETA 2 s" in progress.line()
    assert "call 1 waits for its pre-fault" in progress.line()
    progress(_Event(1024 * MiB, 2048 * MiB, 1.0, buffer="kv", chunk_index=1, chunk_count=4))
    clock.now += 7  # a long call: the display must not freeze
    line = progress.line()
    assert "registered 1 GiB / 2 GiB (50 %)" in line and "calls 1/4" in line and "call 2 in flight 7 s" in line


def test_the_display_redraws_at_least_every_tick_while_nothing_happens():
    """Off a terminal the progress display writes a line every tick while nothing moves."""
    stream = io.StringIO()
    progress = BringupProgress(2, stream=stream, every_s=0.02).start()
    progress(_Event(0, 10, 0.0))
    deadline = time.monotonic() + 120  # a hang guard: without the ticker no line comes
    while len(stream.getvalue().splitlines()) < 5:  # one event, then ticks alone
        assert time.monotonic() < deadline, stream.getvalue()
        time.sleep(0.01)
    progress.close()
    lines = stream.getvalue().splitlines()
    assert len(lines) >= 5 and all("elapsed" in line for line in lines)  # not a tty: a line each tick


def test_a_progressive_apply_reports_while_it_waits_for_the_background():
    """A progressive apply prints registered bytes with an ETA while it waits for the background
    calls."""
    stream = io.StringIO()
    handle = bring_up([_request(64 * MiB, 64 * MiB)], mode=Progressive(max_stall_s=0.005),
                      host=HostSetup(runtime=FakeRuntime(FakeCudart(register_bytes_per_s=0.5e9)), machine=ROOMY,
                                     turnstile=None, allocator=HostTensorAllocator()))
    try:
        wait_progressive(handle, handle.total_bytes, stream=stream, every_s=0.02)
    finally:
        handle.release()
    lines = stream.getvalue().splitlines()
    assert len(lines) >= 3 and all(line.startswith("registered ") and "ETA" in line for line in lines), lines


def test_the_library_says_it_is_still_working_during_a_long_call(caplog):
    """A call that takes seconds (a 64 GiB one) leaves no event to log: the heartbeat logs a
    line each second nothing else was, naming the seconds since the last call. The fake's one
    call lasts until a heartbeat was logged (a hang guard bounds it): however busy the machine,
    the test waits for the event, not for seconds."""

    class LongCall(FakeCudart):
        def cudaHostRegister(self, ptr, size, flags):
            deadline = time.monotonic() + 120
            while not any("still working" in r.getMessage() for r in list(caplog.records)):
                assert time.monotonic() < deadline, "hang guard: no heartbeat during the call"
                time.sleep(0.01)
            return super().cudaHostRegister(ptr, size, flags)

    with caplog.at_level(logging.INFO, logger="hicache.effects._bringup._progress"):
        bring_up([_request(48 * MiB, 48 * MiB)], mode="blocking",
                 host=HostSetup(runtime=FakeRuntime(LongCall()), machine=ROOMY, turnstile=None,
                                allocator=HostTensorAllocator())).release()
    beats = [r.getMessage() for r in caplog.records if "still working" in r.getMessage()]
    assert beats and all("s since the last register call" in line for line in beats), beats
