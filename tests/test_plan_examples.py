"""Pinned examples of the planner (SGLang's own cases among them) and its notes."""

from __future__ import annotations

import pytest

from hicache.plan import (
    DRIVER_CEILING_BYTES,
    KERNEL_PIN_CAP_BYTES,
    Limits,
    MHALayout,
    Range,
    plan_pool,
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
