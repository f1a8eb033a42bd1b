"""Capacity math: SGLang's sizing without its extra page, and the budget check."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from hicache.errors import CapacityError, PlanError
from hicache.plan import assess_budget, check_budget, size_pool

GiB, GB = 2**30, 10**9


def test_host_gb_is_decimal_gb_per_rank():
    """host_gb=100 means 100e9 bytes: tokens = 100e9 // size_per_token, pages by ceil."""
    size = size_pool(size_per_token_bytes=327_680, page_size=64, host_gb=100)
    assert size.page_num == -(-(100 * GB // 327_680) // 64)
    assert size.tokens == size.page_num * 64


@given(st.integers(1, 10_000), st.integers(1, 256), st.integers(1, 4096))
def test_page_count_is_a_ceil_with_no_extra_page(pages, page_size, per_token):
    """Page-aligned token counts get exactly their pages; any other count rounds up by one."""
    tokens = pages * page_size
    size = size_pool(
        size_per_token_bytes=per_token, page_size=page_size, device_tokens=tokens,
        host_to_device_ratio=1,
    )
    assert size.page_num == pages
    bumped = size_pool(
        size_per_token_bytes=per_token, page_size=page_size, device_tokens=tokens + 1,
        host_to_device_ratio=1,
    )
    assert bumped.page_num == pages + 1


def test_host_smaller_than_device_is_a_note_not_an_error():
    """A ratio below 1 still sizes the pool and says the host is smaller."""
    size = size_pool(size_per_token_bytes=10, page_size=4, device_tokens=1000, host_to_device_ratio=0.5)
    assert size.tokens == 500 and "smaller than the device pool" in size.notes[0]


@pytest.mark.parametrize(
    "kwargs, pattern",
    [
        (dict(host_gb=-1), r"host_gb must be a positive finite number, got -1"),
        (dict(host_gb=float("nan")), r"host_gb must be a positive finite number"),
        (dict(host_gb=True), r"host_gb must be a number, got True"),
        (dict(), r"needs host_gb, or device_tokens together with host_to_device_ratio"),
        (dict(device_tokens=10, host_to_device_ratio=0), r"host_to_device_ratio must be a positive"),
    ],
)
def test_bad_sizes_are_plan_errors(kwargs, pattern):
    """Negative, NaN, boolean or missing sizes name the field."""
    with pytest.raises(PlanError, match=pattern):
        size_pool(size_per_token_bytes=10, page_size=4, **kwargs)


def test_a_pool_too_small_for_one_token_is_a_capacity_error():
    """A host size below one token's bytes is refused, with GB figures."""
    with pytest.raises(CapacityError, match="holds no token"):
        size_pool(size_per_token_bytes=10**9, page_size=1, host_gb=0.5)


def test_budget_shares_available_minus_reserve_across_ranks():
    """800 GB available, 10 GiB reserve, 8 ranks: each may take (800e9 - 10 GiB) / 8."""
    verdict = assess_budget(90 * GB, available_bytes=800 * GB, ranks_per_host=8)
    assert verdict.per_rank_bytes == (800 * GB - 10 * GiB) // 8
    assert verdict.ok


def test_ranks_that_already_allocated_are_not_counted_twice():
    """The 8th rank sees its peers' pools gone from available and shares with no one."""
    late = assess_budget(80 * GB, available_bytes=100 * GB, ranks_per_host=8, ranks_already_allocated=7)
    assert late.ranks_sharing == 1 and late.ok
    naive = assess_budget(80 * GB, available_bytes=100 * GB, ranks_per_host=8)
    assert not naive.ok


def test_free_hugepages_count_and_cgroup_caps():
    """Reserved hugepages add to what is usable; a cgroup's headroom caps it."""
    verdict = assess_budget(
        100 * GB, available_bytes=50 * GB, free_hugepage_bytes=200 * GB, reserve_bytes=0
    )
    assert verdict.per_rank_bytes == 250 * GB
    capped = assess_budget(
        100 * GB, available_bytes=500 * GB, reserve_bytes=0, cgroup_limit_bytes=120 * GB,
        cgroup_usage_bytes=40 * GB,
    )
    assert capped.per_rank_bytes == 80 * GB and not capped.ok


def test_refused_budget_raises_with_gb_figures_and_a_hint():
    """check_budget refuses with decimal GB figures and says what to change."""
    with pytest.raises(CapacityError, match=r"requested 500\.0 GB per rank; 400\.0 GB available .*Hint: lower"):
        check_budget(500 * GB, available_bytes=400 * GB, reserve_bytes=0)


def test_budget_inputs_are_checked():
    """ranks_already_allocated must leave at least this rank."""
    with pytest.raises(PlanError, match="ranks_already_allocated must be <= 7, got 8"):
        assess_budget(1, available_bytes=1, ranks_per_host=8, ranks_already_allocated=8)
