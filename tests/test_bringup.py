"""The one bring-up: budget under the lock until resident, one transaction, ordered release;
the fake CUDA every entry point shares; caps from one source, end to end."""

from __future__ import annotations

import errno
import fcntl
import json
import os

import pytest
from machine import GB, ROOMY, facts

from hicache.effects import BudgetLock
from hicache.effects._bringup import _admission, _bring_up, _faulting as _pipeline  # the pre-fault pipeline's own internals, under test
from hicache.effects._host._memory import QUARANTINE, unquarantine
from hicache.effects import BufferRequest, HostTensorAllocator, bring_up, probe_cuda
from hicache.effects import HostSetup
from hicache.effects import HostLedger
from hicache.errors import CapacityError, ReleaseError, RollbackError
from hicache.plan import Limits, MHALayout, plan_pool, plan_registration
from hicache.pools import MHATokenToKVPoolHost
from hicache.testing import FakeRuntime, MHADevicePool, fake_cuda

pytestmark = pytest.mark.concurrency  # processes, threads, signals or waits: `make test-loaded`

torch = pytest.importorskip("torch")
LIMITS = Limits(chunk_limit_bytes=64 * 1024, os_page_bytes=4096)


def _pool_plan(pages=64):
    layout = MHALayout("page_first_direct", layer_num=2, head_num=2, head_dim=64, page_size=4, page_num=pages, itemsize=2)
    return plan_pool(layout, LIMITS)


@pytest.fixture
def lock(tmp_path):
    directory = tmp_path / "run"
    directory.mkdir(mode=0o700)
    return BudgetLock(directory)


def _entries(lock):
    """pid -> bytes claimed, as the budget file says."""
    with lock:
        return {pid: claim.claimed for pid, claim in lock._entries().items()}


def test_bring_up_registers_everything_and_release_undoes_it_in_order(lock):
    """bring_up registers every call of the plan, claims its bytes in the budget file and the
    ledger; release undoes all three."""
    runtime, ledger = FakeRuntime(), HostLedger()
    plan = _pool_plan()
    handle = bring_up(plan, host=HostSetup(runtime=runtime, machine=ROOMY, lock=lock, ledger=ledger))
    assert handle.state == "active" and handle.registration.status().call_count == plan.call_count
    assert _entries(lock) == {os.getpid(): plan.total_bytes}
    assert len(runtime.held()) == plan.call_count and len(ledger.held()) == 1
    handle.release()
    handle.release()  # idempotent
    assert runtime.held() == set() and ledger.held() == () and _entries(lock) == {}
    assert [op[0] for op in runtime.cudart.log].count("unregister") == plan.call_count


@pytest.mark.parametrize("mode", ["blocking", "pipelined"])
def test_the_budget_lock_decides_and_the_claim_fills_outside_it(lock, mode, monkeypatch):
    """Every pre-fault runs with the host-wide lock free (issue #35: a rank starting meanwhile
    samples at once, side by side) and after the claim is recorded: a peer sampling mid-fill
    counts the pool's bytes that are not resident yet as pending - all of them before the first
    byte is faulted - and none once the bring-up is up; released, the claim is gone. (Blocking
    too: with an allocator that maps unfaulted, its pre-fault is the pipelined one's, waited for.)"""
    seen = []

    def lock_state():
        fd = os.open(lock.path, os.O_RDWR)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            fcntl.flock(fd, fcntl.LOCK_UN)
            return "free"
        except OSError as error:
            return "held" if error.errno in (errno.EWOULDBLOCK, errno.EAGAIN) else error
        finally:
            os.close(fd)

    def peer_pending():  # a peer takes the lock (it would wait behind a fill holding it: a hang guard)
        with BudgetLock(lock.path.parent, timeout_s=60) as peer:
            return peer.pending_bytes(), peer.claims()[os.getpid()].claimed

    real = _pipeline.prefault

    def watched(buffer, **kw):
        seen.append(peer_pending())
        return real(buffer, **kw)

    monkeypatch.setattr(_pipeline, "prefault", watched)
    plan = _pool_plan()
    handle = bring_up(plan, host=HostSetup(runtime=FakeRuntime(), machine=ROOMY, lock=lock, ledger=HostLedger()),
                      mode=mode)
    try:
        assert seen and all(claimed == plan.total_bytes and 0 < pending <= plan.total_bytes for pending, claimed in seen)
        assert seen[0][0] == plan.total_bytes  # before the first byte: all of it pending
        assert peer_pending() == (0, plan.total_bytes)  # up: resident, the kernel counts it
    finally:
        handle.release()
    assert lock_state() == "free" and _entries(lock) == {}


def test_the_budget_divides_by_ranks_and_counts_peers_that_allocated(lock):
    """The budget splits the available memory by the ranks per host and counts a live peer's claim:
    a fourth rank's share that does not fit is refused naming 4 ranks."""
    plan = _pool_plan()
    size = plan.total_bytes
    reserve = 1 << 20
    tight = facts(available_bytes=reserve + 4 * size - 1, ranks_per_host=4)  # < size per rank of 4

    def attempt():
        handle = bring_up(plan,
                          host=HostSetup(runtime=FakeRuntime(), machine=tight, lock=lock, reserve_bytes=reserve,
                                         ledger=HostLedger()))
        handle.release()

    with pytest.raises(CapacityError, match="4 rank"):
        attempt()
    with lock:  # a live peer (our parent) already allocated: 3 ranks share what is left
        lock._write({os.getppid(): size})
    attempt()
    assert _entries(lock) == {os.getppid(): size}


def test_a_refused_budget_allocates_and_registers_nothing(lock):
    """A refused budget makes no CUDA call, maps nothing and leaves no claim."""
    runtime = FakeRuntime()
    allocator = HostTensorAllocator()
    with pytest.raises(CapacityError):
        bring_up(_pool_plan(), host=HostSetup(runtime=runtime, machine=facts(available_bytes=GB), lock=lock,
                                              allocator=allocator))
    assert runtime.cudart.log == [] and allocator.owned() == [] and _entries(lock) == {}


def test_a_rollback_that_leaks_quarantines_the_buffers_and_drops_the_budget(lock):
    """A rollback whose undo fails: the still-registered ranges are reported and held in the ledger,
    their buffers quarantined (never freed), the budget claim dropped."""

    runtime, ledger = FakeRuntime(fail_register={2: 2}, fail_unregister={0: 1}), HostLedger()
    allocator = HostTensorAllocator()
    before = len(QUARANTINE)
    with pytest.raises(RollbackError) as info:
        bring_up(_pool_plan(), host=HostSetup(runtime=runtime, machine=ROOMY, lock=lock, ledger=ledger,
                                              allocator=allocator))
    leaked = set(info.value.leaked)
    assert leaked and runtime.held() == leaked and set(ledger.held()) == leaked
    kept = QUARANTINE[before:]
    assert any(b in kept for b in allocator.owned()) and all(not b.freed for b in allocator.owned())
    assert _entries(lock) == {}


def test_a_ctrl_c_whose_rollback_leaks_quarantines_the_buffers_too(lock):
    """A failed call, then a Ctrl-C during its rollback while another undo fails: the interrupt
    reaches the caller carrying the rollback's error as its cause, and the memory still
    registered stays mapped (quarantined, never freed) exactly as for a failed call - nothing
    CUDA may still pin is given back, and the release does not claim it was."""
    from hicache.errors import caused_by_interrupt

    runtime, ledger = FakeRuntime(fail_register={2: 2}, interrupt_unregister={0: "after"}, fail_unregister={1: 1}), HostLedger()
    allocator = HostTensorAllocator()
    before = len(QUARANTINE)
    with pytest.raises(BaseException) as info:
        bring_up(_pool_plan(), host=HostSetup(runtime=runtime, machine=ROOMY, lock=lock, ledger=ledger,
                                              allocator=allocator))
    assert caused_by_interrupt(info.value)
    chain, rollback = info.value, None
    while chain is not None and rollback is None:
        rollback = chain if isinstance(chain, RollbackError) else None
        chain = chain.__cause__ or chain.__context__
    assert isinstance(info.value, KeyboardInterrupt) and isinstance(info.value.__cause__, RollbackError)
    # the interrupted undo may not have taken effect: the books count it registered too
    assert set(ledger.held()) == set(rollback.leaked) >= runtime.held() != set()
    kept = QUARANTINE[before:]
    assert any(b in kept for b in allocator.owned()) and all(not b.freed for b in allocator.owned())
    assert _entries(lock) == {}


def test_a_quarantine_stays_while_the_memory_is_still_registered_elsewhere(lock):
    """A release that leaked quarantines the buffers; a retry that undoes the leak lifts the
    quarantine only once the buffers are really freed - not while another registration of
    this process still holds part of them (the ledger refuses to free them then)."""

    runtime, ledger = FakeRuntime(fail_unregister={0: 1}), HostLedger()
    allocator = HostTensorAllocator()
    handle = bring_up(_pool_plan(), host=HostSetup(runtime=runtime, machine=ROOMY, lock=lock, ledger=ledger,
                                                   allocator=allocator))
    with pytest.raises(ReleaseError):
        handle.release()  # the newest range stays registered: quarantined
    buffers = allocator.owned()
    assert buffers and all(any(b is q for q in QUARANTINE) for b in buffers)
    first = min(b.ptr for b in buffers)
    assert ledger.claim([(first, 4096)]) is None  # registered elsewhere meanwhile (compat's, say)
    try:
        handle.release()  # the leak is undone now, but the buffers cannot be freed
        assert all(any(b is q for q in QUARANTINE) for b in buffers) and not any(b.freed for b in buffers)
    finally:
        ledger.forget([(first, 4096)])
        allocator.free_all(ledger=ledger)
        unquarantine(*buffers)


def test_a_base_less_aligned_than_planned_is_replanned_not_refused():
    """A 64-byte aligned torch.empty base (compat's allocators): boundaries on the copy unit."""
    unit = 1536  # not a multiple of the OS page: page alignment would need lcm(1536, 4096)
    plan = plan_registration(unit * 40, granularity_bytes=unit, limits=Limits(chunk_limit_bytes=8192))

    class Offset:  # hands out tensors at a base that is 64 but not 128-byte aligned
        def __init__(self):
            self.keep = []

        def allocate(self, dims, dtype, device="cpu"):
            raw = torch.empty(dims[0] + 256, dtype=torch.uint8)
            shift = next(s for s in range(256) if (raw.data_ptr() + s) % 128 == 64)
            self.keep.append(raw)
            return raw[shift: shift + dims[0]]

        def free_all(self, ledger=None):
            self.keep = []

    runtime = FakeRuntime()
    handle = bring_up([BufferRequest("b", (plan.total_bytes,), None, plan)],
                      host=HostSetup(runtime=runtime, ledger=HostLedger(), allocator=Offset()), budget=False)
    (used,) = handle.plans
    assert handle.tensors[0].data_ptr() % 128 == 64
    assert used.limits.base_alignment_bytes == 64 and used.step_bytes % unit == 0
    assert any("copy unit only" in note for note in used.notes)
    assert sorted(size for _, size in runtime.held()) == sorted(r.size for r in used.ranges)
    handle.release()
    assert runtime.held() == set()


# -- hicache.testing.fake_cuda: one fake for every default runtime -----------------------------
def test_fake_cuda_is_what_pools_compat_apply_and_probes_use_by_default(lock, capsys):
    """Inside fake_cuda() the pools, compat's helpers, hicache apply and probe_cuda all use the fake
    driver, and what it holds is exactly what they registered."""
    from hicache.cli import main
    from hicache.compat.sglang import HostTensorAllocator as CompatAllocator
    from hicache.compat.sglang import _cuda_host_unregister, alloc_with_host_register

    with fake_cuda() as fake:
        assert probe_cuda().available and probe_cuda().device_count == 1
        device = MHADevicePool(size=64, layer_num=2, head_num=2, head_dim=8, page_size=4)
        pool = MHATokenToKVPoolHost(device, 2.0, 0, 4, "page_first_direct", True, "cpu",
                                    host=HostSetup(limits=LIMITS, machine=ROOMY, lock=lock))
        assert fake.held() and fake.held() == {(r.ptr, r.size) for r in pool.registration.ranges}
        pool.destroy()
        buffer = alloc_with_host_register((4096,), torch.uint8, "cpu", True, CompatAllocator())
        assert len(fake.held()) == 1
        _cuda_host_unregister(buffer)
        code = main(["apply", "--model", "llama-3.1-8b", "--tp", "8", "--host-gb", "0.01",
                     "--chunk-limit", "1MiB", "--reserve", "1MiB", "--format", "json"])
        out = json.loads(capsys.readouterr().out)
        assert code == 0 and out["calls"] > 1
        assert fake.held() == set() and fake.cudart.log[-1][0] == "unregister"
        assert fake.cudart.register_calls == out["calls"] + 1 + pool.pool_plan.call_count
    from hicache.effects._cuda import _runtime
    assert _runtime._STAND_INS == []


def test_fake_cuda_passes_faults_and_ends_with_the_block():
    """fake_cuda() passes its faults to the fake, nested blocks shadow and restore each other, and
    none is left after the last."""
    from hicache.effects._cuda import _runtime
    with fake_cuda(fail_register={0: 2}) as fake:
        assert fake.cudart.fail_register == {0: 2}
        with fake_cuda() as inner:
            assert _runtime.default_runtime() is inner
        assert _runtime.default_runtime() is fake
    assert not _runtime._STAND_INS


# -- one source of caps, end to end ------------------------------------------------------------
PLAN_ARGS = ["--model", "llama-3.1-8b", "--tp", "8", "--host-gb", "0.02"]


@pytest.mark.parametrize(
    "env, flags, cap",
    [
        ({"HICACHE_KERNEL_PIN_CAP": "1MiB"}, [], 2**20),
        ({"HICACHE_REGISTER_CHUNK": "2MiB"}, [], 2 * 2**20),
        ({"HICACHE_REGISTER_CHUNK": "8MiB"}, ["--chunk-limit", "2MiB"], 2 * 2**20),  # a flag beats the env
        ({"HICACHE_KERNEL_PIN_CAP": "1MiB"}, ["--chunk-limit", "4MiB"], 2**20),  # the kernel cap holds
        ({"HICACHE_DRIVER_CEILING": "3MiB", "HICACHE_REGISTER_CHUNK": "8MiB"}, [], 3 * 2**20),
    ],
    ids=["kernel-env", "chunk-env", "flag-beats-env", "kernel-cap-holds", "driver-ceiling-env"])
def test_apply_never_calls_above_the_cap_that_wins_and_plan_agrees(monkeypatch, capsys, env, flags, cap):
    """For each cap source (flag or variable) apply's largest register call is within the winning
    cap and plan reports the same calls."""
    from hicache.cli import main
    from hicache.plan import from_jsonable

    for name, value in env.items():
        monkeypatch.setenv(name, value)
    with fake_cuda() as fake:
        code = main(["apply", *PLAN_ARGS, *flags, "--reserve", "1MiB", "--format", "json"])
        applied = json.loads(capsys.readouterr().out)
    assert code == 0, capsys.readouterr().err
    calls = [entry[2] for entry in fake.cudart.log if entry[0] == "register"]
    assert max(calls) <= cap and len(calls) == applied["calls"] > 1
    assert main(["plan", *PLAN_ARGS, *flags, "--format", "json"]) == 0
    printed = json.loads(capsys.readouterr().out)
    planned = from_jsonable(printed)
    assert [r.size for pool in planned.pools for b in pool.plan.buffers for r in b.plan.ranges] == calls
    assert printed["cap_sources"] == applied["cap_sources"] | {"kernel_cap": printed["cap_sources"]["kernel_cap"]}


def test_apply_on_a_kernel_that_caps_pins_plans_under_it_without_a_flag(monkeypatch):
    """The README's example on Linux 6.12: every call under ~2 GB, the machine named as source."""
    import hicache.effects
    from hicache.cli import make_parser
    from hicache.cli._apply import _machine_plan
    from hicache.plan import KERNEL_PIN_CAP_BYTES

    monkeypatch.setattr(hicache.effects.for_cli, "probe_kernel_release", lambda **_: "6.12.3-generic")
    args = make_parser().parse_args(["apply", "--model", "llama-3.1-70b", "--tp", "8", "--host-gb", "100"])
    plan, sources = _machine_plan(args)
    assert plan.largest_call_bytes <= KERNEL_PIN_CAP_BYTES < 2**31 and plan.call_count > 40
    assert sources["kernel_cap"] == "this machine (Linux 6.12.3-generic)"


def test_plan_reads_the_settings_but_never_the_machine(monkeypatch, capsys):
    """hicache plan takes HICACHE_REGISTER_CHUNK and names it as the chunk limit's source."""
    from hicache.cli import main

    monkeypatch.setenv("HICACHE_REGISTER_CHUNK", "16GiB")
    assert main(["plan", "--format", "json"]) == 0
    printed = json.loads(capsys.readouterr().out)
    assert printed["caps"]["chunk_limit"] == 16 * 2**30
    assert printed["cap_sources"]["chunk_limit"] == "HICACHE_REGISTER_CHUNK"
    assert printed["cap_sources"]["kernel_cap"] == "not checked"
    monkeypatch.setenv("HICACHE_REGISTER_CHUNK", "lots")
    assert main(["plan"]) == 2
    assert "error[bad-limits]: environment variable HICACHE_REGISTER_CHUNK='lots'" in capsys.readouterr().err


def test_plan_reads_the_kernel_release_only_when_asked(monkeypatch, capsys):
    """plan leaves the kernel cap unchecked unless --this-machine asks for this kernel's release."""
    import hicache.effects
    from hicache.cli import main

    monkeypatch.setattr(hicache.effects.for_cli, "probe_kernel_release", lambda **_: "6.13.0")
    assert main(["plan", "--format", "json"]) == 0
    assert json.loads(capsys.readouterr().out)["cap_sources"]["kernel_cap"] == "not checked"
    assert main(["plan", "--this-machine", "--format", "json"]) == 0
    printed = json.loads(capsys.readouterr().out)
    assert printed["cap_sources"]["kernel_cap"] == "this machine (Linux 6.13.0)"
    assert printed["caps"]["kernel_cap"] < 2**31


def _registered_once(runtime):
    """An event set when ``runtime``'s first register call begins (the order checks below wait
    on it, bounded, instead of hoping the scheduler runs the register thread in time)."""
    import threading

    began = threading.Event()
    real = runtime.register

    def register(ptr, size, flags):
        began.set()
        return real(ptr, size, flags)

    runtime.register = register
    return began


def test_the_pipelined_bring_up_registers_chunk_k_while_faulting_later_ones(monkeypatch, lock):
    """With a slow fake driver and a slow pre-fault: every register call starts only once its
    whole chunk is resident, and the first one starts before the last piece is faulted (the
    two overlap instead of running one after the other). Order, not wall-clock thresholds."""
    import time as _time

    pieces = []
    real = _pipeline.prefault

    runtime = FakeRuntime(register_bytes_per_s=64 * 1024 / 0.01)  # 10 ms a chunk
    first_call = _registered_once(runtime)

    def slow_prefault(buffer, **kw):
        start = _time.perf_counter()
        _time.sleep(0.01)
        if kw["start"] + kw["length"] >= buffer.nbytes:  # the last piece: once a call has begun (bounded:
            first_call.wait(30)  # without pipelining none begins, and the order check below fails)
        report = real(buffer, **kw)
        pieces.append((buffer.ptr + kw["start"], kw["length"], start, _time.perf_counter()))
        return report

    monkeypatch.setattr(_pipeline, "prefault", slow_prefault)
    monkeypatch.setattr(_pipeline, "PIECE_BYTES", 32 * 1024)
    plan = _pool_plan(pages=64)  # 4 chunks of 64 KiB: 8 pieces
    handle = bring_up(plan, host=HostSetup(runtime=runtime, machine=ROOMY, lock=lock, ledger=HostLedger()),
                      mode="pipelined")
    calls = runtime.cudart.timeline
    handle.release()
    assert len(calls) == plan.call_count >= 3 and len(pieces) >= 2 * plan.call_count
    for _, ptr, size, start, _ in calls:  # a chunk is registered only once it is resident
        covering = [p for p in pieces if p[0] < ptr + size and ptr < p[0] + p[1]]
        assert covering and all(p[3] <= start for p in covering)
    assert calls[0][3] < max(p[3] for p in pieces)  # and the two overlap


def test_a_failing_pre_fault_rolls_the_pipelined_bring_up_back(monkeypatch, lock):
    """An out-of-memory pre-fault piece in a pipelined bring-up is an ApplyError caused by it, with
    nothing registered, claimed or mapped after."""
    from hicache.errors import ApplyError, HostOutOfMemoryError

    calls = []

    def failing(buffer, **kw):
        calls.append(kw["start"])
        if len(calls) == 3:
            raise HostOutOfMemoryError("pre-faulting failed: out of memory")
        return None

    monkeypatch.setattr(_pipeline, "prefault", failing)
    monkeypatch.setattr(_pipeline, "PIECE_BYTES", 32 * 1024)
    runtime, ledger, allocator = FakeRuntime(), HostLedger(), HostTensorAllocator()
    with pytest.raises(ApplyError) as info:
        bring_up(_pool_plan(pages=64), host=HostSetup(runtime=runtime, machine=ROOMY, lock=lock, ledger=ledger,
                                                      allocator=allocator), mode="pipelined")
    assert isinstance(info.value.__cause__, HostOutOfMemoryError)
    assert runtime.held() == set() and ledger.held() == () and allocator.owned() == []
    assert _entries(lock) == {}


# -- hicache apply --progressive ----------------------------------------------------------------
APPLY_PROGRESSIVE = ["apply", "--model", "llama-3.1-8b", "--tp", "8", "--host-gb", "0.01",
                     "--chunk-limit", "1MiB", "--reserve", "1MiB", "--progressive", "--format", "json"]


def test_apply_progressive_registers_every_call_reports_the_first_chunk_and_releases(lock, capsys):
    """apply --progressive makes every planned call, reports the first chunk's time before the
    total, and releases everything."""
    from hicache.cli import main

    with fake_cuda() as fake:
        code = main(APPLY_PROGRESSIVE)
        out = json.loads(capsys.readouterr().out)
        assert code == 0 and out["progressive"] is True
        assert out["calls"] == fake.cudart.register_calls > 1
        assert 0 < out["first_chunk_s"] <= out["total_s"]
        assert out["bytes"] >= 0.01 * GB * 0.99
        assert fake.held() == set() and fake.cudart.log[-1][0] == "unregister"


def test_apply_progressive_that_fails_midway_leaves_nothing_registered(lock, capsys):
    """A progressive apply whose fourth call fails exits non-zero with no report and nothing
    registered."""
    from hicache.cli import main

    with fake_cuda(fail_register={3: 2}) as fake:  # the 4th call: cudaErrorMemoryAllocation
        code = main(APPLY_PROGRESSIVE)
        captured = capsys.readouterr()
        assert code != 0 and captured.out == ""
        assert fake.cudart.register_calls == 4
        assert fake.held() == set()


def test_an_interrupt_at_the_budget_locks_exit_lets_the_host_wide_lock_go(lock, monkeypatch):
    """A Ctrl-C landing at the budget lock's with-exit (CPython cannot promise __exit__ runs
    then): bring_up raises KeyboardInterrupt with nothing registered and the host-wide lock let
    go - a process that lives on (a notebook, a server catching the interrupt) does not hold
    every other rank's bring-up behind it (issue #54)."""
    from hicache.effects._hostwide import _lock

    real_exit, landed = _lock.BudgetLock.__exit__, []

    def interrupted_exit(self, *exc_info):
        if not landed:  # the first exit (the admission's): the signal lands before its body runs
            landed.append(True)
            raise KeyboardInterrupt
        return real_exit(self, *exc_info)  # the rollback's own uses of the lock run as ever

    monkeypatch.setattr(_lock.BudgetLock, "__exit__", interrupted_exit)
    runtime = FakeRuntime()
    with pytest.raises(KeyboardInterrupt):
        bring_up(_pool_plan(), host=HostSetup(runtime=runtime, machine=ROOMY, lock=lock, ledger=HostLedger()))
    monkeypatch.undo()
    assert not lock.held and runtime.held() == set()
    with BudgetLock(lock.path.parent, timeout_s=5) as peer:  # free at once (5 s: a hang guard)
        assert os.getpid() not in peer.claims()


def test_a_pool_planned_with_the_call_cap_registers_while_it_still_faults(monkeypatch, lock):
    """A pinned pool on its default caps (no limits given: the resolved settings, here the call
    cap from HICACHE_CALL_CAP scaled down to the test's size): its plan has several calls, each
    within the cap, and the fake driver's log shows the first register call start before the
    last pre-fault piece ends - registration overlaps the pre-fault. Order from events."""
    import time as _time


    pieces = []
    real = _pipeline.prefault
    runtime = FakeRuntime()
    first_call = _registered_once(runtime)

    def slow_prefault(buffer, **kw):
        _time.sleep(0.005)
        if kw["start"] + kw["length"] >= buffer.nbytes:  # the last piece waits (bounded) for a call to begin
            first_call.wait(30)
        report = real(buffer, **kw)
        pieces.append(_time.perf_counter())
        return report

    monkeypatch.setattr(_pipeline, "prefault", slow_prefault)
    monkeypatch.setattr(_pipeline, "PIECE_BYTES", 64 * 1024)
    monkeypatch.setenv("HICACHE_CALL_CAP", "256KiB")
    monkeypatch.delenv("HICACHE_REGISTER_CHUNK", raising=False)
    device = MHADevicePool(size=512, layer_num=2, head_num=2, head_dim=64, page_size=4)
    pool = MHATokenToKVPoolHost(device, 2.0, 0, 4, "page_first_direct", True, "cpu", host=HostSetup(machine=ROOMY, runtime=runtime, ledger=HostLedger(), lock=lock))
    try:
        assert pool._limits.call_cap_bytes == 256 * 1024 and pool._limits.binding_caps() == ("call_cap",)
        calls = runtime.cudart.timeline
        assert len(calls) == pool.pool_plan.call_count >= 4
        assert all(size <= 256 * 1024 for _, _, size, _, _ in calls)
        assert calls[0][3] < max(pieces)  # the first call began before the pre-fault ended
    finally:
        pool.destroy()


def test_a_bring_up_waits_for_this_process_s_dropped_mappings_before_it_is_admitted(monkeypatch, lock):
    """The admission samples free memory only after the release thread has given back every
    mapping dropped before (a seam-mode pool's last view): events show the wait, then the
    admission - a budget=False bring-up (memory budgeted elsewhere) does not wait."""
    from hicache.effects._host import _release

    events: list = []
    wait, claim = _release.RELEASER.wait, _admission.claim
    monkeypatch.setattr(_release.RELEASER, "wait", lambda timeout=None: events.append("waits") or wait(timeout))
    monkeypatch.setattr(_admission, "claim", lambda *a, **kw: events.append("admitted") or claim(*a, **kw))
    handle = bring_up(_pool_plan(), host=HostSetup(runtime=FakeRuntime(), machine=ROOMY, lock=lock, ledger=HostLedger()))
    handle.release()
    assert events == ["waits", "admitted"]
    events.clear()
    bring_up(_pool_plan(), host=HostSetup(runtime=FakeRuntime(), machine=ROOMY, lock=lock, ledger=HostLedger()),
             budget=False).release()
    assert events == []
