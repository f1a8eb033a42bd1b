"""One test per guard the "one bring-up" issue lists: each fails when its line is broken.

Ledger overlaps from either side; leaked interior chunks keep memory mapped; the pool budget
divides by ranks and counts peers; a leaking rollback during pool construction raises and
quarantines; compat quarantines and records what a failed register or teardown leaves;
compat registers a 64-byte-aligned torch.empty buffer on copy-unit boundaries; hugepage
alignment only when the base has it; `hicache apply` exits 130 on Ctrl-C and 1 on a refused
budget.
"""

from __future__ import annotations

import os

import pytest
from doors import doors
from machine import facts

import hicache.compat.sglang as sg
from hicache.effects._host._memory import QUARANTINE, allocate_host
from hicache.effects import BudgetLock
from hicache.effects import HostLedger
from hicache.errors import CapacityError, RegistrationStateError, RollbackError
from hicache.plan import Limits, plan_registration
from hicache.pools import MHATokenToKVPoolHost
from hicache.testing import FakeRuntime, MHADevicePool, fake_cuda
from hicache.testing import FakeHostBuffer as FakeBuffer
from hicache.effects import HostSetup

pytestmark = pytest.mark.concurrency  # processes, threads, signals or waits: `make test-loaded`

torch = pytest.importorskip("torch")
MiB = 2**20


# -- the ledger -------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "request_, refused",
    [((80, 30), True), ((140, 20), True), ((60, 200), True), ((110, 10), True),  # from the left, right, around, inside
     ((50, 50), False), ((150, 10), False)],  # touching either end is not overlapping
)
def test_the_ledger_refuses_an_overlap_from_either_side(request_, refused):
    """The ledger refuses a claim overlapping a held range from below, above, inside or around, and
    admits one that only touches it."""
    ledger = HostLedger()
    assert ledger.claim([(100, 50)]) is None
    assert (ledger.overlapping(*request_) is not None) is refused
    conflict = ledger.claim([request_])
    assert (conflict is not None) is refused


def test_the_ledger_refuses_overlaps_within_one_claim():
    """Two ranges of one claim that overlap each other are refused and nothing is held."""
    ledger = HostLedger()
    assert ledger.claim([(100, 50), (120, 50)]) is not None and ledger.held() == ()


# -- memory CUDA may still pin -----------------------------------------------------------------
def test_memory_with_a_leaked_interior_chunk_is_never_unmapped():
    """A buffer with a still-registered page inside refuses to be freed and stays mapped and
    writable until the page is let go."""
    buffer = allocate_host(4 * 4096)
    ledger = HostLedger()
    ledger.claim([(buffer.ptr + 2 * 4096, 4096)])  # the third page stayed registered
    with pytest.raises(RegistrationStateError, match="still registered"):
        buffer.free(ledger=ledger)
    assert not buffer.freed
    buffer.tensor[-1] = 7  # still mapped and writable
    ledger.replace([buffer.ptr + 2 * 4096], [])
    buffer.free(ledger=ledger)
    assert buffer.freed


# -- the pool's budget -------------------------------------------------------------------------
def _pool(lock, machine, **kw):
    device = MHADevicePool(size=64, layer_num=2, head_num=2, head_dim=64, page_size=64)
    return MHATokenToKVPoolHost(device, 1.0, 0, 64, "page_first_direct", True, "cpu",
                                **doors(limits=Limits(chunk_limit_bytes=MiB), runtime=FakeRuntime(),
                                        ledger=HostLedger(), machine=machine, budget_lock=lock, **kw))


def test_pool_bring_up_divides_the_budget_by_ranks_and_counts_peers(tmp_path):
    """A pool's bring-up divides the budget by ranks per host and counts a peer's claim; its own
    claim appears and goes with it."""
    directory = tmp_path / "run"
    directory.mkdir(mode=0o700)
    lock = BudgetLock(directory)
    probe = _pool(lock, facts())
    size = probe.pool_plan.total_bytes
    probe.destroy()
    reserve = 10 * 2**30
    tight = facts(available_bytes=reserve + 4 * size - 1, ranks_per_host=4)
    with pytest.raises(CapacityError, match=r"/ 4 rank"):
        _pool(lock, tight)
    _pool(lock, facts(available_bytes=reserve + 4 * size - 1, ranks_per_host=1)).destroy()
    with lock:
        lock._write({os.getppid(): size})  # a live peer already allocated
    pool = _pool(lock, tight)  # now 3 ranks share what is left
    with lock:
        assert lock._claimed() == {os.getppid(): size, os.getpid(): size}
    pool.destroy()
    with lock:
        assert lock._claimed() == {os.getppid(): size}


def test_a_rollback_that_leaks_during_pool_construction_raises_and_quarantines(tmp_path):
    """A pool constructor whose rollback leaks raises RollbackError naming what stays registered and
    quarantines that memory."""
    directory = tmp_path / "run"
    directory.mkdir(mode=0o700)
    device = MHADevicePool(size=64, layer_num=2, head_num=2, head_dim=64, page_size=64)
    limits = Limits(chunk_limit_bytes=64 * 1024)
    runtime, ledger = FakeRuntime(fail_register={2: 2}, fail_unregister={0: 1}), HostLedger()
    before = len(QUARANTINE)
    with pytest.raises(RollbackError) as info:
        MHATokenToKVPoolHost(device, 8.0, 0, 64, "page_first_direct", True, "cpu",
                             host=HostSetup(limits=limits, runtime=runtime, ledger=ledger, machine=facts(), lock=BudgetLock(directory)))
    assert runtime.cudart.register_calls == 3  # two registered, the third failed
    leaked = set(info.value.leaked)
    assert leaked and runtime.held() == leaked == set(ledger.held())
    kept = [b for b in QUARANTINE[before:] if hasattr(b, "freed")]
    assert kept and all(not b.freed for b in kept)
    assert any(b.ptr <= ptr < b.ptr + b.nbytes for b in kept for ptr, _ in leaked)


# -- compat ------------------------------------------------------------------------------------
def _leak_recorded_then_retried(cudart, buffer, before: int) -> None:
    """What stayed registered is on the tensor's record and its memory quarantined; teardown then
    retries exactly that and leaves nothing."""
    recorded = getattr(buffer, sg._CUDA_HOST_REGISTERED_RANGES_ATTR)
    assert recorded and set(recorded) == cudart.held()
    assert any(b is buffer for b in QUARANTINE[before:])
    cudart.fail_unregister = {}
    sg._cuda_host_unregister(buffer)  # teardown retries exactly what stayed
    assert cudart.held() == set() and getattr(buffer, sg._CUDA_HOST_REGISTERED_RANGES_ATTR) == []


def test_a_failed_compat_registration_quarantines_and_records_what_stays(cudart):
    """compat's _cuda_host_register with a failing undo records the leaked ranges on the tensor,
    quarantines it, and a later teardown retries them."""
    buffer = FakeBuffer(3 * 2**30)  # three 1 GiB chunks
    cudart.fail_register = {2: 2}
    cudart.fail_unregister = {0: 1}
    before = len(QUARANTINE)
    with pytest.raises(RollbackError):
        sg._cuda_host_register(buffer, registration_granularity_bytes=2**30)
    _leak_recorded_then_retried(cudart, buffer, before)


def test_a_failed_compat_teardown_quarantines_and_records_what_stays(cudart, monkeypatch):
    """A compat teardown that cannot unregister keeps the ranges recorded on the tensor and
    quarantines it."""
    monkeypatch.setenv(sg.CHUNK_ENV, "1")
    buffer = sg.alloc_with_host_register((3 * 2**20,), torch.uint8, "cpu", True, sg.HostTensorAllocator(),
                                         registration_granularity_bytes=2**20)
    assert len(cudart.held()) == 1
    cudart.fail_unregister = {cudart.unregister_calls: 1}
    before = len(QUARANTINE)
    sg._cuda_host_unregister(buffer)
    assert getattr(buffer, sg._CUDA_HOST_REGISTERED_RANGES_ATTR) == sorted(cudart.held())
    assert any(b is buffer for b in QUARANTINE[before:])


def test_compat_registers_a_64_byte_aligned_torch_empty_buffer_on_copy_unit_boundaries(cudart, monkeypatch):
    """torch.empty bases are often only 64-byte aligned: boundaries then follow the copy unit
    only (page alignment cannot be promised), and every byte is registered exactly once."""
    monkeypatch.setenv(sg.CHUNK_ENV, "1")
    raw = torch.empty(2**30 + 8192, dtype=torch.uint8)
    shift = next(s for s in range(0, 8192, 64) if (raw.data_ptr() + s) % 4096 == 64)
    buffer = raw[shift: shift + 600 * 1536 * 1024]  # 1536-byte copy unit x 614400: ~900 MiB
    sg._cuda_host_register(buffer, registration_granularity_bytes=1536 * 1024)
    calls = sorted(cudart.held())
    assert calls[0][0] == buffer.data_ptr() and buffer.data_ptr() % 4096 == 64
    assert all((ptr - buffer.data_ptr()) % (1536 * 1024) == 0 for ptr, _ in calls)
    assert sum(size for _, size in calls) == buffer.numel()
    sg._cuda_host_unregister(buffer)
    assert cudart.held() == set()


# -- the planner's hugepage claim --------------------------------------------------------------
def test_hugepage_alignment_is_claimed_only_when_the_base_is_hugepage_aligned():
    """A plan assumes hugepage-aligned boundaries only when the base address is hugepage aligned,
    and says so otherwise."""
    huge = 2 * MiB
    aligned = plan_registration(64 * huge, granularity_bytes=4096,
                                limits=Limits(chunk_limit_bytes=5 * huge, hugepage_bytes=huge))
    assert aligned.alignment_bytes % huge == 0 and aligned.step_bytes == 5 * huge
    base_4k = plan_registration(64 * huge, granularity_bytes=4096,
                                limits=Limits(chunk_limit_bytes=5 * huge, hugepage_bytes=huge, base_alignment_bytes=4096))
    assert base_4k.alignment_bytes % huge != 0
    assert any("not hugepage-aligned" in note for note in base_4k.notes)


# -- hicache apply's exit codes ----------------------------------------------------------------
APPLY = ["apply", "--model", "llama-3.1-8b", "--tp", "8", "--host-gb", "0.01", "--chunk-limit", "1MiB"]


def test_apply_exits_130_on_ctrl_c_and_leaves_nothing(capsys):
    """Ctrl-C after apply's third register call: exit 130, error[interrupted], and the fake driver
    holds nothing."""
    from hicache.cli import main

    with fake_cuda(interrupt_register={2: "after"}) as fake:
        code = main([*APPLY, "--reserve", "1MiB"])
    err = capsys.readouterr().err
    assert code == 130 and "error[interrupted]" in err and "nothing is left registered" in err
    assert fake.held() == set()


def test_apply_after_a_leaking_rollback_never_says_nothing_is_left(capsys):
    """When the rollback after Ctrl-C leaks, apply says what may stay registered, never 'nothing is
    left registered'."""
    from hicache.cli import main

    with fake_cuda(interrupt_register={2: "after"}, fail_unregister={0: 1}) as fake:
        code = main([*APPLY, "--reserve", "1MiB"])
    err = capsys.readouterr().err
    assert code == 130 and fake.held() and "nothing is left registered" not in err
    assert "may stay registered" in err


def test_apply_exits_1_on_a_refused_budget(capsys):
    """A budget the machine cannot meet: exit 1, error[budget-refused], no CUDA call."""
    from hicache.cli import main

    with fake_cuda() as fake:  # psutil reports 3 GB available (conftest); the reserve is 10 GiB
        code = main(APPLY)
    err = capsys.readouterr().err
    assert code == 1 and "error[budget-refused]" in err and fake.cudart.log == []


def test_a_ctrl_c_during_a_leaking_compat_rollback_still_records_and_quarantines_what_stays(cudart):
    """Call 2 is refused, the rollback's first unregister fails (chunk 1 stays registered) and a
    Ctrl-C arrives during it: the caller gets the KeyboardInterrupt, and the leaked chunk is on
    the tensor's record (so teardown retries it) with its memory quarantined - never freed."""
    import signal

    real = cudart.cudaHostUnregister

    def unregister(ptr):
        if cudart.unregister_calls == 1:
            signal.raise_signal(signal.SIGINT)
        return real(ptr)

    cudart.cudaHostUnregister = unregister
    buffer = FakeBuffer(3 * 2**30)
    cudart.fail_register, cudart.fail_unregister = {2: 2}, {0: 1}
    before = len(QUARANTINE)
    with pytest.raises(KeyboardInterrupt):
        sg._cuda_host_register(buffer, registration_granularity_bytes=2**30)
    _leak_recorded_then_retried(cudart, buffer, before)
