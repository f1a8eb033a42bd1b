"""Laws of plan_registration and plan_pool, for every family x layout."""

from __future__ import annotations

import json
import math

import attrs
import pytest
from hypothesis import example, given
from hypothesis import strategies as st

from hicache.errors import PlanError
from hicache.plan import (
    Limits,
    Range,
    from_jsonable,
    plan_pool,
    plan_registration,
    replan,
    to_jsonable,
)
from tests.strategies import buffer_inputs, layout_and_limits


def _wanted_alignment(unit: int, limits: Limits) -> int:
    """The boundary multiple a plan should use, restated from the spec (not the planner)."""
    cap = min(limits.caps().values())
    alignment = unit
    pages = [limits.os_page_bytes]
    if limits.hugepage_bytes:
        pages.append(limits.hugepage_bytes)
    for page in pages:
        if limits.base_alignment_bytes % page or math.lcm(alignment, page) > cap:
            break
        alignment = math.lcm(alignment, page)
    return alignment


def assert_plan_laws(plan, total: int, unit: int, limits: Limits) -> None:
    cap = min(limits.caps().values())
    ranges = plan.ranges
    # tiling: in order, no gap, no overlap, exactly [0, total)
    position = 0
    for item in ranges:
        assert isinstance(item, Range)
        assert item.offset == position and item.size > 0
        position = item.end
    assert position == total
    # caps
    assert all(item.size <= cap for item in ranges)
    # alignment of every interior boundary
    alignment = _wanted_alignment(unit, limits)
    for item in ranges[:-1]:
        assert item.end % unit == 0
        assert item.end % alignment == 0
    if alignment != math.lcm(unit, limits.os_page_bytes, limits.hugepage_bytes or 1) and len(
        ranges
    ) > 1:
        assert any("aligned" in note for note in plan.notes), plan.notes
    # fewest ranges for the step: the step is the largest aligned size under the cap
    assert plan.step_bytes % alignment == 0
    assert plan.step_bytes <= cap < plan.step_bytes + alignment
    assert len(ranges) == -(-total // plan.step_bytes)


@given(buffer_inputs())
@example((2500 * 2**20, 300 * 2**20, Limits(chunk_limit_bytes=2**30)))
@example((0, 7, Limits(chunk_limit_bytes=7)))
def test_generic_plans_obey_the_laws(inputs):
    """Any buffer's plan tiles it, respects every cap and alignment, with the fewest ranges."""
    total, unit, limits = inputs
    plan = plan_registration(total, granularity_bytes=unit, limits=limits)
    assert_plan_laws(plan, total, unit, limits)
    assert plan == plan_registration(total, granularity_bytes=unit, limits=limits)


@given(layout_and_limits())
def test_every_layout_plans_every_buffer_lawfully(case):
    """Each buffer of every family x layout gets a lawful plan on its own copy unit."""
    layout, limits = case
    pool = plan_pool(layout, limits)
    assert [b.spec for b in pool.buffers] == list(layout.buffers())
    for buffer in pool.buffers:
        assert_plan_laws(buffer.plan, buffer.spec.nbytes, buffer.spec.copy_unit_bytes, limits)
    assert pool == plan_pool(layout, limits)


@given(layout_and_limits(), st.integers(1, 8))
def test_raising_the_chunk_limit_never_adds_ranges(case, factor):
    """A larger chunk limit gives at most as many calls, for every buffer."""
    layout, limits = case
    bigger = attrs.evolve(limits, chunk_limit_bytes=limits.chunk_limit_bytes * factor)
    small, large = plan_pool(layout, limits), plan_pool(layout, bigger)
    for a, b in zip(small.buffers, large.buffers):
        assert b.plan.call_count <= a.plan.call_count


@given(layout_and_limits())
def test_pool_plans_round_trip_through_json(case):
    """to_jsonable -> json text -> from_jsonable gives back an equal pool plan."""
    pool = plan_pool(*case)
    text = json.dumps(to_jsonable(pool), sort_keys=True)
    assert from_jsonable(json.loads(text)) == pool
    assert json.dumps(to_jsonable(from_jsonable(json.loads(text))), sort_keys=True) == text


@given(buffer_inputs())
def test_registration_plans_round_trip_through_json(inputs):
    """A single buffer's plan survives a JSON round trip exactly."""
    total, unit, limits = inputs
    plan = plan_registration(total, granularity_bytes=unit, limits=limits)
    assert from_jsonable(json.loads(json.dumps(to_jsonable(plan)))) == plan


@given(buffer_inputs(), st.data())
def test_replan_keeps_the_done_part_and_stays_on_copy_units(inputs, data):
    """replan keeps ranges before the failure, re-tiles the rest in smaller unit-aligned steps."""
    total, unit, limits = inputs
    plan = plan_registration(total, granularity_bytes=unit, limits=limits)
    if not plan.ranges:
        return
    index = data.draw(st.integers(0, len(plan.ranges) - 1))
    failed = plan.ranges[index]
    try:
        retry = replan(plan, failed_index=index)
    except PlanError:
        assert failed.size // 2 < unit  # only refused when a half cannot hold one unit
        return
    assert retry.ranges[:index] == plan.ranges[:index]
    assert retry.ranges[-1].end == total and retry.total_bytes == total
    assert all(item.size <= failed.size // 2 for item in retry.ranges[index:])
    assert all(r.end % unit == 0 for r in retry.ranges[:-1])
    assert all(r.end % retry.alignment_bytes == 0 for r in retry.ranges[index:-1])


def test_the_call_cap_is_four_gib_by_default_named_with_its_source_and_splits_a_pool():
    """Resolved with nothing set, the call cap is 4 GiB from "default" and decides the step of a
    37.5 GiB pool (>= 9 calls, every call <= 4 GiB and on copy units); HICACHE_CALL_CAP and the
    flag override it (the flag wins), "none" drops it, and a bad value names the variable."""
    from hicache.errors import EnvError
    from hicache.plan import resolve_limits

    resolved = resolve_limits()
    assert resolved.limits.call_cap_bytes == 4 * 2**30 and resolved.sources["call_cap"] == "default"
    assert resolved.limits.binding_caps() == ("call_cap",)
    unit = 10 * 2**20  # a 64-token page of a 70B model's page_first_direct pool
    total = 3840 * unit  # 37.5 GiB
    plan = plan_registration(total, granularity_bytes=unit, limits=resolved.limits)
    assert plan.call_count >= 9 and plan.largest_call_bytes <= 4 * 2**30
    assert all(r.end % unit == 0 for r in plan.ranges[:-1])
    assert_plan_laws(plan, total, unit, resolved.limits)
    from_env = resolve_limits(env={"HICACHE_CALL_CAP": "2GiB"})
    assert (from_env.limits.call_cap_bytes, from_env.sources["call_cap"]) == (2 * 2**30, "HICACHE_CALL_CAP")
    flag = resolve_limits(env={"HICACHE_CALL_CAP": "2GiB"}, call_cap_bytes=2**30)
    assert (flag.limits.call_cap_bytes, flag.sources["call_cap"]) == (2**30, "--call-cap")
    none = resolve_limits(env={"HICACHE_CALL_CAP": "none"})
    assert none.limits.call_cap_bytes is None and "call_cap" not in none.limits.caps()
    assert plan_registration(total, granularity_bytes=unit, limits=none.limits).call_count == 1
    assert resolve_limits(call_cap_bytes="none").limits.call_cap_bytes is None
    with pytest.raises(EnvError, match="HICACHE_CALL_CAP"):
        resolve_limits(env={"HICACHE_CALL_CAP": "1_0"})


def test_the_call_cap_is_a_choice_not_the_machines_cap():
    """A call cap below the driver's and kernel's caps never lowers `hard_cap_bytes` (what a
    saved plan is checked against on the target machine)."""
    limits = Limits(chunk_limit_bytes=64 * 2**30, call_cap_bytes=2**30, kernel_cap_bytes=2**31 - 2**21)
    assert limits.effective_cap_bytes == 2**30 and limits.hard_cap_bytes == 2**31 - 2**21
