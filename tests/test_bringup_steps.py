"""The bring-up's steps (hicache.effects' `_bringup._steps`) at their edges: a progressive
`order` is a legal registration plan of every buffer - checked before any memory is taken - and
is registered as given; every mode registers with cudaHostRegisterDefault; a base as aligned as
the plan assumed keeps the very plan shown; the blocking pre-fault runs at the process's own
priority; a progressive bring-up's events count calls and bytes as they happen."""

from __future__ import annotations

import time

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from machine import ROOMY

from hicache.effects import BufferRequest, HostSetup, HostTensorAllocator, Progressive, Report, bring_up
from hicache.effects._bringup import _bring_up, _faulting, _steps  # the rooms under test
from hicache.errors import PlanError
from hicache.plan import Limits, plan_registration
from hicache.testing import FakeCudart, FakeRuntime

pytestmark = pytest.mark.concurrency  # threads (the pre-fault, the background registration): `make test-loaded`

pytest.importorskip("torch")
MiB = 2**20
UNIT = 64 * 1024  # the copy unit: a page of the pool, never cut by a registration boundary


def _plan(total: int = 8 * MiB, chunk: int = 4 * MiB):
    return plan_registration(total, granularity_bytes=UNIT, limits=Limits(chunk_limit_bytes=chunk))


def _requests(*totals: int) -> list[BufferRequest]:
    return [BufferRequest(f"kv{i}", (total,), None, _plan(total)) for i, total in enumerate(totals)]


def _host(runtime, allocator=None) -> HostSetup:
    return HostSetup(runtime=runtime, machine=ROOMY, turnstile=None, allocator=allocator or HostTensorAllocator())


def _held_offsets(runtime, base: int) -> list[tuple[int, int]]:
    return sorted((ptr - base, size) for ptr, size in runtime.held())


BAD_ORDERS = [
    # (order over one 8 MiB buffer of 64 KiB pages in 4 MiB calls, what the error names)
    ([(0, 0, 4096), (0, 4096, 4 * MiB - 4096), (0, 4 * MiB, 4 * MiB)], "not a multiple of the copy unit 65536"),
    ([(0, 0, 4 * MiB)], "total_bytes is 8388608"),  # half the buffer would stay unregistered
    ([(0, 0, 4 * MiB), (0, 0, 4 * MiB), (0, 4 * MiB, 4 * MiB)], "overlaps the previous range"),
    ([(0, 4 * MiB, 4 * MiB)], "leaves a gap"),
    ([(0, 0, 8 * MiB)], "over the cap"),
    ([(1, 0, 4 * MiB), (0, 0, 4 * MiB), (0, 4 * MiB, 4 * MiB)], "buffer index must be <= 0, got 1"),
    ([(-1, 0, 4 * MiB), (0, 0, 4 * MiB), (0, 4 * MiB, 4 * MiB)], "buffer index must be >= 0, got -1"),
    ([(0, -UNIT, UNIT), (0, 0, 4 * MiB), (0, 4 * MiB, 4 * MiB)], "offset must be >= 0, got -65536"),
    ([(0, 0, 0), (0, 0, 4 * MiB), (0, 4 * MiB, 4 * MiB)], "size must be positive, got 0"),
    ([(0, 8 * MiB - UNIT, 2 * UNIT), (0, 0, 4 * MiB), (0, 4 * MiB, 4 * MiB - UNIT)], "8454144"),  # past the end
    ([(0, 0.0, 4 * MiB), (0, 4 * MiB, 4 * MiB)], "offset must be an integer, got 0.0"),
    ([(True, 0, 4 * MiB), (0, 4 * MiB, 4 * MiB)], "buffer index must be an integer, got True"),
    ([(0, 0), (0, 4 * MiB, 4 * MiB)], "(0, 0) is no (buffer index, offset, size)"),
]


@pytest.mark.parametrize("order, named", BAD_ORDERS, ids=[named for _, named in BAD_ORDERS])
def test_an_order_that_is_no_legal_plan_of_every_buffer_is_refused_before_any_memory(order, named):
    """A `Progressive(order=)` that cuts a page (a registration boundary inside one: the straddle
    every async copy of it breaks on), leaves part of a buffer unregistered, registers a byte
    twice, exceeds a call cap or names no buffer's bytes is a PlanError naming `Progressive.order`
    and what is wrong - before anything is mapped, budgeted or registered (the page cut registered,
    and half a buffer unregistered came up "active")."""
    runtime, allocator = FakeRuntime(), HostTensorAllocator()
    with pytest.raises(PlanError, match=r"Progressive\.order") as refused:
        bring_up(_requests(8 * MiB), mode=Progressive(order=order, max_stall_s=None), host=_host(runtime, allocator))
    assert named in str(refused.value), refused.value
    assert runtime.cudart.log == [] and allocator.owned() == []


def test_an_order_must_cover_every_buffer():
    """Two buffers and an order that tiles only the first: refused naming the second."""
    runtime = FakeRuntime()
    order = [(0, 0, 4 * MiB), (0, 4 * MiB, 4 * MiB)]
    with pytest.raises(PlanError, match=r"Progressive\.order .*'kv1'"):
        bring_up(_requests(8 * MiB, 4 * MiB), mode=Progressive(order=order, max_stall_s=None), host=_host(runtime))
    assert runtime.cudart.log == []


@pytest.mark.parametrize("order", [
    [(0, 4 * MiB, 4 * MiB), (0, 0, 4 * MiB)],  # the plan's ranges, last first
    [(0, 0, UNIT), (0, UNIT, 4 * MiB - UNIT), (0, 4 * MiB, 3 * MiB), (0, 7 * MiB, MiB)],  # cut on copy units
])
def test_a_legal_order_is_registered_call_for_entry_in_its_order(order):
    """An order whose entries cut the buffer only on copy units, within the caps, once each, is
    registered exactly as given: one call per entry, in the order's order (the default key)."""
    runtime = FakeRuntime()
    handle = bring_up(_requests(8 * MiB), mode=Progressive(order=order, max_stall_s=None), host=_host(runtime))
    try:
        assert handle.wait(60)
        base = handle.tensors[0].data_ptr()
        calls = [(ptr - base, size) for kind, ptr, size, _ in
                 (entry for entry in runtime.cudart.log if entry[0] == "register")]
        assert calls == [(offset, size) for _, offset, size in order]
        assert _held_offsets(runtime, base) == sorted((offset, size) for _, offset, size in order)
    finally:
        handle.release()
    assert runtime.held() == set()


@pytest.mark.parametrize("mode", ["blocking", "pipelined", "progressive"])
def test_every_mode_registers_with_cuda_host_register_default(mode):
    """Every call passes flags 0 - cudaHostRegisterDefault, mapped and portable on UVA systems, as
    SGLang registers its pools: the GPU's kernels reach the memory through the same pointer."""
    runtime = FakeRuntime()
    chosen = Progressive(max_stall_s=None) if mode == "progressive" else mode
    handle = bring_up(_requests(8 * MiB, 4 * MiB), mode=chosen, host=_host(runtime))
    try:
        assert handle.wait(60)
    finally:
        handle.release()
    flags = [entry[3] for entry in runtime.cudart.log if entry[0] == "register"]
    assert len(flags) == 3 and set(flags) == {0}, runtime.cudart.log


def test_a_base_as_aligned_as_the_plan_assumed_keeps_the_very_plan_shown():
    """The plan `hicache plan` shows is the one applied wherever the memory's base is as aligned
    as the plan assumed (more aligned included); a less aligned base gets a plan re-made for the
    alignment it really has, every law intact."""
    plan = plan_registration(8 * MiB, granularity_bytes=UNIT,
                             limits=Limits(chunk_limit_bytes=4 * MiB, base_alignment_bytes=2 * MiB))
    for base in (2 * MiB, 6 * MiB, 1 << 40, 0):
        assert _steps._aligned_plan(plan, base) is plan
    less = _steps._aligned_plan(plan, 2 * MiB + UNIT)
    assert less is not plan and less.limits.base_alignment_bytes == UNIT and less.ranges == plan.ranges


def test_a_buffer_the_allocator_faults_itself_has_the_requested_dtype():
    """Blocking over an allocator that cannot map unfaulted (torch's own): each buffer has the
    dtype its request names, uint8 where it names none."""
    import torch

    from hicache.effects import TorchHostTensorAllocator

    plan = plan_registration(2048, granularity_bytes=2048, limits=Limits(chunk_limit_bytes=MiB))
    requests = [BufferRequest("k", (1024,), torch.float16, plan), BufferRequest("v", (2048,), None, plan)]
    handle = bring_up(requests, mode="blocking", host=_host(FakeRuntime(), TorchHostTensorAllocator()), budget=False)
    try:
        assert [t.dtype for t in handle.tensors] == [torch.float16, torch.uint8]
    finally:
        handle.release()


@pytest.mark.parametrize("mode, nice", [("blocking", 0), ("pipelined", None)])
def test_the_blocking_pre_fault_runs_at_the_processs_own_priority(monkeypatch, mode, nice):
    """Blocking: nothing of the bring-up runs beside its pre-fault, so its threads are not niced
    (the allocator's own faulting is not either); pipelined: nicer than the registering thread,
    by the pre-fault's default."""
    made = []

    class Recording(_faulting.Prefaulter):
        def __init__(self, *args, **kwargs):
            made.append(kwargs.get("nice", _faulting.BACKGROUND_NICE))
            super().__init__(*args, **kwargs)

    monkeypatch.setattr(_steps, "Prefaulter", Recording)
    bring_up(_requests(8 * MiB), mode=mode, host=_host(FakeRuntime())).release()
    assert made == [_faulting.BACKGROUND_NICE if nice is None else nice]
    assert _faulting.BACKGROUND_NICE > 0


def test_a_progressive_bring_ups_events_count_its_calls_and_bytes_as_they_happen(monkeypatch):
    """What a progressive bring-up tells the library's log: one event per call, numbered from 1 of
    the calls' count, its buffer, the bytes registered so far (the sum of the calls made, up to
    the order's total) and the seconds since the bring-up started; its pre-fault reports pieces
    up to the same total."""
    events = []

    class Listening(_bring_up.ProgressLog):
        def enabled(self) -> bool:
            return True

        def __call__(self, event) -> None:
            events.append(event)

    monkeypatch.setattr(_bring_up, "ProgressLog", Listening)
    order = [(1, 0, 4 * MiB), (0, 0, 4 * MiB), (0, 4 * MiB, 4 * MiB)]
    prefault = []
    before = time.perf_counter()
    handle = bring_up(_requests(8 * MiB, 4 * MiB), mode=Progressive(order=order, max_stall_s=None),
                      host=_host(FakeRuntime(FakeCudart())), report=Report(prefault_progress=prefault.append))
    try:
        assert handle.wait(60)
    finally:
        handle.release()
    elapsed = time.perf_counter() - before
    calls = [event for event in events if hasattr(event, "chunk_index")]
    assert [(e.buffer, e.buffer_index, e.chunk_index, e.chunk_count) for e in calls] == [
        ("kv1", 1, 1, 3), ("kv0", 0, 2, 3), ("kv0", 0, 3, 3)]
    assert [e.bytes_done for e in calls] == [4 * MiB, 8 * MiB, 12 * MiB]
    assert all(e.bytes_total == 12 * MiB for e in calls)
    seconds = [e.elapsed_s for e in calls]
    assert seconds == sorted(seconds) and 0 <= seconds[0] and seconds[-1] <= elapsed
    assert prefault and prefault[-1].bytes_done == prefault[-1].bytes_total == 12 * MiB


def test_a_ctrl_c_in_the_blocking_pre_fault_is_what_the_caller_gets_and_nothing_stays(monkeypatch):
    """A Ctrl-C while the blocking bring-up waits for its pre-fault reaches the caller as the
    KeyboardInterrupt it is - a pre-fault thread's own failure meanwhile does not replace it -
    once the threads have ended; nothing stays mapped, registered or budgeted."""
    class FailingAndInterrupted(_faulting.Prefaulter):
        interrupted = False

        def join(self, *, quiet: bool = False) -> None:
            if not FailingAndInterrupted.interrupted:  # the first wait: a Ctrl-C lands in it
                FailingAndInterrupted.interrupted = True
                super().join(quiet=True)
                self.error = OSError("a pre-fault thread failed meanwhile")
                raise KeyboardInterrupt
            super().join(quiet=quiet)

    monkeypatch.setattr(_steps, "Prefaulter", FailingAndInterrupted)
    runtime, allocator = FakeRuntime(), HostTensorAllocator()
    with pytest.raises(KeyboardInterrupt):
        bring_up(_requests(8 * MiB), mode="blocking", host=_host(runtime, allocator))
    assert FailingAndInterrupted.interrupted
    assert runtime.held() == set() and runtime.cudart.log == [] and all(b.freed for b in allocator.owned())


@st.composite
def _orders(draw):
    """An order over one buffer: the buffer cut every drawn piece (copy units, or 4 KiB pages) and
    at maybe one more 4 KiB point, then maybe an entry dropped, doubled or stretched; shuffled."""
    total = draw(st.integers(1, 64)) * UNIT
    piece = draw(st.sampled_from([UNIT, 2 * UNIT, 4 * UNIT, 16 * UNIT, 4096, 3 * 4096]))
    extra = draw(st.lists(st.integers(1, total // 4096 - 1), max_size=1)) if total > 4096 else []
    edges = sorted({*range(0, total, piece), *(cut * 4096 for cut in extra), total})
    entries = [(0, lo, hi - lo) for lo, hi in zip(edges, edges[1:]) if hi > lo]
    change = draw(st.sampled_from(["none"] * 4 + ["drop", "double", "stretch"]))
    if change != "none":
        at = draw(st.integers(0, len(entries) - 1))
        if change == "drop":
            del entries[at]
        elif change == "double":
            entries.append(entries[at])
        else:
            entries[at] = (0, entries[at][1], entries[at][2] + UNIT)
    return total, draw(st.permutations(entries))


def _legal(total: int, entries, cap: int) -> bool:
    """The oracle, said plainly: sorted, the entries start at 0, each where the last ended, each
    within the cap, every one but the last ending on the copy unit, the last at the end."""
    position = 0
    for number, (_, offset, size) in enumerate(sorted(entries, key=lambda e: e[1])):
        if offset != position or size > cap or (number < len(entries) - 1 and (offset + size) % UNIT):
            return False
        position = offset + size
    return position == total


@given(_orders(), st.sampled_from([UNIT, 4 * UNIT, 64 * UNIT]))
@settings(deadline=None)
def test_an_order_is_taken_exactly_when_it_is_a_legal_plan_of_its_buffer(drawn, cap):
    """Over cut, dropped, doubled and stretched orders: the bring-up's check takes an order
    exactly when the plain statement of the plan's laws holds for it."""
    total, entries = drawn
    plan = plan_registration(total, granularity_bytes=UNIT, limits=Limits(chunk_limit_bytes=cap))
    request = BufferRequest("kv", (total,), None, plan)
    try:
        _bring_up._check_order(tuple(entries), [request])
        taken = True
    except PlanError as refused:
        assert "Progressive.order" in str(refused)
        taken = False
    assert taken == _legal(total, entries, plan.limits.effective_cap_bytes), (entries, total, cap)
