"""CPU page transfers (backup all layers, load per layer) vs a plain copy of the same bytes.

Layouts page_first_direct and layer_first; random host and device page sets (the hard case:
nothing coalesces). Target: >= 0.7 of the plain copy for pages of 64 tokens and more.
Each figure is the best of HICACHE_BENCH_ROUNDS (5) runs, in GB/s.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))

from _timing import best_of, line  # noqa: E402

import torch  # noqa: E402

from hicache.plan import Limits  # noqa: E402
from hicache.pools import MHATokenToKVPoolHost  # noqa: E402
from hicache.testing import MHADevicePool  # noqa: E402

LAYERS, HEADS, DIM = 8, 8, 128
MOVED_PAGES = 256


def main() -> None:
    rounds = int(os.environ.get("HICACHE_BENCH_ROUNDS", "5"))
    for page_size in (16, 64, 128):
        tokens = 4 * MOVED_PAGES * page_size  # room to scatter the moved pages
        device = MHADevicePool(size=tokens, layer_num=LAYERS, head_num=HEADS, head_dim=DIM, page_size=page_size)
        device.randomize()
        generator = torch.Generator().manual_seed(page_size)
        pages = torch.randperm(tokens // page_size, generator=generator)[:MOVED_PAGES] + 1
        device_idx = (pages[:, None] * page_size + torch.arange(page_size)).reshape(-1)
        moved = device_idx.numel() * HEADS * DIM * 2 * 2 * LAYERS  # K and V, bf16, all layers
        source = torch.empty(moved // 2, dtype=torch.bfloat16).random_()
        target = torch.empty_like(source)
        plain = best_of(lambda: target.copy_(source), repeat=rounds)
        for layout in ("page_first_direct", "layer_first"):
            pool = MHATokenToKVPoolHost(device, 1.0, 0, page_size, layout, False, "cpu",
                                        limits=Limits(chunk_limit_bytes=2**30))
            host_slots = pool.alloc(device_idx.numel())
            host_idx = host_slots.view(-1, page_size)[torch.randperm(MOVED_PAGES, generator=generator)].reshape(-1)
            backup = best_of(lambda: pool.backup_from_device_all_layer(device, host_idx, device_idx, "direct"), repeat=rounds)

            def load_all():
                for layer in range(LAYERS):
                    pool.load_to_device_per_layer(device, host_idx, device_idx, layer, "direct")

            load = best_of(load_all, repeat=rounds)
            for what, seconds in (("backup all layers", backup), ("load per layer", load)):
                print(line(f"{layout} {what}, {page_size}-token pages", moved / seconds / 1e9, "GB/s",
                           "plain copy of the same bytes", moved / plain / 1e9))
            pool.destroy()


if __name__ == "__main__":
    main()
