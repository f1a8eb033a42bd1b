"""Page allocator at steady state: alloc+free pairs at 10/50/90/99 % occupancy, ours vs the older
SGLang's scheme, one run.

This models SGLang before 0.5.23, which concatenated on every free; 0.5.23 keeps freed runs
aside and merges them lazily - bench_sglang_pools.py times 0.5.23's real pools instead (its
code, not a model). The older scheme keeps a tensor of free token slots, slices it on alloc and concatenates on every
free: cheap when the free list is short (a full, evicting cache - the normal steady state),
costly when it is long. Same pool (1M slots, 64-token pages), same operations: fill to the
occupancy with 1-32-page requests, then pairs of (alloc 1-32 pages, free a random held
allocation) so the occupancy stays put. Medians of interleaved rounds, with min-max.
"""

from __future__ import annotations

import os
import random
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))

from _timing import median_line  # noqa: E402

import torch  # noqa: E402

from hicache.pools import PageAllocator  # noqa: E402

SLOTS, PAGE = 1 << 20, 64
PAGES = SLOTS // PAGE
PAIRS = int(os.environ.get("HICACHE_BENCH_PAIRS", "2000"))


class SlicingAllocator:
    """SGLang's scheme: free_slots sliced on alloc, torch.cat on every free."""

    def __init__(self, pages: int, page: int) -> None:
        self.free_slots = torch.arange(pages * page, dtype=torch.int64)

    def alloc(self, n: int):
        if n > self.free_slots.numel():
            return None
        taken, self.free_slots = self.free_slots[:n], self.free_slots[n:]
        return taken

    def free(self, slots) -> None:
        self.free_slots = torch.cat([self.free_slots, slots])


def _script(occupancy: float, seed: int):
    """The fill sizes and the (alloc size, index of the held allocation to free) pairs."""
    rng = random.Random(seed)
    fill, pages = [], 0
    while pages < occupancy * PAGES - 32:
        size = rng.randint(1, 32)
        fill.append(size)
        pages += size
    pairs = [(rng.randint(1, 32), rng.random()) for _ in range(PAIRS)]
    return fill, pairs


def _pairs_per_second(make, fill, pairs) -> float:
    allocator = make()
    held = [allocator.alloc(size * PAGE) for size in fill]
    start = time.perf_counter()
    for size, which in pairs:
        got = allocator.alloc(size * PAGE)
        if got is not None:
            held.append(got)
        index = int(which * len(held))
        held[index], held[-1] = held[-1], held[index]
        allocator.free(held.pop())
    return len(pairs) / (time.perf_counter() - start)


def main() -> None:
    rounds = int(os.environ.get("HICACHE_BENCH_ROUNDS", "7"))
    for occupancy in (0.10, 0.50, 0.90, 0.99):
        fill, pairs = _script(occupancy, seed=int(occupancy * 100))
        ours, theirs = [], []
        for _ in range(rounds):  # interleaved
            ours.append(1 / _pairs_per_second(lambda: PageAllocator(PAGES, PAGE), fill, pairs))
            theirs.append(1 / _pairs_per_second(lambda: SlicingAllocator(PAGES, PAGE), fill, pairs))
        label = f"page allocator, {occupancy:.0%} full, per alloc+free pair"
        print(median_line(label, [t * 1e6 for t in ours], "SGLang's slice + cat", [t * 1e6 for t in theirs], "us"))


if __name__ == "__main__":
    main()
