"""The planner: one buffer's size, copy unit and `Limits` -> a frozen `RegistrationPlan`.

Owns the chunking rule (greedy steps of the largest aligned size under the effective cap), the
invariants every plan satisfies (checked on construction, so a plan from anywhere - JSON, evolve,
replan - is safe to apply) and the pure retry policy `replan`.
Pure: imports attrs, the standard library and hicache.errors only.
"""

from __future__ import annotations

import math
from itertools import accumulate
from operator import itemgetter

import attrs

from hicache.errors import CopyUnitOverCapError, PlanError
from hicache.plan.checks import as_tuple, check_int
from hicache.plan._limits import Limits
from hicache.plan._range import Range, Tiling, tiling
from hicache.plan._units import format_bytes
from hicache.plan._value import value_class


_offset, _size = itemgetter(0), itemgetter(1)


def _tiling_holds(ranges: Tiling, cap: int, unit: int | None) -> bool:
    """The laws for a planner tiling, by arithmetic: ``count`` ranges of ``step`` from 0, the
    last one the rest - so they tile ``[0, total)``; each within the cap; every interior
    boundary a multiple of ``step``, hence of the unit when ``step`` is."""
    step, total, count = ranges.step, ranges.total, len(ranges)
    last = total - (count - 1) * step
    return (
        step > 0 and count == -(-total // step) and 0 < last <= step and step <= cap
        and (count == 1 or (unit is not None and step % unit == 0))
    )


def _as_ranges(value) -> tuple:
    """attrs converter: a planner `Tiling` stays one (its laws are then checked by arithmetic)."""
    return value if type(value) is Tiling else tuple(value)


def _check_plan(plan: "RegistrationPlan") -> None:
    """Raise PlanError naming the first range that breaks a plan invariant."""
    total, unit, ranges = plan.total_bytes, plan.granularity_bytes, plan.ranges
    # One unsplittable call is bounded only by the machine's caps (driver, kernel).
    cap = plan.limits.hard_cap_bytes if unit is None else plan.limits.effective_cap_bytes
    if unit is None and len(ranges) > 1:
        raise PlanError("a plan without a copy unit must be a single range")
    # Fast whole-tuple checks in C loops (65,536 ranges in a few ms); the slow scan below only
    # runs to name the offending range.
    if not ranges and total == 0:
        return
    if type(ranges) is Tiling and ranges.total == total and _tiling_holds(ranges, cap, unit):
        return
    if ranges and set(map(type, ranges)) == {Range}:
        offsets = list(map(_offset, ranges))
        sizes = list(map(_size, ranges))
        ends = list(accumulate(sizes))
        interior = ends[:-1]
        if (
            offsets[0] == 0
            and offsets[1:] == interior
            and ends[-1] == total
            and max(sizes) <= cap
            and (unit is None or not any(map(unit.__rmod__, interior)))
        ):
            return
    _explain_bad_plan(ranges, total, cap, unit)


def _explain_bad_plan(ranges, total: int, cap: int, unit: int | None) -> None:
    last = len(ranges) - 1
    position = 0
    for index, item in enumerate(ranges):
        if type(item) is not Range:
            raise PlanError(f"ranges[{index}] must be a Range, got {item!r}")
        if item.offset != position:
            kind = "overlaps the previous range" if item.offset < position else "leaves a gap"
            raise PlanError(f"ranges[{index}] {item} {kind}: expected offset {position}")
        if item.size > cap:
            raise PlanError(f"ranges[{index}] {item} is {item.size} bytes, over the cap of {cap}")
        position = item.end
        if index < last and unit is not None and position % unit:
            raise PlanError(
                f"ranges[{index}] {item} ends at {position}, not a multiple of the copy unit {unit}"
            )
    raise PlanError(f"ranges cover [0, {position}) but total_bytes is {total}")


@value_class
class RegistrationPlan:
    """How to register one buffer: ``ranges`` tile ``[0, total_bytes)`` in order.

    ``granularity_bytes`` is the page-copy unit every interior boundary is a multiple of (None:
    the buffer cannot be split). ``step_bytes`` is the size of every range but the last (after
    a `replan`: of every re-split range but the last);
    ``alignment_bytes`` the multiple boundaries were placed on (the unit, raised to the OS page
    or hugepage when that fits under the cap). ``notes`` say why anything was clamped or dropped.
    """

    total_bytes: int
    granularity_bytes: int | None
    step_bytes: int
    limits: Limits
    ranges: tuple[Range, ...] = attrs.field(converter=_as_ranges)
    notes: tuple[str, ...] = attrs.field(default=(), converter=as_tuple)
    alignment_bytes: int | None = None

    def __attrs_post_init__(self) -> None:
        check_int(PlanError, "RegistrationPlan", "total_bytes", self.total_bytes, minimum=0)
        check_int(PlanError, "RegistrationPlan", "step_bytes", self.step_bytes, minimum=0)
        if not isinstance(self.limits, Limits):
            raise PlanError(f"RegistrationPlan.limits must be a Limits, got {self.limits!r}")
        if self.granularity_bytes is not None:
            check_int(PlanError, "RegistrationPlan", "granularity_bytes", self.granularity_bytes)
        _check_plan(self)

    @property
    def call_count(self) -> int:
        """How many ``cudaHostRegister`` calls the plan makes."""
        return len(self.ranges)

    @property
    def largest_call_bytes(self) -> int:
        """The size of the largest call (0 for an empty plan)."""
        return max((r.size for r in self.ranges), default=0)


def _clamp_notes(limits: Limits) -> list[str]:
    if limits.chunk_limit_bytes <= limits.hard_cap_bytes:
        return []
    which = "driver ceiling" if limits.hard_cap_bytes == limits.hard_ceiling_bytes else "kernel cap"
    return [
        f"chunk limit {format_bytes(limits.chunk_limit_bytes)} clamped to the {which} of "
        f"{format_bytes(limits.hard_cap_bytes)} ({limits.hard_cap_bytes} bytes)"
    ]


def _boundary_alignment(granularity: int, cap: int, limits: Limits) -> tuple[int, list[str]]:
    """The multiple chunk boundaries go on, and notes for any alignment given up.

    Correctness needs only the copy unit (a page copy inside one registration). OS-page and
    hugepage boundaries additionally keep two registrations from sharing a page (vLLM PR
    #51081); they are kept whenever their common multiple with the unit fits under the cap.
    """
    notes: list[str] = []
    alignment = granularity
    if limits.base_alignment_bytes % limits.os_page_bytes:
        notes.append(
            f"base address only known aligned to {limits.base_alignment_bytes} B, below the "
            f"{limits.os_page_bytes} B OS page: boundaries follow the copy unit only"
        )
        return alignment, notes
    for field, page in (("OS page", limits.os_page_bytes), ("hugepage", limits.hugepage_bytes)):
        if page is None:
            continue
        if field == "hugepage" and limits.base_alignment_bytes % page:
            notes.append(
                f"base address only known aligned to {limits.base_alignment_bytes} B, below the "
                f"{format_bytes(page)} hugepage: boundaries not hugepage-aligned"
            )
            break
        wanted = math.lcm(alignment, page)
        if wanted > cap:
            notes.append(
                f"boundaries not {field}-aligned: the common multiple of the copy unit "
                f"({alignment} B) and the {field} ({page} B) is {wanted} B, over the per-call "
                f"cap of {cap} B; copy-unit alignment is kept"
            )
            break
        alignment = wanted
    return alignment, notes


def _tile(total: int, step: int) -> tuple[Range, ...]:
    # Offsets are < total <= 2**63 - 1 and sizes positive: valid by construction.
    return tiling(total, step)


def plan_registration(
    total_bytes: int, *, granularity_bytes: int | None, limits: Limits
) -> RegistrationPlan:
    """Split a ``total_bytes`` buffer into ``cudaHostRegister`` calls.

    Every call is at most ``limits.effective_cap_bytes``; every interior boundary is a multiple
    of ``granularity_bytes`` (the page-copy unit: no page copy straddles two registrations, which
    ``cudaMemcpyBatchAsync`` rejects, sglang PR #36798), and of the OS page/hugepage when that
    fits; the fewest calls for that step. ``granularity_bytes=None``: the buffer cannot be split,
    one call if it fits under the driver/kernel caps.

    Raises ``PlanError`` for bad input, a unit larger than the cap, or an unsplittable buffer
    over the hard cap; the message names the numbers.
    """
    total = check_int(PlanError, "plan_registration", "total_bytes", total_bytes, minimum=0)
    if not isinstance(limits, Limits):
        raise PlanError(f"plan_registration: limits must be a Limits, got {limits!r}")
    notes = _clamp_notes(limits)
    if granularity_bytes is None:
        return _plan_unsplittable(total, limits, notes)
    granularity = check_int(
        PlanError, "plan_registration", "granularity_bytes", granularity_bytes
    )
    cap = limits.effective_cap_bytes
    if granularity > cap:
        binding = limits.binding_caps()
        raise CopyUnitOverCapError(
            f"granularity_bytes={granularity} ({format_bytes(granularity)}) is larger than the "
            f"per-call cap {cap} ({format_bytes(cap)}, {' = '.join(binding)}): "
            "no call can hold one page copy", unit_bytes=granularity, cap_bytes=cap, caps=binding)
    alignment, alignment_notes = _boundary_alignment(granularity, cap, limits)
    step = cap // alignment * alignment
    ranges = _tile(total, step)
    if len(ranges) > 1:
        notes.extend(alignment_notes)
    if total == 0:
        notes.append("zero-byte buffer: nothing to register")
    return RegistrationPlan(
        total_bytes=total,
        granularity_bytes=granularity,
        step_bytes=step,
        limits=limits,
        ranges=ranges,
        notes=tuple(notes),
        alignment_bytes=alignment,
    )


def _plan_unsplittable(total: int, limits: Limits, notes: list[str]) -> RegistrationPlan:
    if total == 0:
        notes.append("zero-byte buffer: nothing to register")
        return RegistrationPlan(total, None, 0, limits, (), tuple(notes))
    if total > limits.hard_cap_bytes:
        raise PlanError(
            f"a {total}-byte ({format_bytes(total)}) buffer without a copy unit must be "
            f"registered in one call, but the machine accepts at most {limits.hard_cap_bytes} "
            f"bytes ({format_bytes(limits.hard_cap_bytes)}) per call; pass granularity_bytes "
            "(the layout's page-copy unit) so it can be split"
        )
    if total > limits.chunk_limit_bytes:
        notes.append(
            f"no copy unit: registered in one {format_bytes(total)} call, over the chunk limit "
            f"of {format_bytes(limits.chunk_limit_bytes)}"
        )
    return RegistrationPlan(total, None, total, limits, (Range(0, total),), tuple(notes))


def replan(plan: RegistrationPlan, *, failed_index: int) -> RegistrationPlan:
    """The retry policy: after call ``failed_index`` failed (not stickily), halve the rest.

    Returns a plan that keeps ``ranges[:failed_index]`` (already registered) and re-splits
    ``[ranges[failed_index].offset, total)`` into chunks of half the failed size, rounded down
    to the plan's boundary alignment - never below the copy unit (sglang PR #39744 halves down
    to 4 KiB and so breaks copy alignment). Raises ``PlanError`` when the chunk cannot shrink.
    """
    if not isinstance(plan, RegistrationPlan):
        raise PlanError(f"replan: plan must be a RegistrationPlan, got {plan!r}")
    index = check_int(
        PlanError, "replan", "failed_index", failed_index, minimum=0, maximum=len(plan.ranges) - 1
    )
    failed = plan.ranges[index]
    unit = plan.granularity_bytes
    if unit is None:
        raise PlanError(f"replan: the buffer has no copy unit, so {failed} cannot be split")
    half = failed.size // 2
    alignment = plan.alignment_bytes or unit
    if half < alignment:  # the page-aligned step no longer fits: keep copy-unit alignment
        alignment = unit
    step = half // alignment * alignment
    if step < unit:
        raise PlanError(
            f"replan: ranges[{index}] {failed} cannot shrink: half of it ({half} B) is below "
            f"the copy unit of {unit} B"
        )
    rest = _tile(plan.total_bytes - failed.offset, step)
    ranges = plan.ranges[:index] + tuple(Range(failed.offset + r.offset, r.size) for r in rest)
    note = f"retry: ranges[{index}] {failed} failed; the rest re-split into {format_bytes(step)} calls"
    if alignment != (plan.alignment_bytes or unit):
        note += f" aligned to the copy unit only ({unit} B)"
    return attrs.evolve(
        plan, step_bytes=step, ranges=ranges, notes=plan.notes + (note,), alignment_bytes=alignment
    )


def pace(plan: RegistrationPlan, index: int, budget_bytes: int) -> RegistrationPlan:
    """The pacing policy: split ``ranges[index]`` into calls of at most ``budget_bytes`` (so no
    call holds the driver lock longer than the caller's stall budget), each a multiple of the
    plan's boundary alignment - never below it: a budget under one aligned block still gives
    blocks of that size, and a note says the budget could not be met. Every law still holds:
    the result is a `RegistrationPlan`, checked range by range."""
    if not isinstance(plan, RegistrationPlan):
        raise PlanError(f"pace: plan must be a RegistrationPlan, got {plan!r}")
    index = check_int(PlanError, "pace", "index", index, minimum=0, maximum=len(plan.ranges) - 1)
    budget = check_int(PlanError, "pace", "budget_bytes", budget_bytes)
    target = plan.ranges[index]
    alignment = plan.alignment_bytes or plan.granularity_bytes or target.size
    step = max(alignment, budget // alignment * alignment)
    if step >= target.size:
        return plan
    pieces = tuple(Range(target.offset + offset, min(step, target.size - offset))
                   for offset in range(0, target.size, step))
    notes = plan.notes
    if step > budget:
        notes += (f"pace: a {format_bytes(budget)} budget is below the {format_bytes(alignment)} boundary "
                  f"alignment; ranges[{index}] split into {format_bytes(step)} calls",)
    return attrs.evolve(plan, ranges=plan.ranges[:index] + pieces + plan.ranges[index + 1:], notes=notes)


def pace_head(plan: RegistrationPlan, index: int, budget_bytes: int) -> RegistrationPlan:
    """Split only the next call off ``ranges[index]``: its first `pace` piece of at most
    ``budget_bytes`` (never below the plan's boundary alignment) and the rest of the range as
    one more range - the executor re-paces that rest at its next call with the rate measured
    meanwhile (a whole range cut to the first, unmeasured budget would be thousands of calls).
    The result is a `RegistrationPlan`, checked range by range."""
    paced = pace(plan, index, budget_bytes)
    if paced is plan:
        return plan
    head, target = paced.ranges[index], plan.ranges[index]
    rest = Range(head.offset + head.size, target.size - head.size)
    return attrs.evolve(plan, ranges=plan.ranges[:index] + (head, rest) + plan.ranges[index + 1:], notes=paced.notes)
