"""hicache.compat.sglang: SGLang's helpers, SGLang's pinned behaviour, SGLang's defects fixed.

Like SGLang's own tests, these substitute a fake for torch.cuda.cudart() that returns ints.
"""

from __future__ import annotations

import os
import logging

import pytest

import hicache.compat.sglang as sg
from hicache.errors import PlanError
from hicache.testing import FakeHostBuffer

pytestmark = pytest.mark.concurrency  # processes, threads, signals or waits: `make test-loaded`

torch = pytest.importorskip("torch")

MiB, GiB = 2**20, 2**30
BASE = 1 << 44


FakeBuffer = FakeHostBuffer  # SGLang's tensor surface at BASE


@pytest.fixture(autouse=True)
def _fresh_process_ledger():
    """Each test is its own process as far as held ranges go (fake pointers are reused)."""
    from hicache.effects._cuda._ledger import PROCESS_LEDGER

    before = set(PROCESS_LEDGER.held())
    yield
    added = [ptr for ptr, _ in PROCESS_LEDGER.held() if (ptr, _) not in before]
    PROCESS_LEDGER.replace(added, [])


def registrations(fake):
    return [(ptr - BASE, size) for op, ptr, *rest in fake.log if op == "register" for size in rest[:1]]


def test_2500_mib_at_300_mib_registers_900_900_700(cudart):
    """SGLang's case: 2500 MiB at 300 MiB granularity under 1 GiB is 900/900/700 MiB at 0/900/1800."""
    buffer = FakeBuffer(2500 * MiB)
    sg._cuda_host_register(buffer, registration_granularity_bytes=300 * MiB)
    assert registrations(cudart) == [(0, 900 * MiB), (900 * MiB, 900 * MiB), (1800 * MiB, 700 * MiB)]
    assert getattr(buffer, sg._CUDA_HOST_REGISTERED_RANGES_ATTR) == [
        (BASE, 900 * MiB), (BASE + 900 * MiB, 900 * MiB), (BASE + 1800 * MiB, 700 * MiB)
    ]
    sg._cuda_host_unregister(buffer)
    assert cudart.held() == set()


def test_second_chunk_failure_rolls_back_and_names_the_offset(cudart):
    """Chunk 2 fails: chunk 1 is unregistered and the RuntimeError names offset=1073741824."""
    cudart.fail_register = {1: 2}
    buffer = FakeBuffer(2 * GiB + 17)
    with pytest.raises(RuntimeError, match="offset=1073741824"):
        sg._cuda_host_register(buffer, registration_granularity_bytes=GiB)
    assert cudart.held() == set()
    assert [op for op, *_ in cudart.log] == ["register", "register", "unregister"]
    cudart.check_valid()  # the failed call's pending error was drained


def test_no_granularity_registers_in_one_call(cudart):
    """Without a granularity a 2 GiB + 17 B buffer is one call, as in SGLang."""
    buffer = FakeBuffer(2 * GiB + 17)
    sg._cuda_host_register(buffer)
    assert registrations(cudart) == [(0, 2 * GiB + 17)]
    sg._cuda_host_unregister(buffer)


@pytest.mark.parametrize("granularity", [0, -4096, 2 * GiB])
def test_bad_granularity_is_a_value_error(cudart, granularity):
    """granularity <= 0 or above the limit is a ValueError before any CUDA call."""
    with pytest.raises(ValueError, match="granularity"):
        sg._cuda_host_register(FakeBuffer(4 * GiB), registration_granularity_bytes=granularity)
    assert cudart.log == []


def test_int_error_codes_are_named_without_cuda_get_error_string(cudart):
    """The fake's cudaGetErrorString(int) raises TypeError (as cuda-python's); we name the code."""
    cudart.fail_register = {0: 2}
    with pytest.raises(RuntimeError, match="cudaErrorMemoryAllocation") as info:
        sg._cuda_host_register(FakeBuffer(GiB), registration_granularity_bytes=MiB)
    assert not isinstance(info.value.__cause__, TypeError)


def test_already_registered_buffer_is_a_no_op(cudart):
    """Registering a buffer whose record holds ranges does nothing (no sticky 712)."""
    buffer = FakeBuffer(GiB)
    sg._cuda_host_register(buffer, registration_granularity_bytes=MiB)
    calls = len(cudart.log)
    sg._cuda_host_register(buffer, registration_granularity_bytes=MiB)
    assert len(cudart.log) == calls
    cudart.check_valid()
    sg._cuda_host_unregister(buffer)


def test_keyboard_interrupt_mid_registration_rolls_back(cudart):
    """Ctrl-C after chunk 2 took effect: everything is unregistered, KeyboardInterrupt raised."""
    cudart.interrupt_register = {1: "after"}
    buffer = FakeBuffer(3 * GiB)
    with pytest.raises(KeyboardInterrupt):
        sg._cuda_host_register(buffer, registration_granularity_bytes=GiB)
    assert cudart.held() == set()
    assert not getattr(buffer, sg._CUDA_HOST_REGISTERED_RANGES_ATTR, None)


def test_unsplittable_buffer_at_the_driver_ceiling_fails_before_cuda(cudart):
    """No granularity and >= 512 GiB: a clear error, and CUDA never sees the call."""
    with pytest.raises(PlanError, match="granularity_bytes"):
        sg._cuda_host_register(FakeBuffer(512 * GiB))
    assert cudart.log == []


def test_teardown_unregisters_each_chunk_once_in_reverse(cudart):
    """Teardown unregisters every chunk once, last first; a second teardown does nothing."""
    buffer = FakeBuffer(3 * GiB)
    sg._cuda_host_register(buffer, registration_granularity_bytes=GiB)
    sg._cuda_host_unregister(buffer)
    sg._cuda_host_unregister(buffer)
    unregistered = [ptr - BASE for op, ptr, *_ in cudart.log if op == "unregister"]
    assert unregistered == [2 * GiB, GiB, 0]


def test_teardown_without_a_record_uses_the_whole_buffer(cudart):
    """A buffer registered elsewhere (no record) is unregistered as one (data_ptr, nbytes)."""
    buffer = FakeBuffer(GiB)
    cudart.registered[BASE] = GiB
    sg._cuda_host_unregister(buffer)
    assert cudart.held() == set()
    assert [entry for entry in cudart.log] == [("unregister", BASE)]


def test_unregister_ranges_returns_and_logs_what_failed(cudart, caplog):
    """Failed unregisters are returned in order and logged with the CUDA error name."""
    for i in range(3):
        cudart.registered[BASE + i * GiB] = GiB
    cudart.fail_unregister = {1: 1}
    ranges = [(BASE + i * GiB, GiB) for i in range(3)]
    with caplog.at_level(logging.WARNING, logger="hicache.compat.sglang"):
        remaining = sg._cuda_host_unregister_ranges(cudart, ranges, operation="teardown")
    assert remaining == [(BASE + GiB, GiB)]
    assert "teardown left 1 host range(s) registered" in caplog.text


def test_failed_teardown_keeps_the_leak_recorded(cudart):
    """A chunk whose unregister failed stays recorded, so a later teardown can retry it."""
    buffer = FakeBuffer(2 * GiB)
    sg._cuda_host_register(buffer, registration_granularity_bytes=GiB)
    cudart.fail_unregister = {cudart.unregister_calls: 1}
    sg._cuda_host_unregister(buffer)
    assert getattr(buffer, sg._CUDA_HOST_REGISTERED_RANGES_ATTR) == [(BASE + GiB, GiB)]


@pytest.mark.parametrize("value, expected", [(None, 256 * GiB), ("1", GiB), ("0", GiB), ("-3", GiB), ("64", 64 * GiB)])
def test_chunk_env_is_read_as_sglang_does(value, expected):
    """SGLANG_HICACHE_HOST_REGISTER_CHUNK_GB: GiB, minimum 1, default 256."""
    env = {} if value is None else {sg.CHUNK_ENV: value}
    assert sg.host_register_chunk_bytes(env) == expected


def test_chunk_env_that_is_not_a_number_is_named():
    """A non-integer value is an error naming the variable, not a silent default."""
    with pytest.raises(ValueError, match="SGLANG_HICACHE_HOST_REGISTER_CHUNK_GB='lots'"):
        sg.host_register_chunk_bytes({sg.CHUNK_ENV: "lots"})


def test_alloc_functions_by_device(cudart):
    """CUDA and unknown devices register; npu and musa pin through the framework."""
    assert sg.ALLOC_MEMORY_FUNCS["cuda"] is sg.alloc_with_host_register
    assert sg.ALLOC_MEMORY_FUNCS["xpu"] is sg.alloc_with_host_register
    assert sg.ALLOC_MEMORY_FUNCS["npu"] is sg.alloc_with_pin_memory
    assert sg.ALLOC_MEMORY_FUNCS["musa"] is sg.alloc_with_pin_memory
    allocator = sg.get_allocator_from_storage("default")
    tensor = sg.alloc_with_host_register((4, 1024), torch.bfloat16, "cpu", True, allocator,
                                         registration_granularity_bytes=2048)
    assert tensor.shape == (4, 1024) and tensor.data_ptr() % 4096 == 0
    assert len(getattr(tensor, sg._CUDA_HOST_REGISTERED_RANGES_ATTR)) == 1
    sg._cuda_host_unregister(tensor)
    plain = sg.alloc_with_host_register((2, 2), torch.float32, "cpu", False, allocator)
    assert not hasattr(plain, sg._CUDA_HOST_REGISTERED_RANGES_ATTR)
    pinned = sg.alloc_with_pin_memory((2, 2), torch.float32, "cpu", False, sg.get_allocator_from_storage("torch"))
    assert pinned.shape == (2, 2)
    allocator.free_all()


@pytest.mark.parametrize("backend", [None, "file", "hf3fs", "nixl", "mooncake", "eic", "mori", "simm", "aibrix", "dynamic"])
def test_every_storage_backend_name_gets_the_default_allocator(backend, caplog):
    """As SGLang's: names without an allocator of their own get the default one (logged)."""
    with caplog.at_level(logging.INFO, logger="hicache.pools._allocator"):
        assert isinstance(sg.get_allocator_from_storage(backend), sg.HostTensorAllocator)
    if backend is not None:
        assert f"storage back end {backend!r}: using 'default'" in caplog.text


def test_the_strict_allocator_check_is_opt_in():
    """hicache's stricter check: an unknown name is an error listing the known ones."""
    with pytest.raises(PlanError, match="unknown allocator_type 'nvme'; known: default, torch"):
        sg.get_allocator_from_storage("nvme", strict=True)


def test_call_progress_says_a_line_at_most_once_a_second_and_always_the_last(caplog):
    """The plug-in's progress lines: none for a one-call buffer; for many calls at most one a
    second (by an injected clock) and always the last, each with counts, bytes and time."""
    from hicache.compat._sglang_log import CallProgress
    from hicache.effects._cuda._executor import ProgressEvent

    now = [0.0]
    progress = CallProgress(logging.getLogger("test.progress"), clock=lambda: now[0])
    with caplog.at_level("INFO", logger="test.progress"):
        progress(ProgressEvent("b", 0, 1, 1, 10, 10, 0.1))  # one call: nothing to report
        for index in range(1, 11):
            now[0] = index * 0.4  # a call every 0.4 s
            progress(ProgressEvent("b", 0, index, 10, index * GiB, 10 * GiB, index * 0.4))
    said = [r.getMessage() for r in caplog.records]
    assert [line.split()[2] for line in said] == ["1/10", "4/10", "7/10", "10/10"]
    assert said[-1] == "hicache: registered 10/10 calls, 10 GiB of 10 GiB in 4.0 s (2.68 GB/s)"


def test_ranges_unregistered_from_the_tensors_records_can_be_registered_again(cudart):
    """A rollback that leaks leaves the range recorded on the tensor (and held in hicache's
    process ledger); SGLang's teardown then unregisters it from that record - no Registration
    involved - and must tell the ledger too: the same memory registers again afterwards instead
    of being refused as "already held" (what made test_guards + test_compat_sglang fail in that
    order). A range whose unregister fails again stays held."""
    from hicache.effects._cuda._ledger import PROCESS_LEDGER
    from hicache.errors import RollbackError

    buffer = FakeBuffer(3 * GiB)
    cudart.fail_register, cudart.fail_unregister = {2: 2}, {0: 1}  # the rollback leaks chunk 1
    with pytest.raises(RollbackError):
        sg._cuda_host_register(buffer, registration_granularity_bytes=GiB)
    assert PROCESS_LEDGER.overlapping(BASE, 3 * GiB) == (BASE + GiB, GiB)
    cudart.fail_unregister = {cudart.unregister_calls: 1}  # teardown fails once more
    sg._cuda_host_unregister(buffer)
    assert PROCESS_LEDGER.overlapping(BASE, 3 * GiB) == (BASE + GiB, GiB)  # still registered: held
    sg._cuda_host_unregister(buffer)  # retried: now it goes
    assert cudart.held() == set() and PROCESS_LEDGER.overlapping(BASE, 3 * GiB) is None
    cudart.fail_register = {}
    again = FakeBuffer(3 * GiB)
    sg._cuda_host_register(again, registration_granularity_bytes=GiB)  # not refused as held
    sg._cuda_host_unregister(again)
    assert cudart.held() == set()


def test_sglangs_own_registrations_take_their_turn_at_the_hosts_driver(cudart, monkeypatch):
    """Under the plug-in SGLang's ranks register their own buffers through hicache: those calls
    wait for the host's turnstile like a pool's (another process's turn is held here by a
    thread: a turn of another thread counts as anyone else's)."""
    import threading
    import time

    from hicache.effects._hostwide._turnstile import from_env

    monkeypatch.setenv("HICACHE_PIN_CONCURRENCY", "1")
    turnstile = from_env()
    held, release = threading.Event(), threading.Event()

    def holder():
        turn = turnstile.acquire()
        held.set()
        release.wait(30)
        turn.release()

    other = threading.Thread(target=holder, daemon=True)
    other.start()
    assert held.wait(10)
    buffer = FakeBuffer(64 * MiB)
    registering = threading.Thread(target=sg._cuda_host_register, args=(buffer,),
                                   kwargs={"registration_granularity_bytes": MiB}, daemon=True)
    registering.start()
    deadline = time.monotonic() + 60  # a hang guard
    while len([n for n in os.listdir(turnstile.path) if n.startswith("t.")]) < 2:  # its ticket is behind the holder's
        assert time.monotonic() < deadline and registering.is_alive()
        time.sleep(0.005)
    assert cudart.held() == set()  # it waits its turn
    release.set()
    registering.join(30)
    other.join(30)
    assert sum(size for _, size in cudart.held()) == 64 * MiB
    sg._cuda_host_unregister(buffer)


@pytest.mark.parametrize("call_cap, binding", [("4GiB", "call_cap"), ("512GiB", "chunk_limit")])
def test_the_plan_line_names_every_cap_that_can_bind_with_its_source(monkeypatch, call_cap, binding):
    """The plug-in's plan line lists the call cap beside the chunk limit, the driver ceiling and
    the kernel cap, each with where it came from - so the cap it says binds is always one it
    listed (the call cap, 4 GiB by default, bound a 5 GiB buffer unlisted)."""
    from hicache.compat._sglang_log import plan_line

    monkeypatch.setenv("HICACHE_CALL_CAP", call_cap)
    monkeypatch.setenv("SGLANG_HICACHE_HOST_REGISTER_CHUNK_GB", "256")
    plan, sources = sg._chunk_plan(5 * 2**30, 2**20, 4096)
    line = plan_line(plan, sources)
    assert f"call cap {call_cap.replace('GiB', ' GiB')} (HICACHE_CALL_CAP)" in line, line
    assert f"binding: {binding};" in line
    listed = line.split("caps: ", 1)[1].split("; binding", 1)[0]
    assert all(label in listed for label in ("chunk 256 GiB", "driver ceiling", "kernel cap", "call cap"))


def test_the_plan_line_knows_every_cap_a_plan_can_have():
    """The line's caps are exactly those `Limits.caps()` reports with every one set: a cap added
    to the plan is a cap the server's log shows."""
    from hicache.compat._sglang_log import _CAPS
    from hicache.plan import Limits

    every = Limits(chunk_limit_bytes=2**30, kernel_cap_bytes=2**30, call_cap_bytes=2**30)
    assert {name for name, _ in _CAPS} == set(every.caps())
