"""CPU page transfers (backup all layers, load per layer) vs a plain copy of the same bytes.

Layouts page_first_direct, layer_first, page_first (token rows) and page_head (a piece per head); random host and device page sets (the hard case:
nothing coalesces). Target: >= 0.7 of the plain copy for pages of 64 tokens and more.
The plain copy (torch's copy_ of one contiguous tensor) and the transfers are timed in
interleaved rounds (HICACHE_BENCH_ROUNDS, 7); each line gives medians and the per-round range,
so drift on a shared machine hits all of them alike. Two reference lines put the ratios in
context: the same bytes as one block through hicache's own host copy (non-temporal stores,
which the plain copy does not use), and, for 64-token pages, the transfers on the ctypes
memmove fallback (what an install without a C compiler gets) and through the GPU gather engine's
torch runner (its index kernels on CPU, issue #52; page_head's memmove-fallback rows are also its
torch-indexing path before issue #52, which moves a piece per head now). Last, the per-layer call
overhead with the copy itself stubbed out, against a plain copy of one layer's bytes.
"""

from __future__ import annotations

import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))

from _timing import interleaved, median_line  # noqa: E402

import torch  # noqa: E402

from hicache.effects import CopyEngine, HostSetup  # noqa: E402
from hicache.effects._copy import _host_copy  # noqa: E402
from hicache.plan import Limits  # noqa: E402
from hicache.pools import MHATokenToKVPoolHost  # noqa: E402
from hicache.testing import MHADevicePool  # noqa: E402

LAYERS, HEADS, DIM = 8, 8, 128
MOVED_PAGES = 256
LAYOUTS = ("page_first_direct", "layer_first", "page_first", "page_head")
#: the layouts whose transfers are also timed through the gather engine's torch runner
#: (HICACHE_BENCH_GATHER_LAYOUTS): page_first, SGLang's default, and layer_first, the two shapes
#: of its piece tables (a token's row of every layer, one layer's rows); page_first_direct adds
#: 15 s of index building for the same code (`make bench` must fit in 10 minutes), and page_head's
#: runner indexes every word - 7 GB and 10 s a batch here (on a GPU Triton runs it)
GATHER_LAYOUTS = tuple(os.environ.get("HICACHE_BENCH_GATHER_LAYOUTS", "layer_first,page_first").split(","))


class StubEngine(CopyEngine):
    """Prepares (checks) every batch as usual and then copies nothing: the overhead alone."""

    def prepare_parts(self, parts, *, device=None, direction=None, registered=None):
        prepared = super().prepare_parts(parts, device=device, direction=direction, registered=registered)
        prepared.run = lambda: "stub"
        return prepared


def make_pool(device, page_size, layout, copy_engine=None):
    host = HostSetup(limits=Limits(chunk_limit_bytes=2**30), host_memory_bytes=10**15, copy_engine=copy_engine)
    return MHATokenToKVPoolHost(device, 1.0, 0, page_size, layout, False, "cpu", host=host)


def bench_page_size(page_size: int, rounds: int) -> None:
    tokens = 4 * MOVED_PAGES * page_size  # room to scatter the moved pages
    device = MHADevicePool(size=tokens, layer_num=LAYERS, head_num=HEADS, head_dim=DIM, page_size=page_size)
    device.randomize()
    generator = torch.Generator().manual_seed(page_size)
    pages = torch.randperm(tokens // page_size, generator=generator)[:MOVED_PAGES] + 1
    device_idx = (pages[:, None] * page_size + torch.arange(page_size)).reshape(-1)
    moved = device_idx.numel() * HEADS * DIM * 2 * 2 * LAYERS  # K and V, bf16, all layers
    source = torch.empty(moved // 2, dtype=torch.bfloat16).random_()
    target = torch.empty_like(source)
    for layout in LAYOUTS:  # one pool at a time
        pool = make_pool(device, page_size, layout)
        slow = make_pool(device, page_size, layout, copy_engine=CopyEngine(host_copy_mode="python")) if page_size == 64 else None
        # the GPU engine's code on CPU: its torch runner (interpreter-free), so a CPU regression shows
        gather = make_pool(device, page_size, layout, copy_engine=CopyEngine(transfer="gather", gather_runner="torch")) \
            if page_size == 64 and layout in GATHER_LAYOUTS else None
        slots = pool.alloc(device_idx.numel())
        host_idx = slots.view(-1, page_size)[torch.randperm(MOVED_PAGES, generator=generator)].reshape(-1)

        def backup(p=pool):
            p.backup_from_device_all_layer(device, host_idx, device_idx, "direct")

        def load(p=pool):
            for layer in range(LAYERS):
                p.load_to_device_per_layer(device, host_idx, device_idx, layer, "direct")

        jobs = {"plain": lambda: target.copy_(source), "backup all layers": backup, "load per layer": load}
        if layout == LAYOUTS[0]:
            jobs["one block, hicache host copy"] = lambda: _host_copy.copy_host_blocks(
                torch.tensor([target.data_ptr()]), torch.tensor([source.data_ptr()]), torch.tensor([moved])
            )
        if slow is not None:
            jobs["backup all layers, memmove fallback"] = lambda: backup(slow)
            jobs["load per layer, memmove fallback"] = lambda: load(slow)
        if gather is not None:
            jobs["backup all layers, gather engine (torch)"] = lambda: backup(gather)
            jobs["load per layer, gather engine (torch)"] = lambda: load(gather)
        times = interleaved(jobs, rounds=rounds)
        plain = times.pop("plain")
        for what, seconds in times.items():
            print(median_line(f"{layout} {what}, {page_size}-token pages", [t * 1e3 for t in seconds],
                              "plain copy of the same bytes", [t * 1e3 for t in plain], "ms"))
        pool.destroy()
        for extra in (slow, gather):
            if extra is not None:
                extra.destroy()


def bench_overhead(page_size: int, rounds: int) -> None:
    """Per-layer load cost with the copy stubbed: what SGLang pays per layer beyond the bytes.

    Every batch brings new index tensors (other pages, as a server's batches do); its first
    layer pays for checking them, each later layer for its own descriptors: those later layers
    are what is timed, against a plain copy of one layer's bytes."""
    tokens = 4 * MOVED_PAGES * page_size
    device = MHADevicePool(size=tokens, layer_num=LAYERS, head_num=HEADS, head_dim=DIM, page_size=page_size)
    pool = make_pool(device, page_size, "page_first_direct", copy_engine=StubEngine())
    host_slots = pool.alloc(MOVED_PAGES * page_size).view(-1, page_size)
    layer_bytes = MOVED_PAGES * page_size * HEADS * DIM * 2 * 2
    source = torch.empty(layer_bytes // 2, dtype=torch.bfloat16).random_()
    target = torch.empty_like(source)
    generator = torch.Generator().manual_seed(page_size)
    batches = []
    for _ in range(20):  # fresh index tensors per batch: random host and device pages
        device_pages = torch.randperm(tokens // page_size - 1, generator=generator)[:MOVED_PAGES] + 1
        batches.append((
            host_slots[torch.randperm(MOVED_PAGES, generator=generator)].reshape(-1),
            (device_pages[:, None] * page_size + torch.arange(page_size)).reshape(-1),
        ))
    later = []

    def fresh_batches():
        for host_idx, device_idx in batches:
            pool.load_to_device_per_layer(device, host_idx, device_idx, 0, "direct")
            start = time.perf_counter()
            for layer in range(1, LAYERS):
                pool.load_to_device_per_layer(device, host_idx, device_idx, layer, "direct")
            later.append((time.perf_counter() - start) / (LAYERS - 1))

    def one_layer_copy():
        target.copy_(source)

    times = interleaved({"stub": fresh_batches, "plain": one_layer_copy}, rounds=rounds)
    per_round = len(batches)
    per_layer = [statistics.median(later[i:i + per_round]) * 1e6 for i in range(per_round, len(later), per_round)]
    plain = [t * 1e6 for t in times["plain"]]
    print(median_line(f"load_to_device_per_layer call overhead, copy stubbed, {page_size}-token pages, fresh "
                      "batch, layers after its first", per_layer, f"plain copy of one layer's {layer_bytes / 2**20:.0f} MiB",
                      plain, "us"))
    pool.destroy()


def main() -> None:
    rounds = int(os.environ.get("HICACHE_BENCH_ROUNDS", "7"))
    for page_size in (16, 64, 128):
        bench_page_size(page_size, rounds)
    for page_size in (16, 64):
        bench_overhead(page_size, rounds)


if __name__ == "__main__":
    main()
