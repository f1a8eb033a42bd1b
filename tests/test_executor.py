"""The transactional executor: all or nothing, rollback in reverse, leaks reported exactly."""

from __future__ import annotations

import gc

import pytest

from hicache.effects import HostLedger
from hicache.effects import apply_plan, apply_pool_plan
from hicache.errors import (
    ApplyError,
    HostAlreadyRegisteredError,
    PlanError,
    ReleaseError,
    RollbackError)
from hicache.plan import Limits, MambaLayout, plan_pool, plan_registration
from hicache.testing import FakeRuntime
from hicache.effects import HostSetup

pytestmark = pytest.mark.concurrency  # processes, threads, signals or waits: `make test-loaded`

MiB, GiB = 2**20, 2**30
BASE = 1 << 40
SGLANG_PLAN = plan_registration(2500 * MiB, granularity_bytes=300 * MiB, limits=Limits(chunk_limit_bytes=GiB))


def apply(plan=SGLANG_PLAN, **kwargs):
    kwargs.setdefault("ledger", HostLedger())
    kwargs.setdefault("base_ptr", BASE)
    return apply_plan(plan, **kwargs)


def three_buffer_pool():
    layout = MambaLayout(
        "page_first", layer_num=2, slots=64, temporal_shape=(4, 8), temporal_itemsize=4,
        conv_shapes=((4, 4), (2, 8)), conv_itemsize=2)
    pool = plan_pool(layout, Limits(chunk_limit_bytes=4096, os_page_bytes=64))
    bases = [BASE, BASE + 2**30, BASE + 2**31]
    return pool, bases


def test_registers_in_plan_order_with_flags():
    """Each range is registered at base + offset, in order, with the given flags."""
    runtime = FakeRuntime()
    with apply(runtime=runtime, flags=1) as registration:
        assert runtime.cudart.log == [
            ("register", BASE, 900 * MiB, 1),
            ("register", BASE + 900 * MiB, 900 * MiB, 1),
            ("register", BASE + 1800 * MiB, 700 * MiB, 1),
        ]
        assert registration.status().state == "active"
    assert runtime.held() == set() and registration.status().state == "released"
    assert [op for op, *_ in runtime.cudart.log[3:]] == ["unregister"] * 3
    assert [ptr for _, ptr in runtime.cudart.log[3:]] == [BASE + 1800 * MiB, BASE + 900 * MiB, BASE]


def test_second_chunk_failure_rolls_back_the_first_and_names_the_offset():
    """SGLang's case: chunk 2 fails, chunk 1 is unregistered, the error names offset=943718400."""
    runtime = FakeRuntime(fail_register={1: 2})
    with pytest.raises(ApplyError, match=r"chunk 2 of 3 \(offset=943718400, size=943718400") as info:
        apply(runtime=runtime)
    assert not isinstance(info.value, RollbackError)
    assert info.value.__cause__.code == 2
    assert runtime.held() == set()
    runtime.check_valid()


def test_pool_is_one_transaction_third_buffer_failure_undoes_the_first_two():
    """When the third buffer fails, the first two buffers are unregistered too."""
    pool, bases = three_buffer_pool()
    calls = sum(b.plan.call_count for b in pool.buffers[:2])
    runtime = FakeRuntime(fail_register={calls: 2})
    with pytest.raises(ApplyError, match="buffer 'conv1' chunk 1"):
        apply_pool_plan(pool, base_ptrs=bases, runtime=runtime, ledger=HostLedger())
    assert runtime.held() == set()
    assert runtime.cudart.unregister_calls == calls


@pytest.mark.parametrize("when", ["before", "after"])
def test_keyboard_interrupt_mid_plan_rolls_back(when):
    """Ctrl-C before or after a register call took effect leaves nothing registered."""
    runtime = FakeRuntime(interrupt_register={1: when})
    ledger = HostLedger()
    with pytest.raises(ApplyError) as info:
        apply(runtime=runtime, ledger=ledger)
    assert isinstance(info.value.__cause__, KeyboardInterrupt)
    assert runtime.held() == set() and ledger.held() == ()
    runtime.check_valid()


def test_sticky_error_during_rollback_stops_and_reports_exact_leaks():
    """A sticky unregister failure stops the rollback; every range still held is in .leaked."""
    runtime = FakeRuntime(fail_register={2: 2}, fail_unregister={0: 700})
    ledger = HostLedger()
    with pytest.raises(RollbackError, match="must not be unmapped") as info:
        apply(runtime=runtime, ledger=ledger)
    assert set(info.value.leaked) == runtime.held() == {(BASE, 900 * MiB), (BASE + 900 * MiB, 900 * MiB)}
    assert runtime.cudart.unregister_calls == 1  # nothing after a sticky code
    assert set(ledger.held()) == runtime.held()  # still held: no one may free or reuse it


def test_non_sticky_undo_failure_keeps_going():
    """A non-sticky unregister failure is reported, and the other undos still run."""
    runtime = FakeRuntime(fail_register={2: 2}, fail_unregister={0: 1})
    with pytest.raises(RollbackError) as info:
        apply(runtime=runtime)
    assert info.value.leaked == ((BASE + 900 * MiB, 900 * MiB),)
    assert runtime.held() == {(BASE + 900 * MiB, 900 * MiB)}


def test_overlap_with_a_held_range_is_refused_before_cuda():
    """A plan overlapping what this process holds is refused without any CUDA call."""
    runtime, ledger = FakeRuntime(), HostLedger()
    with apply(runtime=runtime, ledger=ledger):
        calls = len(runtime.cudart.log)
        with pytest.raises(HostAlreadyRegisteredError, match="refused before calling CUDA") as info:
            apply(runtime=runtime, ledger=ledger, base_ptr=BASE + 1800 * MiB)
        assert info.value.code == 712
        assert len(runtime.cudart.log) == calls
    runtime.check_valid()


def test_a_double_registration_via_cuda_is_drained():
    """When CUDA itself reports 712, the pending error is drained (check_valid passes)."""
    runtime = FakeRuntime()
    runtime.cudart.registered[BASE] = 4096  # registered behind hicache's back
    with pytest.raises(ApplyError) as info:
        apply(runtime=runtime)
    assert isinstance(info.value.__cause__, HostAlreadyRegisteredError)
    runtime.check_valid()


def test_retry_halves_on_copy_units():
    """With retries, a failed chunk is re-split in halves that stay copy-unit multiples."""
    runtime = FakeRuntime(fail_register={1: 2})
    with apply(runtime=runtime, retry_halvings=1) as registration:
        sizes = [r.size for r in registration.ranges]
        assert sizes == [900 * MiB, 300 * MiB, 300 * MiB, 300 * MiB, 300 * MiB, 300 * MiB, 100 * MiB]
        assert all((r.ptr - BASE + r.size) % (300 * MiB) == 0 for r in registration.ranges[:-1])
        assert registration.status().retries == 1
        assert sum(sizes) == 2500 * MiB


def test_retry_never_goes_below_the_unit():
    """When halving would go below the copy unit, the original failure is raised."""
    plan = plan_registration(4 * MiB, granularity_bytes=MiB, limits=Limits(chunk_limit_bytes=MiB))
    with pytest.raises(ApplyError, match="cudaErrorMemoryAllocation"):
        apply(plan, runtime=FakeRuntime(fail_register={0: 2}), retry_halvings=3)


def test_sticky_register_failure_is_not_retried():
    """A sticky code is never retried."""
    runtime = FakeRuntime(fail_register={1: 700})
    with pytest.raises(ApplyError):
        apply(runtime=runtime, retry_halvings=5)
    assert runtime.cudart.register_calls == 2


def test_progress_reports_every_chunk_and_can_abort():
    """Progress is called after each chunk; raising from it rolls everything back."""
    events = []
    runtime = FakeRuntime()
    apply(runtime=runtime, progress=events.append).release()
    assert [(e.chunk_index, e.chunk_count) for e in events] == [(1, 3), (2, 3), (3, 3)]
    assert events[-1].bytes_done == events[-1].bytes_total == 2500 * MiB

    def stop(event):
        if event.chunk_index == 2:
            raise RuntimeError("operator cancelled")

    with pytest.raises(ApplyError, match="operator cancelled"):
        apply(runtime=runtime, progress=stop)
    assert runtime.held() == set()


def test_release_is_idempotent_and_reports_leaks():
    """release() twice is fine; a failed unregister raises ReleaseError with the leak, and a
    second release retries exactly that range (and only it) - while it keeps failing the leak
    stays reported, once it succeeds the registration is released and the ledger empty."""
    runtime = FakeRuntime(fail_unregister={1: 1, 3: 1})  # the first try and the first retry fail
    ledger = HostLedger()
    registration = apply(runtime=runtime, ledger=ledger)
    with pytest.raises(ReleaseError) as info:
        registration.release()
    assert info.value.leaked == ((BASE + 900 * MiB, 900 * MiB),)
    assert ledger.held() == ((BASE + 900 * MiB, 900 * MiB),)
    calls = runtime.cudart.unregister_calls
    with pytest.raises(ReleaseError) as again:
        registration.release()
    assert again.value.leaked == info.value.leaked
    assert runtime.cudart.unregister_calls == calls + 1  # only the leaked range was tried again
    assert registration.status().state == "leaked"
    registration.release()  # the third try succeeds
    assert runtime.cudart.unregister_calls == calls + 2
    assert registration.status().state == "released" and registration.leaked == ()
    assert ledger.held() == () and runtime.held() == set()
    registration.release()  # and stays released
    assert runtime.cudart.unregister_calls == calls + 2


def test_status_is_a_frozen_snapshot_with_timings():
    """status() carries ranges, bytes, calls and a GB/s figure, and does not change later."""
    runtime = FakeRuntime()
    registration = apply(runtime=runtime)
    before = registration.status()
    registration.release()
    assert before.state == "active" and before.call_count == 3
    assert before.registered_bytes == 2500 * MiB and before.register_gbps >= 0
    assert registration.status().release_seconds is not None


def test_forgotten_registration_is_released_by_the_finalizer_with_a_warning():
    """A registration dropped without release() is released at collection, with a warning."""
    runtime = FakeRuntime()
    registration = apply(runtime=runtime)
    with pytest.warns(ResourceWarning, match="garbage-collected without release"):
        del registration
        gc.collect()
    assert runtime.held() == set()


def test_bad_arguments_are_clear_errors():
    """Misaligned bases, wrong base counts and non-runtimes are refused before CUDA."""
    runtime = FakeRuntime()
    with pytest.raises(PlanError, match="not aligned to the 4096 B"):
        apply(runtime=runtime, base_ptr=BASE + 64)
    pool, bases = three_buffer_pool()
    with pytest.raises(PlanError, match="2 base_ptrs for 3 buffers"):
        apply_pool_plan(pool, base_ptrs=bases[:2], runtime=runtime)
    with pytest.raises(TypeError, match="runtime must provide"):
        apply(runtime=object())
    assert runtime.cudart.log == []


def test_pool_buffers_overlapping_each_other_are_refused():
    """Two buffers of one pool given overlapping bases are refused before CUDA."""
    pool, bases = three_buffer_pool()
    runtime = FakeRuntime()
    with pytest.raises(HostAlreadyRegisteredError):
        apply_pool_plan(pool, base_ptrs=[BASE, BASE, BASE + 2**31], runtime=runtime, ledger=HostLedger())
    assert runtime.cudart.log == []


def test_several_pools_are_one_transaction():
    """bring_up of a model's pools (MLA ``kv`` beside Mamba state, say) is one transaction: the
    second pool failing rolls the first back; the error names which pool's buffer."""
    from hicache.effects import bring_up
    from hicache.effects import HostSetup
    from hicache.plan import Limits, MHALayout, MLALayout, plan_pool

    limits = Limits(chunk_limit_bytes=16384, os_page_bytes=4096)  # several calls per buffer
    first = plan_pool(MHALayout("page_first", layer_num=2, head_num=2, head_dim=64, page_size=16, page_num=8,
                                itemsize=2), limits)
    second = plan_pool(MLALayout("page_first", layer_num=2, kv_cache_dim=64, page_size=16, page_num=8, itemsize=2),
                       limits)
    calls = sum(b.plan.call_count for b in first.buffers)
    runtime = FakeRuntime(fail_register={calls + 1: 2})  # 0-based: the second pool's second call
    with pytest.raises(ApplyError, match="buffer '1/kv' chunk 2"):
        bring_up([first, second], host=HostSetup(runtime=runtime, ledger=HostLedger(), turnstile=None), budget=False,
                 mode="blocking")
    assert runtime.held() == set() and sum(1 for entry in runtime.cudart.log if entry[0] == "register") == calls + 2
    handle = bring_up([first, second], host=HostSetup(runtime=FakeRuntime(), ledger=HostLedger(), turnstile=None),
                      budget=False)
    try:
        assert handle.registration.status().call_count == calls + sum(b.plan.call_count for b in second.buffers)
    finally:
        handle.release()


@pytest.mark.parametrize("when", ["before", "after"])
def test_ctrl_c_during_release_finishes_the_undo_then_raises(when):
    """An interrupt mid-release: every other range is still unregistered, then it propagates;
    the interrupted range counts as leaked (its fate is unknown), so its memory is kept."""
    runtime, ledger = FakeRuntime(interrupt_unregister={1: when}), HostLedger()
    registration = apply(runtime=runtime, ledger=ledger)
    with pytest.raises(KeyboardInterrupt):
        registration.release()
    assert runtime.cudart.unregister_calls == 3
    status = registration.status()
    assert status.state == "leaked" and status.leaked == ((BASE + 900 * MiB, 900 * MiB),)
    assert set(ledger.held()) == set(status.leaked)
    assert runtime.held() <= set(status.leaked)


def test_ctrl_c_during_rollback_propagates_with_the_books_attached():
    """A failure, then Ctrl-C while rolling back: KeyboardInterrupt, caused by the RollbackError."""
    runtime = FakeRuntime(fail_register={2: 2}, interrupt_unregister={0: "before"})
    with pytest.raises(KeyboardInterrupt) as info:
        apply(runtime=runtime)
    assert isinstance(info.value.__cause__, RollbackError)
    assert runtime.cudart.unregister_calls == 2  # the other undo still ran


def test_interrupted_call_whose_undo_fails_is_reported_uncertain():
    """Found by the state machine: Ctrl-C before call 1 took effect, and the undo of that
    in-flight range fails too - it is reported as *uncertain*, not as leaked."""
    runtime = FakeRuntime(interrupt_register={0: "before"}, fail_unregister={0: 2})
    with pytest.raises(RollbackError) as info:
        apply(runtime=runtime)
    assert info.value.leaked == () and info.value.uncertain == ((BASE, 900 * MiB),)
    assert runtime.held() == set()
    assert isinstance(info.value.__cause__, KeyboardInterrupt)


def test_a_ctrl_c_during_the_rollback_is_honoured_after_it_with_the_books_attached():
    """The driver refuses call 2; while the executor unregisters calls 1 and 0 a Ctrl-C arrives (a
    real SIGINT, which the executor holds so the rollback finishes). Once nothing is registered
    the Ctrl-C reaches the caller as KeyboardInterrupt - not swallowed into the register error -
    chained to the ApplyError that says what was rolled back."""
    import signal

    from hicache.testing import FakeCudart

    class CtrlCWhileUndoing(FakeCudart):
        def cudaHostUnregister(self, ptr):
            if self.unregister_calls == 0:
                signal.raise_signal(signal.SIGINT)  # the user's Ctrl-C, mid-rollback
            return super().cudaHostUnregister(ptr)

    runtime = FakeRuntime(CtrlCWhileUndoing(fail_register={2: 2}))
    with pytest.raises(KeyboardInterrupt) as info:
        apply(runtime=runtime)
    assert isinstance(info.value.__cause__, ApplyError) and "rolled back 2" in str(info.value.__cause__)
    assert runtime.held() == set() and runtime.cudart.unregister_calls == 2  # both undone first


@pytest.mark.parametrize("when, rolled_back", [("before", 2), ("after", 3)])
def test_an_interrupted_call_that_took_effect_is_counted_as_rolled_back(when, rolled_back):
    """Ctrl-C at call 2 (0-based): before it takes effect two registrations are undone; after it
    did, three - and the message says so (it said 2 for both)."""
    runtime = FakeRuntime(interrupt_register={2: when})
    with pytest.raises(ApplyError) as info:
        apply(plan_registration(4 * GiB, granularity_bytes=GiB, limits=Limits(chunk_limit_bytes=GiB)), runtime=runtime)
    assert f"rolled back {rolled_back} registration(s)" in str(info.value)
    assert isinstance(info.value.__cause__, KeyboardInterrupt) and runtime.held() == set()
