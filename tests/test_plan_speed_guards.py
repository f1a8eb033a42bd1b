"""Planning inside a serving process: no garbage collection caused by the ranges, and the
arithmetic check of a planner tiling refuses every tiling that breaks a law (so skipping the
range-by-range walk loses nothing). Timing itself lives in benchmarks/bench_plan.py."""

from __future__ import annotations

import gc

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from hicache.errors import PlanError
from hicache.plan import Limits, RegistrationPlan, plan_registration
from hicache.plan._range import Range, tiling

LIMITS = Limits(chunk_limit_bytes=2**30)


def test_planning_leaves_the_collector_alone_and_builds_no_range_objects():
    """The pure core never switches the garbage collector (a process-wide setting), and a
    planner tiling holds no Range objects until they are read, so a 64 TiB plan at 1 GiB chunks
    triggers no collection of a server's heap (kept-alive tuple subclasses are never untracked,
    and 65,536 of them cost a full collection: ~100 ms with torch imported)."""
    runs = []

    def count(phase, info):
        if phase == "start":
            runs.append(info["generation"])

    old = gc.get_threshold()
    switched = []
    real_disable = gc.disable
    try:
        gc.set_threshold(700, 10, 10)  # CPython's defaults
        gc.collect()  # counts start at zero: 700 tracked allocations would collect
        gc.callbacks.append(count)
        gc.disable = lambda: switched.append("disable") or real_disable()
        plan = plan_registration(64 * 2**40, granularity_bytes=2**21, limits=LIMITS)
        assert plan.call_count == 65536 and runs == [] and switched == []
        assert gc.isenabled()
        ranges = list(plan.ranges)  # reading them makes them, each a Range
        assert len(ranges) == 65536 and ranges[0] == Range(0, 2**30) and ranges[-1].end == 64 * 2**40
    finally:
        gc.disable = real_disable
        gc.enable()
        if count in gc.callbacks:
            gc.callbacks.remove(count)
        gc.set_threshold(*old)


def test_a_tiling_reads_compares_and_hashes_as_the_tuple_of_its_ranges():
    """Index, slice, reverse, concatenation, equality and hash agree with the plain tuple."""
    lazy = tiling(10 * 2**20 + 4096, 2**20)
    plain = tuple(Range(o, min(2**20, 10 * 2**20 + 4096 - o)) for o in range(0, 10 * 2**20 + 4096, 2**20))
    assert len(lazy) == len(plain) == 11 and lazy == plain and plain == lazy and hash(lazy) == hash(plain)
    assert lazy[3] == plain[3] and lazy[-1] == plain[-1] == Range(10 * 2**20, 4096) and lazy[2:5] == plain[2:5]
    assert list(reversed(lazy)) == list(reversed(plain)) and lazy + () == plain and () + lazy == plain
    assert lazy != plain[:-1] and lazy != tiling(10 * 2**20 + 4096, 2**19) and tiling(5, 8) == tiling(5, 16)
    with pytest.raises(IndexError):
        lazy[11]


def _plan(ranges, total, unit=4096, cap=2**20):
    return RegistrationPlan(total_bytes=total, granularity_bytes=unit, step_bytes=ranges.step,
                            limits=Limits(chunk_limit_bytes=cap), ranges=ranges)


def test_a_good_tiling_passes():
    """A lazily tiled plan that keeps every law validates with the expected call count."""
    assert _plan(tiling(10 * 2**20 + 4096, 2**20), 10 * 2**20 + 4096).call_count == 11


@pytest.mark.parametrize(
    "ranges, total, why",
    [
        (tiling(8 * 2**20, 2 * 2**20), 8 * 2**20, "step over the cap"),
        (tiling(8 * 2**20, 2**20 - 512), 8 * 2**20, "step not a multiple of the unit"),
        (tiling(2 * 2**20 - 1536, 2**20 - 512), 2 * 2**20 - 1536, "two ranges, the one boundary off the unit"),
        (tiling(8 * 2**20, 2**20), 9 * 2**20, "does not cover the total"),
    ],
)
def test_a_tiling_that_breaks_a_law_is_refused(ranges, total, why):
    """A tiling that breaks a plan law (gap, overlap, cap, straddle) is refused with a PlanError."""
    with pytest.raises(PlanError):
        _plan(ranges, total)


def test_a_tampered_tiling_is_refused():
    """A tiling altered after it was made is refused when the plan checks it."""
    ranges = tiling(8 * 2**20, 2**20)
    ranges._count = 8  # claims 8 ranges but its last one would end past what it holds
    ranges.total = 9 * 2**20
    with pytest.raises(PlanError):
        _plan(ranges, 9 * 2**20)


def _listed(ranges, total, unit=4096, cap=2**20):
    """A hand-built plan: a plain list of Ranges (the validator's list path, not a Tiling)."""
    return RegistrationPlan(total_bytes=total, granularity_bytes=unit, step_bytes=2**20,
                            limits=Limits(chunk_limit_bytes=cap), ranges=[Range(o, s) for o, s in ranges])


def test_a_listed_plan_that_tiles_within_the_cap_passes():
    """An explicit range list that tiles the buffer within the cap passes."""
    assert _listed([(0, 2**20), (2**20, 2**20), (2 * 2**20, 4096)], 2 * 2**20 + 4096).call_count == 3


@pytest.mark.parametrize(
    "ranges, total, says",
    [
        # its last range ends past the buffer: the driver would pin memory that is not ours
        ([(0, 2**20), (2**20, 2**20 + 4096)], 2 * 2**20, "over the cap|total_bytes is"),
        ([(0, 2**20), (2**20, 8192)], 2**20 + 4096, r"cover \[0, 1056768\) but total_bytes is 1052672"),
        # only its last range is over the cap (every other one fits): one call above the ceiling
        ([(0, 2**20), (2**20, 2 * 2**20)], 3 * 2**20, r"ranges\[1\] .* over the cap of 1048576"),
        ([(0, 4096), (4096, 4 * 2**20)], 4 * 2**20 + 4096, r"ranges\[1\] .* over the cap"),
        # the first range over the cap, the last within it
        ([(0, 2 * 2**20), (2 * 2**20, 4096)], 2 * 2**20 + 4096, r"ranges\[0\] .* over the cap"),
    ],
)
def test_a_listed_plan_past_the_buffer_or_over_the_cap_is_refused(ranges, total, says):
    """An explicit range list past the buffer's end or over the cap is refused saying which."""
    with pytest.raises(PlanError, match=says):
        _listed(ranges, total)


def _lawful(ranges, total: int, unit: int | None, cap: int) -> bool:
    """The plan laws written plainly (the oracle): Range values tiling ``[0, total)`` in order,
    each within ``cap``, every interior end a multiple of ``unit``; without a unit one range."""
    ranges = list(ranges)
    if unit is None and len(ranges) > 1:
        return False
    position, ends = 0, []
    for item in ranges:
        if type(item) is not Range or item.offset != position or item.size > cap:
            return False
        position += item.size
        ends.append(position)
    return position == total and (unit is None or all(end % unit == 0 for end in ends[:-1]))


TAMPERS = ("none", "listed", "shift", "resize", "drop-last", "drop-first", "plain-tuple", "one-more")


@settings(max_examples=300)
@given(steps=st.one_of(st.integers(1, 3), st.integers(1, 40)), last=st.integers(1, 40), step_units=st.integers(1, 300),
       unit=st.sampled_from([512, 4096, 3 * 4096]), total_delta=st.sampled_from([0, 0, 0, -512, 512, 4096]),
       tamper=st.sampled_from(("none",) * len(TAMPERS) + TAMPERS[1:]), where=st.integers(0, 10**6),
       delta=st.sampled_from([-512, 1, 512, 4096]))
def test_a_plan_is_accepted_exactly_when_its_ranges_keep_every_law(steps, last, step_units, unit, total_delta,
                                                                   tamper, where, delta):
    """Planner tilings of any step (within the cap or over it, on the unit or off it, one range,
    two, many) and hand-built lists made from them, tampered or not: RegistrationPlan accepts
    exactly what the plain statement of the laws accepts - the tiling's arithmetic check never
    passes what the walk would refuse, and a refusal is a PlanError."""
    cap = 2**20
    step = step_units * 512 * (1 if steps % 3 else 9)  # now and then over the cap
    total = (steps - 1) * step + min(last * 512, step)
    ranges = tiling(total, step)
    if tamper != "none":
        ranges = list(ranges)
        i = where % len(ranges)
        if tamper == "shift":
            ranges[i] = Range(ranges[i].offset + 512, ranges[i].size)
        elif tamper == "resize" and ranges[i].size + delta > 0:
            ranges[i] = Range(ranges[i].offset, ranges[i].size + delta)
        elif tamper == "drop-last":
            ranges.pop()
        elif tamper == "drop-first":
            ranges.pop(0)
        elif tamper == "plain-tuple":
            ranges[i] = tuple(ranges[i])
        elif tamper == "one-more":
            ranges.append(Range(total, 512))
    plan_total = max(0, total + total_delta)
    lawful = _lawful(ranges, plan_total, unit, cap)
    try:
        RegistrationPlan(total_bytes=plan_total, granularity_bytes=unit, step_bytes=step,
                         limits=Limits(chunk_limit_bytes=cap), ranges=ranges)
    except PlanError:
        assert not lawful
    else:
        assert lawful
