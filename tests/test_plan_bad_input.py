"""Bad input gets a LayoutError/PlanError naming the field and the value - never an assert,
a bare TypeError from deep inside, or a silently clamped value."""

from __future__ import annotations

import pytest

from hicache.errors import LayoutError, PlanError
from hicache.plan import (
    AsymmetricMHALayout,
    DSAIndexerLayout,
    Limits,
    MambaLayout,
    MHAKOnlyLayout,
    MHALayout,
    MLALayout,
    Range,
    plan_pool,
    plan_registration,
)

MHA = dict(layer_num=2, head_num=2, head_dim=4, page_size=2, page_num=3, itemsize=2)
LIMITS = Limits(chunk_limit_bytes=2**30)


@pytest.mark.parametrize(
    "field, value, pattern",
    [
        ("layer_num", -1, r"MHALayout\.layer_num must be positive, got -1"),
        ("head_num", 0, r"MHALayout\.head_num must be positive, got 0"),
        ("head_dim", True, r"MHALayout\.head_dim must be an integer, got True"),
        ("page_size", 2.0, r"MHALayout\.page_size must be an integer, got 2\.0"),
        ("itemsize", 0, r"MHALayout\.itemsize must be positive, got 0"),
        ("page_num", "3", r"MHALayout\.page_num must be an integer, got '3'"),
    ],
)
def test_bad_dimensions_name_field_and_value(field, value, pattern):
    """Negative, zero, bool, float or string dimensions are LayoutErrors naming the field."""
    with pytest.raises(LayoutError, match=pattern):
        MHALayout("page_first", **{**MHA, field: value})


def test_unknown_layout_name_lists_the_supported_ones():
    """An unknown layout name is a LayoutError listing what the family supports."""
    with pytest.raises(LayoutError, match=r"one of layer_first, page_first, page_first_direct, page_head; got 'page_last'"):
        MHALayout("page_last", **MHA)


@pytest.mark.parametrize(
    "build",
    [
        lambda: MHAKOnlyLayout("page_head", **MHA),
        lambda: AsymmetricMHALayout(
            "layer_first", layer_num=1, head_num=1, k_head_dim=2, v_head_dim=3,
            page_size=1, page_num=1, itemsize=2,
        ),
        lambda: MLALayout("page_head", layer_num=1, kv_cache_dim=576, page_size=1, page_num=1, itemsize=2),
        lambda: MambaLayout(
            "layer_first", layer_num=1, slots=1, temporal_shape=(1,), temporal_itemsize=4,
            conv_shapes=(), conv_itemsize=2,
        ),
    ],
)
def test_unsupported_family_layout_pairs_are_layout_errors(build):
    """A family x layout pair SGLang does not support is refused with the supported list."""
    with pytest.raises(LayoutError, match="must be one of"):
        build()


def test_buffers_past_2_63_are_refused():
    """A descriptor whose buffer would exceed 2**63 - 1 bytes is a LayoutError."""
    with pytest.raises(LayoutError, match=r"past 2\*\*63"):
        MHALayout("page_first", **{**MHA, "page_num": 2**62})


def test_dimension_past_2_63_is_refused():
    """A single dimension past 2**63 - 1 is a LayoutError naming it."""
    with pytest.raises(LayoutError, match=r"page_num must be <= 9223372036854775807"):
        MHALayout("page_first", **{**MHA, "page_num": 2**63})


def test_mamba_shapes_must_be_integer_tuples():
    """Mamba state shapes with a bad entry name the entry."""
    with pytest.raises(LayoutError, match=r"conv_shapes\[0\]\[1\] must be an integer"):
        MambaLayout(
            "page_first", layer_num=1, slots=1, temporal_shape=(2,), temporal_itemsize=4,
            conv_shapes=((2, 1.5),), conv_itemsize=2,
        )


def test_dsa_quant_block_size_must_be_positive():
    """quant_block_size=0 is a LayoutError, not a ZeroDivisionError."""
    with pytest.raises(LayoutError, match="quant_block_size must be positive, got 0"):
        DSAIndexerLayout("page_first", layer_num=1, index_head_dim=128, page_size=64, page_num=1, quant_block_size=0)


@pytest.mark.parametrize(
    "kwargs, pattern",
    [
        (dict(chunk_limit_bytes=0), r"Limits\.chunk_limit_bytes must be positive, got 0"),
        (dict(chunk_limit_bytes=1.5), r"chunk_limit_bytes must be an integer, got 1\.5"),
        (dict(chunk_limit_bytes=10, os_page_bytes=3000), r"os_page_bytes must be a power of two, got 3000"),
        (dict(chunk_limit_bytes=10, hugepage_bytes=2048), r"hugepage_bytes \(2048\) must be a multiple of os_page_bytes"),
        (dict(chunk_limit_bytes=10, kernel_cap_bytes=-5), r"kernel_cap_bytes must be positive, got -5"),
    ],
)
def test_bad_limits_name_field_and_value(kwargs, pattern):
    """Limits refuse bad caps and page sizes by field name and value."""
    with pytest.raises(PlanError, match=pattern):
        Limits(**kwargs)


@pytest.mark.parametrize(
    "total, granularity, pattern",
    [
        (-1, 4096, r"total_bytes must be >= 0, got -1"),
        (2**63, 4096, r"total_bytes must be <= 9223372036854775807"),
        (4096, 0, r"granularity_bytes must be positive, got 0"),
        (4096, -4096, r"granularity_bytes must be positive, got -4096"),
        (4096.0, 4096, r"total_bytes must be an integer, got 4096\.0"),
        (4096, False, r"granularity_bytes must be an integer, got False"),
    ],
)
def test_bad_plan_inputs_are_plan_errors(total, granularity, pattern):
    """plan_registration refuses bad sizes by field name and value."""
    with pytest.raises(PlanError, match=pattern):
        plan_registration(total, granularity_bytes=granularity, limits=LIMITS)


def test_granularity_above_the_cap_names_both_numbers():
    """A copy unit larger than the per-call cap is a PlanError with both numbers."""
    with pytest.raises(PlanError, match=r"granularity_bytes=2147483648 .* per-call cap 1073741824"):
        plan_registration(2**32, granularity_bytes=2**31, limits=LIMITS)


def test_limits_must_be_limits():
    """Passing a dict for limits is a PlanError, not an AttributeError."""
    with pytest.raises(PlanError, match="limits must be a Limits"):
        plan_registration(10, granularity_bytes=1, limits={"chunk_limit_bytes": 10})


def test_plan_pool_refuses_non_layouts():
    """plan_pool names what it expected when given something else."""
    with pytest.raises(LayoutError, match="layout must be one of"):
        plan_pool("page_first", LIMITS)


@pytest.mark.parametrize("offset, size", [(-1, 1), (0, 0), (0, 1.0), (2**63 - 1, 1)])
def test_bad_ranges_are_refused(offset, size):
    """Range refuses negative offsets, empty or non-integer sizes, and ends past 2**63 - 1."""
    with pytest.raises(PlanError):
        Range(offset, size)


class _Int32:
    """Stands in for numpy.int32: an integer (``__index__``) whose own arithmetic wraps at 32 bits."""

    def __init__(self, value):
        self.value = value

    def __index__(self):
        return self.value

    def __mul__(self, other):
        product = (self.value * int(other)) & 0xFFFFFFFF
        return _Int32(product - 2**32 if product >= 2**31 else product)

    __rmul__ = __mul__


def test_fixed_width_integers_become_python_ints_and_cannot_overflow():
    """np.int32(600000) pages used to make a negative total_bytes: every integer field is
    converted with operator.index into a Python int first."""
    from hicache.plan import Limits, MHALayout

    layout = MHALayout("page_first", layer_num=_Int32(80), head_num=_Int32(8), head_dim=_Int32(128),
                       page_size=_Int32(64), page_num=_Int32(600_000), itemsize=_Int32(2))
    assert type(layout.page_num) is int and layout.total_bytes == 2 * 600_000 * 64 * 80 * 8 * 128 * 2
    limits = Limits(chunk_limit_bytes=_Int32(2**30), hugepage_bytes=_Int32(2**21))
    assert type(limits.chunk_limit_bytes) is int and type(limits.hugepage_bytes) is int
    with pytest.raises(PlanError, match="must be an integer"):
        Limits(chunk_limit_bytes=True)


def test_a_page_copy_over_the_call_cap_carries_its_numbers_and_the_caps_that_decide():
    """A copy unit over the per-call cap is a `CopyUnitOverCapError` (a PlanError) carrying the
    unit, the cap and every cap that decides - kept through `plan_pool`, which names the buffer
    (it re-raised a bare PlanError, so no caller could tell which cap to raise)."""
    from hicache.errors import CopyUnitOverCapError

    limits = Limits(chunk_limit_bytes=2**20, call_cap_bytes=2**20)
    with pytest.raises(CopyUnitOverCapError) as raised:
        plan_registration(2**24, granularity_bytes=3 * 2**20, limits=limits)
    assert (raised.value.unit_bytes, raised.value.cap_bytes, raised.value.caps) == (3 * 2**20, 2**20,
                                                                                     ("chunk_limit", "call_cap"))
    layout = MHALayout("page_first_direct", **{**MHA, "page_size": 2**16})  # a page copy of 2 x 2 x 4 x 2 x 64 Ki bytes
    with pytest.raises(CopyUnitOverCapError, match=r"^buffer 'kv' \(page_first_direct\): granularity_bytes=") as raised:
        plan_pool(layout, Limits(chunk_limit_bytes=2**20))
    assert raised.value.caps == ("chunk_limit",) and raised.value.unit_bytes > raised.value.cap_bytes
    assert isinstance(raised.value, PlanError)
