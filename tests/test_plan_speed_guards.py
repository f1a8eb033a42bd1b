"""Planning inside a serving process: no garbage collection while ranges are built, and the
arithmetic check of a planner tiling refuses every tiling that breaks a law (so skipping the
range-by-range walk loses nothing). Timing itself lives in benchmarks/bench_plan.py."""

from __future__ import annotations

import gc

import pytest

from hicache.errors import PlanError
from hicache.plan import Limits, RegistrationPlan, plan_registration
from hicache.plan._range import tiling

LIMITS = Limits(chunk_limit_bytes=2**30)


def test_planning_runs_no_garbage_collection_and_restores_the_collector():
    runs = []

    def count(phase, info):
        if phase == "start":
            runs.append(info["generation"])

    old = gc.get_threshold()
    gc.set_threshold(10, 1, 1)  # any tracked allocation burst would collect, full ones too
    gc.callbacks.append(count)
    try:
        plan = plan_registration(4 * 2**40, granularity_bytes=2**21, limits=LIMITS)
        assert plan.call_count == 4096 and runs == []
        assert gc.isenabled()
        gc.disable()
        plan_registration(2**40, granularity_bytes=2**21, limits=LIMITS)
        assert not gc.isenabled()  # restored as it was, not forced on
    finally:
        gc.enable()
        gc.callbacks.remove(count)
        gc.set_threshold(*old)


def _plan(ranges, total, unit=4096, cap=2**20):
    return RegistrationPlan(total_bytes=total, granularity_bytes=unit, step_bytes=ranges.step,
                            limits=Limits(chunk_limit_bytes=cap), ranges=ranges)


def test_a_good_tiling_passes():
    assert _plan(tiling(10 * 2**20 + 4096, 2**20), 10 * 2**20 + 4096).call_count == 11


@pytest.mark.parametrize(
    "ranges, total, why",
    [
        (tiling(8 * 2**20, 2 * 2**20), 8 * 2**20, "step over the cap"),
        (tiling(8 * 2**20, 2**20 - 512), 8 * 2**20, "step not a multiple of the unit"),
        (tiling(8 * 2**20, 2**20), 9 * 2**20, "does not cover the total"),
    ],
)
def test_a_tiling_that_breaks_a_law_is_refused(ranges, total, why):
    with pytest.raises(PlanError):
        _plan(ranges, total)


def test_a_tampered_tiling_is_refused():
    ranges = tiling(8 * 2**20, 2**20)
    ranges.total = 9 * 2**20  # claims more than it holds
    with pytest.raises(PlanError):
        _plan(ranges, 9 * 2**20)
