"""Where backed-up data lands in host memory, checked against each layout's definition.

A round trip alone would pass with any self-consistent view; this pins every (page, layer,
token, K/V) to the element SGLang's layout puts it in, with explicit indexing per layout.
"""

from __future__ import annotations

import pytest
from machine import ROOMY
from hypothesis import given, settings
from hypothesis import strategies as st

from hicache.plan import Limits
from hicache.pools import MHATokenToKVPoolHost, MLATokenToKVPoolHost
from hicache.testing import MHADevicePool, MLADevicePool
from hicache.effects import HostSetup

torch = pytest.importorskip("torch")
LIMITS = Limits(chunk_limit_bytes=2**20, os_page_bytes=64)


def mha_host_element(kv_buffer, layout, kv, layer, slot, page_size):
    """The (H, D) block of token ``slot`` of ``layer`` in an MHA host buffer, by definition."""
    page, offset = divmod(slot, page_size)
    if layout == "layer_first":  # (2, L, S, H, D)
        return kv_buffer[kv, layer, slot]
    if layout == "page_first":  # (2, S, L, H, D)
        return kv_buffer[kv, slot, layer]
    if layout == "page_first_direct":  # (2, N, L, P, H, D)
        return kv_buffer[kv, page, layer, offset]
    return kv_buffer[kv, page, :, offset, layer]  # page_head: (2, N, H, P, L, D)


@settings(max_examples=25, deadline=None)
@given(
    layout=st.sampled_from(["layer_first", "page_first", "page_first_direct", "page_head"]),
    page_size=st.sampled_from([1, 2, 4]),
    seed=st.integers(0, 2**16),
    aligned=st.booleans())
def test_mha_backup_puts_each_token_where_the_layout_says(layout, page_size, seed, aligned):
    """After backup, host element (K/V, layer, slot) equals the device token it came from."""
    device = MHADevicePool(size=32, layer_num=3, head_num=2, head_dim=4, page_size=page_size)
    device.randomize(seed)
    pool = MHATokenToKVPoolHost(device, 1.0, 0, page_size, layout, False, "cpu", host=HostSetup(limits=LIMITS, machine=ROOMY))
    try:
        generator = torch.Generator().manual_seed(seed)
        host_idx = pool.alloc(4 * page_size)
        if aligned:
            pages = torch.randperm(device.slots // page_size, generator=generator)[:4]
            device_idx = (pages[:, None] * page_size + torch.arange(page_size)).reshape(-1)
        else:
            device_idx = torch.randperm(device.slots, generator=generator)[: 4 * page_size]
        pool.backup_from_device_all_layer(device, host_idx, device_idx, "direct")
        for kv, buffers in ((0, device.k_buffer), (1, device.v_buffer)):
            for layer in range(3):
                for h, d in zip(host_idx.tolist(), device_idx.tolist()):
                    got = mha_host_element(pool.kv_buffer, layout, kv, layer, h, page_size)
                    assert torch.equal(got, buffers[layer][d])
    finally:
        pool.destroy()


@pytest.mark.parametrize("layout", ["layer_first", "page_first", "page_first_direct"])
def test_mla_backup_puts_each_token_where_the_layout_says(layout):
    """MLA: host (layer, slot) holds the device latent vector of that token."""
    device = MLADevicePool(size=32, layer_num=2, kv_lora_rank=6, qk_rope_head_dim=2, page_size=4)
    device.randomize(5)
    pool = MLATokenToKVPoolHost(device, 1.0, 0, 4, layout, False, "cpu", host=HostSetup(limits=LIMITS, machine=ROOMY))
    host_idx = pool.alloc(8)
    device_idx = torch.arange(12, 20)
    pool.backup_from_device_all_layer(device, host_idx, device_idx, "direct")
    buffer = pool.kv_buffer
    for layer in range(2):
        for h, d in zip(host_idx.tolist(), device_idx.tolist()):
            page, offset = divmod(h, 4)
            got = {
                "layer_first": lambda: buffer[layer, h],  # (L, S, 1, C)
                "page_first": lambda: buffer[h, layer],  # (S, L, 1, C)
                "page_first_direct": lambda: buffer[page, layer, offset],  # (N, L, P, 1, C)
            }[layout]()
            assert torch.equal(got, device.kv_buffer[layer][d])
    pool.destroy()
