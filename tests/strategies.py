"""The one home of hypothesis strategies. Inputs are valid by construction (no .filter); sizes
are drawn in small units so shrunk counterexamples read well."""

from __future__ import annotations

import attrs
from hypothesis import strategies as st

from hicache.plan import (
    LAYOUT_CLASSES,
    Limits,
    plan_registration,
)

small = st.integers(min_value=1, max_value=4)
itemsizes = st.sampled_from([1, 2, 4, 8])
powers_of_two = st.integers(min_value=0, max_value=8).map(lambda k: 2**k)


def _layout_names(family: str):
    return st.sampled_from(LAYOUT_CLASSES[family].supported())


def _builds(family: str, **fields):
    return st.builds(LAYOUT_CLASSES[family], _layout_names(family), **fields)


_pages = st.integers(min_value=1, max_value=6)
_shape = st.lists(st.integers(min_value=1, max_value=3), min_size=1, max_size=2).map(tuple)

LAYOUT_STRATEGIES = {
    "mha": _builds(
        "mha", layer_num=small, head_num=small, head_dim=small, page_size=small,
        page_num=_pages, itemsize=itemsizes,
    ),
    "mha_k_only": _builds(
        "mha_k_only", layer_num=small, head_num=small, head_dim=small, page_size=small,
        page_num=_pages, itemsize=itemsizes,
    ),
    "asymmetric_mha": _builds(
        "asymmetric_mha", layer_num=small, head_num=small, k_head_dim=small,
        v_head_dim=small, page_size=small, page_num=_pages, itemsize=itemsizes,
    ),
    "mla": _builds(
        "mla", layer_num=small, kv_cache_dim=small, page_size=small, page_num=_pages,
        itemsize=itemsizes,
    ),
    "dsa_indexer": _builds(
        "dsa_indexer", layer_num=small, index_head_dim=st.integers(1, 12), page_size=small,
        page_num=_pages, quant_block_size=st.integers(1, 8),
    ),
    "mamba": _builds(
        "mamba", layer_num=small, slots=_pages, temporal_shape=_shape,
        temporal_itemsize=itemsizes, conv_shapes=st.lists(_shape, max_size=2).map(tuple),
        conv_itemsize=itemsizes,
    ),
    "deepseek_v4_paged": _builds(
        "deepseek_v4_paged", layer_num=small, page_num=_pages, item_bytes=st.integers(1, 64)
    ),
    "deepseek_v4_state": _builds(
        "deepseek_v4_state", layer_num=small, page_num=_pages,
        state_page_bytes=st.integers(1, 64),
    ),
}
layouts = st.one_of(*LAYOUT_STRATEGIES.values())


@st.composite
def limits_for(draw, unit: int, *, pages=powers_of_two):
    """Limits whose chunk limit admits one copy unit but forces many chunks on small buffers."""
    os_page = draw(pages)
    hugepage = draw(st.none() | st.integers(0, 3).map(lambda k: os_page * 2**k))
    chunk = unit * draw(st.integers(1, 4)) + draw(st.integers(0, unit - 1))
    call_cap = draw(st.none() | st.integers(unit, 2 * chunk))  # issue #53's cap: the smallest, or not
    return Limits(chunk_limit_bytes=chunk, os_page_bytes=os_page, hugepage_bytes=hugepage, call_cap_bytes=call_cap)


@st.composite
def buffer_inputs(draw):
    """(total_bytes, granularity_bytes, limits) for the generic planner, in unit multiples."""
    unit = draw(st.integers(1, 4096))
    total = unit * draw(st.integers(0, 64)) + draw(st.sampled_from([0, 0, 1, unit // 2]))
    limits = draw(limits_for(unit))
    if draw(st.booleans()):
        limits = attrs.evolve(
            limits, kernel_cap_bytes=draw(st.integers(unit, 2 * limits.chunk_limit_bytes))
        )
    return total, unit, limits


@st.composite
def layout_and_limits(draw, family: str | None = None):
    """A layout (of ``family``, or any) and limits that force several chunks on it."""
    layout = draw(LAYOUT_STRATEGIES[family] if family else layouts)
    units = [spec.copy_unit_bytes for spec in layout.buffers()] or [1]
    return layout, draw(limits_for(max(units)))


PAGE = 4096

#: Small registration plans on 4 KiB pages, for the executor's state machine.
registration_plans = st.builds(
    lambda units, unit_pages, chunk_units: plan_registration(
        units * unit_pages * PAGE,
        granularity_bytes=unit_pages * PAGE,
        limits=Limits(chunk_limit_bytes=chunk_units * unit_pages * PAGE),
    ),
    st.integers(1, 12), st.integers(1, 3), st.integers(1, 4),
)

#: CUDA error codes a fault script injects: non-sticky ones, and 700 (sticky).
fault_codes = st.sampled_from([2, 1, 999, 700])


@st.composite
def store_geometries(draw):
    """``(total_bytes, slot_bytes, unit_bytes)`` of a node store arena: slots in 8-byte words,
    sizes in units of the backing's page, enough room for at least one window of slots."""
    unit = draw(st.sampled_from([4096, 2 * 2**20]))
    slot_bytes = 8 * draw(st.integers(min_value=1, max_value=4096))
    stride = -(-slot_bytes // 64) * 64
    index = 4096 + 256 * 256  # after the header and the namespace table
    data = -(-(index + 16 * 64) // unit) * unit  # one window's records, then data on the backing's page
    least = -(-(data + 16 * stride) // unit) * unit
    total = least + draw(st.integers(min_value=0, max_value=64)) * unit + draw(st.integers(min_value=0, max_value=unit - 1))
    return total, slot_bytes, unit


@st.composite
def strided_views(draw):
    """``(shape, narrows, order)``: a contiguous tensor's shape (dims of 0-5), a narrow per dim
    (start, length) inside it and a permutation of the dims - a view as a pool's page slice is
    (narrowed on one axis), or any other strided view of one buffer."""
    shape = tuple(draw(st.lists(st.integers(min_value=0, max_value=5), min_size=1, max_size=4)))
    narrows = []
    for size in shape:
        start = draw(st.integers(min_value=0, max_value=size))
        narrows.append((start, draw(st.integers(min_value=0, max_value=size - start))))
    order = draw(st.permutations(range(len(shape))))
    return shape, narrows, order
