"""Page allocator: alloc+free pairs per second, ours vs SGLang's original scheme in one run.

The original keeps a tensor of free token slots, slices it on alloc and concatenates on every
free. Same pool, same sizes (1-8 pages of 64 tokens), same interleaving: a sliding window of 64
live allocations. (The window is bounded because each slice the original hands out pins the
whole free-slot tensor it was cut from: an unbounded working set exhausts memory.)
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))

from _timing import line  # noqa: E402

import torch  # noqa: E402

from hicache.pools import PageAllocator  # noqa: E402

PAGES, PAGE, OPS, WINDOW = 16384, 64, 20000, 64


class SlicingAllocator:
    """SGLang's original: free_slots sliced on alloc, torch.cat on every free."""

    def __init__(self, pages: int, page: int) -> None:
        self.free_slots = torch.arange(pages * page, dtype=torch.int64)

    def alloc(self, n: int):
        if n > self.free_slots.numel():
            return None
        taken, self.free_slots = self.free_slots[:n], self.free_slots[n:]
        return taken

    def free(self, slots) -> None:
        self.free_slots = torch.cat([self.free_slots, slots])


def run(allocator, sizes) -> float:
    held = []
    start = time.perf_counter()
    for pages in sizes:
        held.append(allocator.alloc(pages * PAGE))
        if len(held) > WINDOW:  # a sliding working set of live allocations
            allocator.free(held.pop(0))
    return OPS / (time.perf_counter() - start)


def main() -> None:
    sizes = torch.randint(1, 9, (OPS,), generator=torch.Generator().manual_seed(0)).tolist()
    ours = max(run(PageAllocator(PAGES, PAGE), sizes) for _ in range(3))
    original = max(run(SlicingAllocator(PAGES, PAGE), sizes) for _ in range(3))
    print(line("page allocator alloc+free", ours, "ops/s", "SGLang original (slice + cat per free)", original))


if __name__ == "__main__":
    main()
