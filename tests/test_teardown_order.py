"""Teardown order, watched from outside (issue #23): no pre-fault call runs on memory once it is
freed, no register call happens after a release began unregistering, nothing is freed while any
of it is still registered, and memory a release could not unregister stays mapped.

A slow pre-fault stands in for a big buffer: `_faulting.prefault` is wrapped to sleep before each
piece and to record any piece whose memory was already freed (it then touches nothing: the real
fault would be a use-after-unmap). The fake driver's log gets a ``free`` entry when a buffer is
unmapped, so unregister-before-free is read off one sequence."""

from __future__ import annotations

import threading
import time

import pytest
from machine import ROOMY

from hicache.effects import BufferRequest, HostTensorAllocator, Progressive, bring_up
from hicache.effects import HostSetup
from hicache.effects._bringup import _faulting
from hicache.effects import HostLedger
from hicache.effects._cuda._progressive import Chunk, ProgressiveRegistration
from hicache.effects._host import _memory
from hicache.errors import ApplyError, ReleaseError
from hicache.plan import Limits, plan_registration
from hicache.testing import FakeRuntime

pytestmark = pytest.mark.concurrency  # processes, threads, signals or waits: `make test-loaded`

torch = pytest.importorskip("torch")

MiB = 2**20
LIMITS = Limits(chunk_limit_bytes=MiB)


@pytest.fixture
def slow_prefault(monkeypatch):
    """Every pre-fault piece waits 30 ms first; returns the pieces that found their memory freed."""
    real = _faulting.prefault
    freed_under_fault = []

    def slow(buffer, **kwargs):
        time.sleep(0.03)
        if buffer.freed:
            freed_under_fault.append(kwargs)
            return None
        return real(buffer, **kwargs)

    monkeypatch.setattr(_faulting, "prefault", slow)
    return freed_under_fault


@pytest.fixture
def frees_logged(monkeypatch):
    """Append ("free", ptr, mapped_bytes) to the given fake's log whenever a buffer is unmapped."""
    logs = []
    real = _memory.HostBuffer.free

    def free(self, **kwargs):
        ptr, size, was = (self.ptr, self.mapped_bytes, self.freed) if not self.freed else (0, 0, True)
        real(self, **kwargs)
        if not was and self.freed:
            for log in logs:
                log.append(("free", ptr, size))

    monkeypatch.setattr(_memory.HostBuffer, "free", free)
    return logs


def _requests(mib: int, buffers: int = 1):
    plan = plan_registration(mib * MiB, granularity_bytes=64 * 1024, limits=LIMITS)
    return [BufferRequest(f"b{i}", (plan.total_bytes,), None, plan) for i in range(buffers)]


def _threads(name: str) -> list:
    return [t for t in threading.enumerate() if t.name == name and t.is_alive()]


def test_a_progressive_release_stops_its_background_calls_before_it_unregisters():
    """ProgressiveRegistration.release(): once it returns nothing is registered, its thread has
    ended, and no register call comes after the first unregister (a thread still running would
    register behind the release's back: pinned memory nobody owns)."""
    runtime = FakeRuntime(register_bytes_per_s=MiB / 0.01)  # 10 ms a call
    base = 1 << 44
    chunks = [Chunk("b", base + i * MiB, MiB, 64 * 1024, LIMITS) for i in range(200)]
    registration = ProgressiveRegistration(chunks, runtime=runtime, ledger=HostLedger(), max_stall_s=None).start()
    time.sleep(0.05)
    assert not registration.done  # the background part is registering
    registration.release()
    assert registration.done and runtime.held() == set()
    time.sleep(0.05)
    assert runtime.held() == set()
    log = [entry[0] for entry in runtime.cudart.log]
    assert "register" not in log[log.index("unregister"):]


def test_releasing_a_progressive_bring_up_waits_for_its_pre_fault_before_freeing(slow_prefault):
    """Releasing a progressive bring-up waits for its pre-fault thread before freeing: no piece runs
    on freed memory."""
    runtime = FakeRuntime(register_bytes_per_s=MiB / 0.005)
    handle = bring_up(_requests(64), mode=Progressive(), host=HostSetup(runtime=runtime, ledger=HostLedger(),
                                                                        allocator=HostTensorAllocator(prefault_threads=1)),
                      budget=False)
    assert _threads("hicache-prefault-pipeline")  # still faulting in the background
    handle.release()
    assert not _threads("hicache-prefault-pipeline") and not _threads("hicache-progressive")
    time.sleep(0.1)
    assert slow_prefault == []  # no piece ever ran on freed memory
    assert runtime.held() == set() and handle.allocator.owned() == []


def test_a_failed_pipelined_bring_up_waits_for_its_pre_fault_before_freeing(slow_prefault):
    """A failed pipelined bring-up stops and joins its pre-fault thread before freeing the
    memory."""
    allocator = HostTensorAllocator(prefault_threads=1)
    runtime = FakeRuntime(fail_register={1: 2})  # refused while pieces 1-4 of 5 (32 MiB each) are to come
    with pytest.raises(ApplyError):
        bring_up(_requests(160), mode="pipelined", host=HostSetup(runtime=runtime, ledger=HostLedger(),
                                                                  allocator=allocator), budget=False)
    assert not _threads("hicache-prefault-pipeline")
    time.sleep(0.1)
    assert slow_prefault == []
    assert runtime.held() == set() and allocator.owned() == []


def test_a_progressive_release_that_leaks_keeps_the_memory_mapped_and_quarantined():
    """A progressive release that cannot unregister leaves the handle leaked with its memory mapped
    and quarantined."""
    runtime = FakeRuntime(fail_unregister={0: 1})  # the first unregister is refused (not sticky)
    handle = bring_up(_requests(4), mode=Progressive(), host=HostSetup(runtime=runtime, ledger=HostLedger()),
                      budget=False)
    assert handle.wait(10)
    with pytest.raises(ReleaseError):
        handle.release()
    assert handle.state == "leaked" and runtime.held()
    kept = handle.allocator.owned()
    assert kept and not any(b.freed for b in kept)
    assert all(any(b is q for q in _memory.QUARANTINE) for b in kept)
    handle.release()  # retried: now it goes
    assert runtime.held() == set() and handle.allocator.owned() == []


@pytest.mark.parametrize("mode", ["blocking", "pipelined", "progressive"])
def test_release_unregisters_every_range_before_it_frees_the_memory(frees_logged, mode):
    """In every mode release unregisters each range before its memory is freed."""
    runtime = FakeRuntime(register_bytes_per_s=MiB / 0.002)
    frees_logged.append(runtime.cudart.log)
    handle = bring_up(_requests(8, buffers=2), mode=Progressive() if mode == "progressive" else mode,
                      host=HostSetup(runtime=runtime, ledger=HostLedger()), budget=False)
    handle.release()  # progressive: while its background calls are still going
    log = runtime.cudart.log
    frees = [(i, ptr, size) for i, (op, ptr, *rest) in enumerate(log) if op == "free" for size in rest[:1]]
    assert len(frees) == 2 and runtime.held() == set()
    for position, ptr, size in frees:
        later = [e for e in log[position:] if e[0] == "unregister" and ptr <= e[1] < ptr + size]
        assert later == [], f"{mode}: unregistered after its memory was freed"
        registered = any(e[0] == "register" and ptr <= e[1] < ptr + size for e in log[:position])
        unregistered = any(e[0] == "unregister" and ptr <= e[1] < ptr + size for e in log[:position])
        assert unregistered == registered  # progressive: a buffer the release came before has no calls
