"""The CPU versions of sgl-kernel's "direct" io_backend copies (hicache/testing/_sglang_cpu.py) that let
SGLang's own backup/load paths run on a CPU box, against an independent oracle: the per-page
reference loops sgl-kernel's tests state, written out here element by element. Bad input is an
error, never a wild copy. Needs no SGLang."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

torch = pytest.importorskip("torch")

from hicache.testing import _sglang_cpu as cpu  # noqa: E402

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


@settings(max_examples=20, deadline=None)
@given(heads=st.sampled_from([1, 2, 4]), dim=st.sampled_from([4, 8]), layers=st.integers(1, 3),
       seed=st.integers(0, 2**16))
def test_page_heads_kernel_ops_put_each_head_where_the_layout_says(heads, dim, layers, seed):
    """sgl-kernel's page_head ops on CPU: a backup through pointer tables puts token t's head h of
    layer l at ``host[t // P, h, t % P, l]`` of a (N, H, P, L, D) buffer (the layout's definition),
    and the per-layer load brings each layer's rows back; nothing else written."""
    generator = torch.Generator().manual_seed(seed)
    device = [torch.randn(8 * PAGE, heads, dim, generator=generator) for _ in range(layers)]
    host = torch.zeros(3, heads, PAGE, layers, dim)
    device_ids = torch.randperm(8 * PAGE, generator=generator)[: 2 * PAGE]
    host_ids = torch.cat([torch.arange(2 * PAGE, 3 * PAGE), torch.arange(0, PAGE)])
    item, layout_dim = heads * dim * 4, layers * heads * dim * 4
    table = torch.tensor([t.data_ptr() for t in device], dtype=torch.int64)
    cpu.transfer_kv_all_layer_lf_ph(src_k_layers=table, dst_k=host, src_v_layers=table, dst_v=host,
                                    src_indices=device_ids, dst_indices=host_ids, item_size=item,
                                    dst_layout_dim=layout_dim, num_layers=layers, page_size=PAGE, head_num=heads)
    expected = torch.zeros_like(host)
    for t, d in zip(host_ids.tolist(), device_ids.tolist()):
        for layer in range(layers):
            expected[t // PAGE, :, t % PAGE, layer] = device[layer][d]
    assert torch.equal(host, expected)
    for layer in range(layers):
        into = [torch.zeros_like(device[layer]) for _ in range(2)]
        cpu.transfer_kv_per_layer_ph_lf(src_k=host, dst_k=into[0], src_v=host, dst_v=into[1], src_indices=host_ids,
                                        dst_indices=device_ids, layer_id=layer, item_size=item,
                                        src_layout_dim=layout_dim, page_size=PAGE, head_num=heads)
        for got in into:
            assert torch.equal(got[device_ids], device[layer][device_ids])
            assert not got[~torch.isin(torch.arange(8 * PAGE), device_ids)].any()


def test_page_head_and_mamba_kernel_ops_refuse_bad_input_before_any_copy():
    """page_head's ops refuse heads that are not whole words and an index past the host buffer;
    Mamba's JIT ops refuse items that are not 16-byte vectors and a short pointer table - no byte moves."""
    device = [torch.randn(4 * PAGE, 2, 4)]
    host = torch.zeros(1, 2, PAGE, 1, 4)
    table = torch.tensor([device[0].data_ptr()], dtype=torch.int64)
    ids = torch.arange(PAGE)
    common = dict(src_k_layers=table, dst_k=host, src_v_layers=table, dst_v=host, num_layers=1, page_size=PAGE,
                  dst_layout_dim=32, item_size=32)
    with pytest.raises(ValueError, match="whole 8-byte words"):
        cpu.transfer_kv_all_layer_lf_ph(src_indices=ids, dst_indices=ids, head_num=8, **common)
    with pytest.raises(IndexError):  # host page 1 of 1
        cpu.transfer_kv_all_layer_lf_ph(src_indices=ids, dst_indices=ids + PAGE, head_num=2, **common)
    mamba_host = torch.zeros(4, 2, 8)
    with pytest.raises(ValueError, match="multiple of 16"):
        cpu.transfer_kv_mamba_pf_lf(src=mamba_host, dst=torch.zeros(4, 8), src_indices=ids[:2], dst_indices=ids[:2],
                                    layer_id=0, item_size=24, src_layout_dim=64)
    with pytest.raises(ValueError, match="table of 1 layers"):
        cpu.transfer_kv_mamba_lf_pf(src_ptrs=table, dst=mamba_host, src_indices=ids[:2], dst_indices=ids[:2],
                                    item_size=32, dst_layout_dim=64, num_layers=2)
    with pytest.raises(IndexError):  # host slot 4 of 4
        cpu.transfer_kv_mamba_lf_pf(src_ptrs=table, dst=mamba_host, src_indices=ids[:1], dst_indices=torch.tensor([4]),
                                    item_size=32, dst_layout_dim=64, num_layers=1)
    assert not host.any() and not mamba_host.any()
