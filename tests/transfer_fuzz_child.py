"""Child process of tests/test_transfer_fuzz.py: random device-pool tensor lengths (some short)
and random indices; every transfer copies exactly what the round-trip oracle says, or raises
TransferError before copying anything. Run as a script so that a crash (a wild copy) is a
failing exit status, not a dead test runner. Exit 0: every example held."""

from __future__ import annotations

import os
import sys

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

sys.path.insert(0, os.path.dirname(__file__))
from machine import ROOMY  # noqa: E402

from hicache.errors import TransferError  # noqa: E402
from hicache.plan import Limits  # noqa: E402
from hicache.pools import MHATokenToKVPoolHost  # noqa: E402
from hicache.testing import MHADevicePool  # noqa: E402
from hicache.effects import HostSetup

P, LAYERS = 4, 3
EXAMPLES = int(os.environ.get("HICACHE_FUZZ_EXAMPLES", "60"))


def _device(lengths, seed):
    device = MHADevicePool(size=16 * P, layer_num=LAYERS, head_num=2, head_dim=4, page_size=P)
    full = device.k_buffer[0].shape[0]
    names = [(name, layer) for layer in range(LAYERS) for name in ("k_buffer", "v_buffer")]
    for (name, layer), length in zip(names, lengths):
        if (name, layer) != ("k_buffer", 0):  # layer 0's K sets the checked slot count
            getattr(device, name)[layer] = getattr(device, name)[layer][: min(length, full)].clone()
    device.randomize(seed)
    return device


@settings(max_examples=EXAMPLES, deadline=None, database=None)
@given(
    layout=st.sampled_from(["layer_first", "page_first_direct", "page_first"]),
    lengths=st.lists(st.one_of(st.integers(1, 17).map(lambda n: n * P), st.integers(1, 17 * P)),  # whole pages
                     min_size=2 * LAYERS, max_size=2 * LAYERS),                                    # mostly

    pages=st.lists(st.integers(0, 16), min_size=1, max_size=6, unique=True),
    whole_pages=st.booleans(),
    seed=st.integers(0, 2**16))
def check(layout, lengths, pages, whole_pages, seed):
    source = _device(lengths, seed)
    target = _device(lengths, seed + 1)
    target.zero()
    host = MHATokenToKVPoolHost(source, 4.0, 0, P, layout, False, "cpu", host=HostSetup(limits=Limits(chunk_limit_bytes=8192), machine=ROOMY))
    try:
        host_idx = host.alloc(len(pages) * P)
        device_idx = (torch.tensor(pages)[:, None] * P + torch.arange(P)).reshape(-1)
        if not whole_pages:  # token runs that are not whole aligned pages: the torch path
            device_idx = device_idx.flip(0)
        reach = int(device_idx.max())
        short = any(reach >= t.shape[0] for t in source.tensors())
        before = [t.clone() for t in target.tensors()]
        host_before = [b.clone() for b in host.buffers]
        try:
            try:
                host.backup_from_device_all_layer(source, host_idx, device_idx, "direct")
            except TransferError:
                assert all(torch.equal(a, b) for a, b in zip(host_before, host.buffers)), "backup refused after copying"
                raise
            for layer in range(LAYERS):
                host.load_to_device_per_layer(target, host_idx, device_idx, layer, "direct")
        except TransferError:
            assert short, "refused a transfer that fits every tensor"
            assert all(torch.equal(a, b) for a, b in zip(before, target.tensors())), "refused after copying"
            return
        assert not short, f"copied index {reach} past a tensor of {min(t.shape[0] for t in source.tensors())}"
        for src, dst, old in zip(source.tensors(), target.tensors(), before):
            expected = old.clone()
            expected[device_idx] = src[device_idx]  # the oracle: plain torch indexing
            assert torch.equal(dst, expected)
    finally:
        host.destroy()


if __name__ == "__main__":
    check()
    print("ok")
