"""The transfer index memo's law: whatever it reuses, a check returns the indices given now, checked
under the bounds given now (the memo only saves work: `check_indices` is its oracle)."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from hicache.errors import TransferError
from hicache.pools._indices import IndexMemo, aligned_pages, check_indices

torch = pytest.importorskip("torch")

#: what happens to the two index tensors (or the bounds) before the next check
CHANGES = ("same", "host in place", "device in place", "both in place", "new host", "new device", "new equal",
           "new both", "bounds")


def _equal(a, b) -> bool:
    return (a is None and b is None) or (a is not None and b is not None and torch.equal(a, b))


@settings(max_examples=150, deadline=None)
@given(st.lists(st.tuples(st.sampled_from(CHANGES), st.integers(0, 40)), min_size=1, max_size=14))
def test_a_check_returns_the_indices_given_checked_under_the_bounds_given(steps):
    """Over any sequence of checks - the same tensors, changed in place (one or both), new ones
    with equal or other values, new bounds - the memo's answer is `check_indices`' of the call:
    the same indices and pages, or the same refusal."""
    memo = IndexMemo()
    host, device = torch.arange(8), torch.arange(8, 16)
    host_slots, device_slots, page_size = 64, 64, 4
    for change, value in steps:
        if change == "host in place":
            host[value % 8] = value
        elif change == "device in place":
            device[value % 8] = value
        elif change == "both in place":
            host[value % 8] = value
            device[(value + 3) % 8] = value
        elif change == "new host":
            host = host.clone()
            host[value % 8] = value
        elif change == "new device":
            device = device.clone()
            device[value % 8] = value
        elif change == "new equal":
            host, device = host.clone(), device.clone()
        elif change == "new both":
            host, device = host.clone(), device.clone()
            host[value % 8], device[(value + 5) % 8] = value, value
        elif change == "bounds":
            host_slots, device_slots, page_size = 16 + value, 16 + (7 * value) % 30, (1, 2, 4)[value % 3]
        try:
            expected = check_indices(host, device, host_slots=host_slots, device_slots=device_slots)
        except TransferError:
            with pytest.raises(TransferError):
                memo.check(host, device, host_slots=host_slots, device_slots=device_slots, page_size=page_size)
            continue
        got = memo.check(host, device, host_slots=host_slots, device_slots=device_slots, page_size=page_size)
        assert torch.equal(got.hidx, expected[0]) and torch.equal(got.didx, expected[1])
        assert _equal(got.hpages, aligned_pages(expected[0], page_size))
        assert _equal(got.dpages, aligned_pages(expected[1], page_size))


@pytest.mark.parametrize("which", ["host", "device"])
def test_a_hit_never_hands_out_a_change_made_in_place_after_the_check(which):
    """The memo's checked indices are its own: the caller's int64 tensors changed in place after a
    check (to an index past the pool, refused then), a new tensor of the checked values is a hit
    that hands out those values - never the changed ones, which no check would pass (a copy
    past the pool's buffer). Found by the law above: the checked indices were the caller's tensors."""
    memo = IndexMemo()
    host, device = torch.arange(8), torch.arange(8, 16)
    first = memo.check(host, device, host_slots=16, device_slots=16, page_size=1)
    changed = host if which == "host" else device
    changed[0] = 24  # past both pools
    with pytest.raises(TransferError):
        memo.check(host, device, host_slots=16, device_slots=16, page_size=1)
    again = memo.check(torch.arange(8), torch.arange(8, 16), host_slots=16, device_slots=16, page_size=1)
    assert again is first  # a hit by value
    assert again.hidx.tolist() == list(range(8)) and again.didx.tolist() == list(range(8, 16))
    assert again.hpages.tolist() == list(range(8)) and again.dpages.tolist() == list(range(8, 16))


def test_the_same_unchanged_tensors_are_a_hit_without_comparing_values(monkeypatch):
    """The common case - SGLang's same two tensors, layer after layer - reuses the last check by
    identity and version alone (no value comparison: that is the saving the memo is for)."""
    memo = IndexMemo()
    host, device = torch.arange(8), torch.arange(8, 16)
    first = memo.check(host, device, host_slots=64, device_slots=64, page_size=4)
    monkeypatch.setattr(torch, "equal", lambda *_: pytest.fail("compared values for the very same tensors"))
    assert memo.check(host, device, host_slots=64, device_slots=64, page_size=4) is first
