"""Pinned examples of the planner (SGLang's own cases among them) and its notes."""

from __future__ import annotations

import pytest

from hicache.plan import (
    DRIVER_CEILING_BYTES,
    KERNEL_PIN_CAP_BYTES,
    Limits,
    MHALayout,
    Range,
    RegistrationPlan,
    plan_pool,
    pace,
    plan_registration,
    replan,
)
from hicache.errors import HicacheError, PlanError

GiB, MiB = 2**30, 2**20


def sizes(plan):
    return [r.size for r in plan.ranges]


def test_sglang_2500_mib_at_300_mib_under_1_gib():
    """2500 MiB at 300 MiB granularity under a 1 GiB limit is 900/900/700 MiB at 0/900/1800."""
    plan = plan_registration(2500 * MiB, granularity_bytes=300 * MiB, limits=Limits(chunk_limit_bytes=GiB))
    assert sizes(plan) == [900 * MiB, 900 * MiB, 700 * MiB]
    assert [r.offset for r in plan.ranges] == [0, 900 * MiB, 1800 * MiB]
    assert plan.step_bytes == 900 * MiB


def test_2_gib_plus_17_bytes_at_1_gib_granularity():
    """2 GiB + 17 B at 1 GiB granularity under 1 GiB is 1 GiB, 1 GiB, 17 B."""
    plan = plan_registration(2 * GiB + 17, granularity_bytes=GiB, limits=Limits(chunk_limit_bytes=GiB))
    assert sizes(plan) == [GiB, GiB, 17]


def test_no_granularity_is_one_call_with_a_note_over_the_chunk_limit():
    """granularity None: one range even past the chunk limit, and a note says so."""
    plan = plan_registration(2 * GiB + 17, granularity_bytes=None, limits=Limits(chunk_limit_bytes=GiB))
    assert plan.ranges == (Range(0, 2 * GiB + 17),)
    assert any("chunk limit" in note for note in plan.notes)


def test_no_granularity_at_the_driver_ceiling_is_a_plan_error():
    """An unsplittable buffer of 512 GiB cannot be registered at all: PlanError with numbers."""
    with pytest.raises(PlanError, match=r"549755813888-byte .* at most 548682072064"):
        plan_registration(2**39, granularity_bytes=None, limits=Limits(chunk_limit_bytes=GiB))


def test_no_granularity_over_the_kernel_cap_is_a_plan_error():
    """On a 6.11-6.13 kernel an unsplittable 4 GiB buffer is refused before CUDA sees it."""
    limits = Limits(chunk_limit_bytes=64 * GiB, kernel_cap_bytes=KERNEL_PIN_CAP_BYTES)
    with pytest.raises(PlanError, match="granularity_bytes"):
        plan_registration(4 * GiB, granularity_bytes=None, limits=limits)


def test_chunk_limit_over_the_ceiling_is_clamped_with_a_note():
    """A 1 TiB chunk limit is clamped to the driver ceiling and the notes say so."""
    limits = Limits(chunk_limit_bytes=2**40)
    plan = plan_registration(2**40, granularity_bytes=2 * MiB, limits=limits)
    assert plan.largest_call_bytes <= DRIVER_CEILING_BYTES < 2**39
    assert any("clamped to the driver ceiling" in note for note in plan.notes)
    assert limits.binding_caps() == ("driver_ceiling",)


def test_kernel_cap_binds_when_set():
    """With the 6.11-6.13 kernel cap, no call exceeds it."""
    limits = Limits(chunk_limit_bytes=64 * GiB, kernel_cap_bytes=KERNEL_PIN_CAP_BYTES)
    plan = plan_registration(10 * GiB, granularity_bytes=MiB, limits=limits)
    assert plan.largest_call_bytes <= KERNEL_PIN_CAP_BYTES
    assert limits.binding_caps() == ("kernel_cap",)


def test_600_gib_layer_first_pool_splits_on_one_page_of_one_layer():
    """A 600 GiB layer_first MHA pool is several calls, each boundary on a page of one layer."""
    # Llama-3.1-70B per rank at TP=1: 80 layers, 8 KV heads, head dim 128, bf16, pages of 64.
    unit = 64 * 8 * 128 * 2
    page_num = 600 * GiB // (2 * 80 * 64 * 8 * 128 * 2)
    layout = MHALayout(
        "layer_first", layer_num=80, head_num=8, head_dim=128, page_size=64,
        page_num=page_num, itemsize=2,
    )
    pool = plan_pool(layout, Limits(chunk_limit_bytes=256 * GiB))
    (buffer,) = pool.buffers
    assert buffer.spec.copy_unit_bytes == unit
    assert buffer.plan.call_count == 3
    assert all(r.end % unit == 0 for r in buffer.plan.ranges[:-1])


def test_boundaries_follow_os_pages_and_hugepages_when_they_fit():
    """A 3000-byte unit on 4 KiB pages and 2 MiB hugepages puts boundaries on both."""
    limits = Limits(chunk_limit_bytes=GiB, hugepage_bytes=2 * MiB)
    plan = plan_registration(3000 * 1_000_000, granularity_bytes=3000, limits=limits)
    assert plan.call_count > 1
    assert all(r.end % (2 * MiB) == 0 and r.end % 3000 == 0 for r in plan.ranges[:-1])
    assert plan.alignment_bytes == 786_432_000  # lcm(3000, 2 MiB) = 750 MiB
    assert plan.notes == ()


def test_alignment_that_does_not_fit_the_cap_is_dropped_with_a_note():
    """When unit x hugepage exceeds the cap, copy-unit (and OS page) alignment is kept, noted."""
    limits = Limits(chunk_limit_bytes=4 * MiB, hugepage_bytes=2 * MiB)
    plan = plan_registration(30 * MiB, granularity_bytes=3 * 4096, limits=limits)
    assert all(r.end % (3 * 4096) == 0 for r in plan.ranges[:-1])
    assert any("not hugepage-aligned" in note for note in plan.notes)


def test_an_unaligned_base_gives_up_page_alignment_with_a_note():
    """A base known aligned to 64 B only (torch.empty) keeps copy-unit boundaries, with a note."""
    limits = Limits(chunk_limit_bytes=MiB, base_alignment_bytes=64)
    plan = plan_registration(10 * MiB, granularity_bytes=3000, limits=limits)
    assert plan.alignment_bytes == 3000
    assert any("base address only known aligned to 64 B" in note for note in plan.notes)


def test_zero_byte_buffer_has_no_ranges():
    """A zero-byte buffer is planned as no registration at all."""
    plan = plan_registration(0, granularity_bytes=4096, limits=Limits(chunk_limit_bytes=GiB))
    assert plan.ranges == () and plan.call_count == 0


def test_same_inputs_give_equal_plans():
    """Planning is deterministic: equal inputs, equal (and equally hashed) plans."""
    args = dict(granularity_bytes=300 * MiB, limits=Limits(chunk_limit_bytes=GiB))
    a, b = plan_registration(2500 * MiB, **args), plan_registration(2500 * MiB, **args)
    assert a == b and hash(a) == hash(b)


def test_plan_error_is_part_of_the_error_tree():
    """PlanError is a HicacheError and a ValueError, so callers may catch either."""
    assert issubclass(PlanError, HicacheError) and issubclass(PlanError, ValueError)


def test_replan_halves_the_rest_on_copy_units():
    """After chunk 1 fails, the rest is re-split in halves that stay multiples of the unit."""
    plan = plan_registration(2500 * MiB, granularity_bytes=300 * MiB, limits=Limits(chunk_limit_bytes=GiB))
    retry = replan(plan, failed_index=1)
    assert retry.ranges[0] == plan.ranges[0]
    assert sizes(retry) == [900 * MiB, 300 * MiB, 300 * MiB, 300 * MiB, 300 * MiB, 300 * MiB, 100 * MiB]
    assert all(r.end % (300 * MiB) == 0 for r in retry.ranges[:-1])
    with pytest.raises(PlanError, match="cannot shrink"):
        replan(retry, failed_index=1)


def test_the_largest_call_is_the_largest_range_and_an_empty_plan_has_none():
    """largest_call_bytes: the biggest range (not the first or the last), 0 with no range."""
    plan = plan_registration(2500 * MiB, granularity_bytes=300 * MiB, limits=Limits(chunk_limit_bytes=GiB))
    assert plan.largest_call_bytes == 900 * MiB
    assert plan_registration(0, granularity_bytes=4096, limits=Limits(chunk_limit_bytes=GiB)).largest_call_bytes == 0


@pytest.mark.parametrize("unit", [4096, None])
def test_a_zero_byte_buffer_says_so_and_a_one_byte_one_does_not(unit):
    """Both planners note a zero-byte buffer (no call; without a unit step 0, with one the step
    calls would have); a one-byte buffer is one call without that note."""
    limits = Limits(chunk_limit_bytes=GiB)
    empty, one = plan_registration(0, granularity_bytes=unit, limits=limits), plan_registration(
        1, granularity_bytes=unit, limits=limits)
    assert empty.ranges == () and "zero-byte buffer: nothing to register" in empty.notes
    assert empty.step_bytes == (GiB if unit else 0)
    assert one.ranges == (Range(0, 1),) and not any("zero-byte" in note for note in one.notes)


def test_an_unsplittable_buffer_of_exactly_the_machines_cap_is_one_call():
    """No copy unit: a buffer of exactly the hard cap is one call (the cap is inclusive), and
    exactly the chunk limit draws no over-the-limit note; one byte more of each does."""
    limits = Limits(chunk_limit_bytes=GiB, kernel_cap_bytes=2 * GiB)
    assert plan_registration(2 * GiB, granularity_bytes=None, limits=limits).ranges == (Range(0, 2 * GiB),)
    with pytest.raises(PlanError, match="at most 2147483648"):
        plan_registration(2 * GiB + 1, granularity_bytes=None, limits=limits)
    assert plan_registration(GiB, granularity_bytes=None, limits=limits).notes == ()
    assert any("over the chunk limit" in note
               for note in plan_registration(GiB + 1, granularity_bytes=None, limits=limits).notes)


def test_a_chunk_limit_equal_to_the_ceiling_is_not_clamped():
    """A chunk limit exactly at the driver ceiling draws no clamp note; one byte over does."""
    at = plan_registration(GiB, granularity_bytes=MiB, limits=Limits(chunk_limit_bytes=DRIVER_CEILING_BYTES))
    over = plan_registration(GiB, granularity_bytes=MiB, limits=Limits(chunk_limit_bytes=DRIVER_CEILING_BYTES + 1))
    assert not any("clamped" in note for note in at.notes)
    assert any("clamped to the driver ceiling" in note for note in over.notes)


@pytest.mark.parametrize("ranges", [(Range(0, MiB), Range(MiB, MiB)), (Range(0, MiB), Range(MiB, MiB), Range(2 * MiB, 1))])
def test_a_plan_without_a_copy_unit_is_one_range_or_none(ranges):
    """A hand-built plan without a copy unit that splits its buffer (two ranges or more) is
    refused: with no unit nothing says where a page copy may be cut."""
    total = ranges[-1].end
    with pytest.raises(PlanError, match="without a copy unit must be a single range"):
        RegistrationPlan(total_bytes=total, granularity_bytes=None, step_bytes=MiB,
                         limits=Limits(chunk_limit_bytes=GiB), ranges=ranges)


@pytest.mark.parametrize("unit", [4096, None])
def test_a_zero_byte_plan_with_a_range_is_refused(unit):
    """A plan of a zero-byte buffer that still lists a range would register memory past it."""
    with pytest.raises(PlanError, match=r"total_bytes is 0"):
        RegistrationPlan(total_bytes=0, granularity_bytes=unit, step_bytes=4096,
                         limits=Limits(chunk_limit_bytes=GiB), ranges=(Range(0, 4096),))


@pytest.mark.parametrize("ranges, says", [
    # short of the total, its end off the unit: the total is what is wrong, not the unit
    ((Range(0, 8192), Range(8192, 100)), r"ranges cover \[0, 8292\) but total_bytes is 16384"),
    # the range before the last ends off the unit: named as such, not as a coverage error
    ((Range(0, 4096), Range(4096, 100), Range(4196, 8192)), r"ranges\[1\] \[4096, 4196\) ends at 4196, not a multiple"),
])
def test_a_bad_hand_built_plan_is_named_by_what_it_breaks(ranges, says):
    """The walk that names a bad plan checks every interior end against the unit and only
    those (the last range may end anywhere: at the total)."""
    with pytest.raises(PlanError, match=says):
        RegistrationPlan(total_bytes=16384 if ranges[-1].end == 8292 else ranges[-1].end, granularity_bytes=4096,
                         step_bytes=4096, limits=Limits(chunk_limit_bytes=GiB), ranges=ranges)


def test_a_base_aligned_below_the_hugepage_keeps_os_page_boundaries_with_a_note():
    """A hugepage buffer whose base is known aligned to 4 KiB only: boundaries on the OS page
    (hugepage-aligned offsets would not be hugepage boundaries), and a note says why."""
    limits = Limits(chunk_limit_bytes=3 * MiB, hugepage_bytes=2 * MiB, base_alignment_bytes=4096)
    plan = plan_registration(10 * MiB, granularity_bytes=4096, limits=limits)
    assert plan.alignment_bytes == 4096 and plan.step_bytes == 3 * MiB
    assert any("below the 2 MiB hugepage: boundaries not hugepage-aligned" in note for note in plan.notes)


def test_an_alignment_exactly_the_cap_is_kept():
    """The common multiple of unit and hugepage equal to the cap fits: kept, with no note."""
    plan = plan_registration(10 * MiB, granularity_bytes=4096,
                             limits=Limits(chunk_limit_bytes=2 * MiB, hugepage_bytes=2 * MiB))
    assert plan.alignment_bytes == 2 * MiB and plan.notes == ()


def test_a_one_call_plan_carries_no_alignment_note():
    """Alignment given up matters only between calls: a plan of one call does not mention it."""
    limits = Limits(chunk_limit_bytes=4 * MiB, hugepage_bytes=2 * MiB)
    plan = plan_registration(3 * MiB, granularity_bytes=3 * 4096, limits=limits)
    assert plan.call_count == 1 and plan.notes == ()


def test_replan_refuses_an_index_past_the_plan_and_takes_the_last():
    """replan's failed_index runs over the plan's ranges: one past them is a PlanError naming
    it (not an IndexError); the last one is a valid retry."""
    plan = plan_registration(2500 * MiB, granularity_bytes=300 * MiB, limits=Limits(chunk_limit_bytes=GiB))
    with pytest.raises(PlanError, match="failed_index"):
        replan(plan, failed_index=3)
    assert sizes(replan(plan, failed_index=2))[2:] == [300 * MiB, 300 * MiB, 100 * MiB]


@pytest.mark.parametrize("failed_mib, step_mib, dropped", [
    (8, 4, False),  # half (4 MiB) is two hugepages: hugepage boundaries kept
    (4, 2, False),  # half is exactly one hugepage: still kept
    (2, 1, True),  # half is below one: copy-unit alignment, and the note says so
])
def test_replan_keeps_the_hugepage_alignment_while_half_a_call_holds_one(failed_mib, step_mib, dropped):
    """replan halves the failed call on the plan's boundary alignment (hugepages here) as long
    as half a call holds one aligned block, then on the copy unit - noted only then."""
    limits = Limits(chunk_limit_bytes=failed_mib * MiB, hugepage_bytes=2 * MiB)
    plan = plan_registration(4 * failed_mib * MiB, granularity_bytes=4096, limits=limits)
    assert plan.alignment_bytes == 2 * MiB
    retry = replan(plan, failed_index=0)
    assert retry.step_bytes == step_mib * MiB
    assert retry.alignment_bytes == (4096 if dropped else 2 * MiB)
    assert ("aligned to the copy unit only" in retry.notes[-1]) == dropped


def test_pace_splits_on_the_boundary_alignment_and_notes_only_a_budget_it_cannot_meet():
    """pace cuts a call into multiples of the plan's boundary alignment (2 MiB hugepages here,
    not the 4 KiB unit) at most the budget: a budget of exactly one block draws no note, one
    below it gets blocks of that size and a note; an index past the plan is a PlanError."""
    plan = plan_registration(16 * MiB, granularity_bytes=4096,
                             limits=Limits(chunk_limit_bytes=16 * MiB, hugepage_bytes=2 * MiB))
    assert plan.alignment_bytes == 2 * MiB and plan.call_count == 1
    assert sizes(pace(plan, 0, 5 * MiB)) == [4 * MiB] * 4 and pace(plan, 0, 5 * MiB).notes == ()
    assert sizes(pace(plan, 0, 2 * MiB)) == [2 * MiB] * 8 and pace(plan, 0, 2 * MiB).notes == ()
    below = pace(plan, 0, MiB)
    assert sizes(below) == [2 * MiB] * 8 and "below the 2 MiB boundary alignment" in below.notes[-1]
    with pytest.raises(PlanError, match="index"):
        pace(plan, 1, MiB)
