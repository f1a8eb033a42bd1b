"""The headline property: no page copy straddles two registrations, for every layout.

The oracle is independent of the planner: it builds a (meta, storage-free) torch tensor of each
buffer's shape, takes the views SGLang's transfers copy (one page of one layer, one page of all
layers, per K/V), and reads each view's byte interval from its storage offset and strides.
Every interval must lie inside exactly one planned range.
"""

from __future__ import annotations

import bisect

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from hicache.plan import plan_pool
from tests.strategies import LAYOUT_STRATEGIES, layout_and_limits

torch = pytest.importorskip("torch")

DTYPES = {1: torch.uint8, 2: torch.bfloat16, 4: torch.float32, 8: torch.float64}


def byte_interval(view) -> tuple[int, int]:
    """[start, end) of the bytes a view touches, from its storage offset and strides."""
    itemsize = view.element_size()
    assert view.numel() > 0
    last = sum((size - 1) * stride for size, stride in zip(view.shape, view.stride()))
    start = view.storage_offset() * itemsize
    return start, start + (last + 1) * itemsize


def page_copies(layout, name: str, t):
    """Every view one page copy of ``layout`` reads or writes in buffer ``name``."""
    family, kind = layout.family, layout.layout
    P = getattr(layout, "page_size", 1)
    N = layout.page_num
    if family in ("mha", "mha_k_only", "asymmetric_mha"):
        kv_axes = [(k,) for k in range(2)] if family == "mha" else [()]
        for kv in kv_axes:
            b = t[kv] if kv else t
            L = layout.layer_num
            for p in range(N):
                tokens = slice(p * P, (p + 1) * P)
                if kind == "layer_first":  # (L, S, H, D): one page of one layer
                    yield from (b[l, tokens] for l in range(L))
                elif kind == "page_first":  # (S, L, H, D)
                    yield b[tokens]
                    yield from (b[tokens, l] for l in range(L))
                elif kind == "page_first_direct":  # (N, L, P, H, D)
                    yield b[p]
                    yield from (b[p, l] for l in range(L))
                elif kind == "page_head":  # (N, H, P, L, D)
                    yield b[p]
                    yield from (b[p, h, :, l] for h in range(b.shape[1]) for l in range(L))
    elif family == "mla":
        L = layout.layer_num
        for p in range(N):
            tokens = slice(p * P, (p + 1) * P)
            if kind == "layer_first":  # (L, S, 1, C)
                yield from (t[l, tokens] for l in range(L))
            elif kind == "page_first":  # (S, L, 1, C)
                yield t[tokens]
                yield from (t[tokens, l] for l in range(L))
            else:  # (N, L, P, 1, C)
                yield t[p]
                yield from (t[p, l] for l in range(L))
    elif family == "dsa_indexer":
        for p in range(N):
            if kind == "layer_first":  # (L, N, T)
                yield from (t[l, p] for l in range(layout.layer_num))
            else:  # (N, L, 1, T)
                yield t[p]
                yield from (t[p, l] for l in range(layout.layer_num))
    elif family == "mamba":  # (slots, L, 1, *state): one slot
        for s in range(layout.slots):
            yield t[s]
            yield from (t[s, l] for l in range(layout.layer_num))
    else:  # DeepSeek-V4 rows
        for p in range(N):
            if kind == "layer_first":  # each layer its own (N, R) buffer
                yield t[p]
            else:  # (N, L, R) or (N, L, 1, R)
                yield t[p]
                yield from (t[p, l] for l in range(layout.layer_num))


@pytest.mark.parametrize("family", sorted(LAYOUT_STRATEGIES))
@given(data=st.data())
def test_no_page_copy_straddles_two_registrations(family, data):
    """Every byte interval a page copy touches lies inside exactly one planned range."""
    layout, limits = data.draw(layout_and_limits(family))
    pool = plan_pool(layout, limits)
    for buffer in pool.buffers:
        spec = buffer.spec
        tensor = torch.empty(spec.shape, dtype=DTYPES[spec.itemsize], device="meta")
        ends = [r.end for r in buffer.plan.ranges]
        copies = 0
        for view in page_copies(layout, spec.name, tensor):
            start, end = byte_interval(view)
            index = bisect.bisect_right(ends, start)  # the range holding `start`
            holder = buffer.plan.ranges[index]
            assert holder.offset <= start and end <= holder.end, (
                f"{spec.name}: copy [{start}, {end}) straddles {holder} and its neighbour; "
                f"ranges={buffer.plan.ranges}"
            )
            copies += 1
        assert copies > 0


def test_oracle_catches_a_straddling_split():
    """The oracle itself fails on a split inside a page (so it is not vacuous)."""
    from hicache.plan import Limits, MHALayout, plan_registration

    layout = MHALayout(
        "page_first", layer_num=2, head_num=1, head_dim=4, page_size=2, page_num=3, itemsize=1
    )
    spec = layout.buffers()[0]
    tensor = torch.empty(spec.shape, dtype=torch.uint8, device="meta")
    # A plan on the wrong unit (one token of one layer) lets a cut fall inside a page.
    bad = plan_registration(
        spec.nbytes, granularity_bytes=4, limits=Limits(chunk_limit_bytes=12, os_page_bytes=1)
    )
    ends = [r.end for r in bad.ranges]
    straddles = 0
    for view in page_copies(layout, "kv", tensor):
        start, end = byte_interval(view)
        holder = bad.ranges[bisect.bisect_right(ends, start)]
        straddles += end > holder.end
    assert straddles > 0


def _assert_no_copy_straddles(layout, spec, plan) -> None:
    """Every page copy of buffer ``spec`` lies inside one range of ``plan``."""
    tensor = torch.empty(spec.shape, dtype=DTYPES[spec.itemsize], device="meta")
    ends = [r.end for r in plan.ranges]
    for view in page_copies(layout, spec.name, tensor):
        start, end = byte_interval(view)
        holder = plan.ranges[bisect.bisect_right(ends, start)]
        assert holder.offset <= start and end <= holder.end, (start, end, holder)


@pytest.mark.parametrize("family", sorted(LAYOUT_STRATEGIES))
@given(data=st.data())
def test_paced_plans_keep_every_law_and_the_oracle(family, data):
    """Progressive pools pace their calls (`pace`: a range split into calls of a stall
    budget): the paced plan is a valid RegistrationPlan, no call exceeds the budget unless one
    aligned block does, and still no page copy straddles two registrations."""
    from hicache.plan import pace

    layout, limits = data.draw(layout_and_limits(family))
    pool = plan_pool(layout, limits)
    for buffer in pool.buffers:
        plan = buffer.plan
        if not plan.ranges:
            continue
        index = data.draw(st.integers(0, len(plan.ranges) - 1))
        budget = data.draw(st.integers(1, max(1, plan.ranges[index].size)))
        paced = pace(plan, index, budget)
        alignment = plan.alignment_bytes or plan.granularity_bytes
        new = paced.ranges[index: index + len(paced.ranges) - len(plan.ranges) + 1]
        assert sum(r.size for r in new) == plan.ranges[index].size
        assert all(r.size <= max(budget, alignment) for r in new[:-1]) and new[-1].size <= plan.ranges[index].size
        _assert_no_copy_straddles(layout, buffer.spec, paced)


@pytest.mark.parametrize("family", sorted(LAYOUT_STRATEGIES))
@settings(max_examples=100)  # pace_head is pace (400 examples above) plus the rest kept whole
@given(data=st.data())
def test_a_paced_head_keeps_every_law_and_the_oracle(family, data):
    """The turnstile paces blocking bring-ups call by call (`pace_head`: the next call split
    off a range at the measured budget, the rest kept whole): the result is a valid plan, the
    head fits the budget unless one aligned block does not, head + rest are the range, and
    no page copy straddles two registrations - also after pacing the rest again."""
    from hicache.plan import pace_head

    layout, limits = data.draw(layout_and_limits(family))
    pool = plan_pool(layout, limits)
    for buffer in pool.buffers:
        plan = buffer.plan
        if not plan.ranges:
            continue
        index = data.draw(st.integers(0, len(plan.ranges) - 1))
        target = plan.ranges[index]
        paced = plan
        for _ in range(data.draw(st.integers(1, 3))):  # the rest re-paced at the next call
            budget = data.draw(st.integers(1, max(1, paced.ranges[index].size)))
            before = paced.ranges[index]
            paced = pace_head(paced, index, budget)
            alignment = plan.alignment_bytes or plan.granularity_bytes
            assert len(paced.ranges) - len(plan.ranges) <= 3
            if paced.ranges[index] != before:
                head, rest = paced.ranges[index], paced.ranges[index + 1]
                assert head.size <= max(budget, alignment) and rest.offset == head.end and rest.end == before.end
            if index + 1 < len(paced.ranges) and paced.ranges[index + 1].end <= target.end:
                index += 1  # pace the rest next, as the executor does
        assert paced.total_bytes == plan.total_bytes and [r.offset for r in paced.ranges][0] == 0
        _assert_no_copy_straddles(layout, buffer.spec, paced)
