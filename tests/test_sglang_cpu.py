"""The CPU versions of sgl-kernel's "direct" io_backend copies (hicache/_sglang_cpu.py) that let
SGLang's own backup/load paths run on a CPU box, against an independent oracle: the per-page
reference loops sgl-kernel's tests state, written out here element by element. Bad input is an
error, never a wild copy. Needs no SGLang."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

torch = pytest.importorskip("torch")

from hicache import _sglang_cpu as cpu  # noqa: E402

PAGE = 4


def _page_runs(draw, pages_in_pool: int, count: int):
    chosen = draw(st.lists(st.integers(0, pages_in_pool - 1), min_size=count, max_size=count, unique=True))
    return torch.tensor([p * PAGE + t for p in chosen for t in range(PAGE)], dtype=torch.int64)


@st.composite
def _case(draw):
    layers = draw(st.integers(1, 3))
    pages = draw(st.integers(1, 4))
    device_pages, host_pages = 8, 6
    device = [torch.randn(device_pages * PAGE, 2, 3) for _ in range(layers)]
    return layers, device, _page_runs(draw, device_pages, pages), _page_runs(draw, host_pages, pages), host_pages


@settings(max_examples=30, deadline=None)
@given(_case())
def test_all_layer_backup_then_per_layer_load_matches_the_reference_loops(case):
    """All-layer backup then per-layer load on CPU moves exactly the named rows, as SGLang's
    reference loops do."""
    layers, device, device_indices, host_indices, host_pages = case
    host = torch.zeros(host_pages, layers, PAGE, 2, 3)
    cpu.transfer_kv_all_layer_direct_lf_pf(src_ptrs=device, dst_ptrs=[host], src_indices=device_indices,
                                           dst_indices=host_indices, page_size=PAGE)
    for layer in range(layers):  # the oracle: token by token
        for i in range(len(host_indices)):
            h, d = int(host_indices[i]), int(device_indices[i])
            assert torch.equal(host[h // PAGE, layer, h % PAGE], device[layer][d])
    back = [torch.zeros_like(t) for t in device]
    for layer in range(layers):
        cpu.transfer_kv_per_layer_direct_pf_lf(src_ptrs=[host], dst_ptrs=[back[layer]], src_indices=host_indices,
                                               dst_indices=device_indices, layer_id=layer, page_size=PAGE)
        assert torch.equal(back[layer][device_indices], device[layer][device_indices])
        untouched = torch.ones(len(back[layer]), dtype=torch.bool)
        untouched[device_indices] = False
        assert not back[layer][untouched].any()  # nothing outside the named rows
    flat = [torch.zeros_like(t) for t in device]
    cpu.transfer_kv_direct(src_layers=device, dst_layers=flat, src_indices=device_indices,
                           dst_indices=device_indices, page_size=PAGE)
    assert all(torch.equal(a[device_indices], b[device_indices]) for a, b in zip(flat, device))


def test_bad_indices_and_short_tensors_are_errors_not_wild_copies():
    """Fractional, unaligned or out-of-range indices and short tensors raise before any copy."""
    device = [torch.randn(8 * PAGE, 2)]
    host = torch.zeros(2, 1, PAGE, 2)
    whole = torch.arange(PAGE)
    with pytest.raises(ValueError, match="whole number"):
        cpu.transfer_kv_all_layer_direct_lf_pf(src_ptrs=device, dst_ptrs=[host], src_indices=whole[:3],
                                               dst_indices=whole[:3], page_size=PAGE)
    with pytest.raises(ValueError, match="page-aligned"):
        cpu.transfer_kv_per_layer_direct_pf_lf(src_ptrs=[host], dst_ptrs=device, src_indices=whole + 1,
                                               dst_indices=whole, layer_id=0, page_size=PAGE)
    with pytest.raises(IndexError):  # host page 5 of 2
        cpu.transfer_kv_all_layer_direct_lf_pf(src_ptrs=device, dst_ptrs=[host], src_indices=whole,
                                               dst_indices=whole + 5 * PAGE, page_size=PAGE)
    with pytest.raises(IndexError):  # device row past the end
        cpu.transfer_kv_direct(src_layers=device, dst_layers=[torch.zeros(PAGE, 2)], src_indices=whole,
                               dst_indices=whole + 1, page_size=PAGE)
    with pytest.raises(ValueError, match="layers"):
        cpu.transfer_kv_all_layer_direct_lf_pf(src_ptrs=device * 2, dst_ptrs=[host], src_indices=whole,
                                               dst_indices=whole, page_size=PAGE)
    assert not host.any()
