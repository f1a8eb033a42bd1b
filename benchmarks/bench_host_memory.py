"""Host bring-up of a multi-GiB buffer: allocate + pre-fault, ours vs two baselines, one run.

- ours: hicache allocate_host + prefault (MADV_POPULATE_WRITE through ctypes, N threads)
- baseline A: one mmap.madvise(MADV_POPULATE_WRITE) from Python (holds the GIL, one thread)
- baseline B: torch.empty + writing one byte per page (what "touch it first" code does)
Size: HICACHE_BENCH_GIB (default 2); medians of HICACHE_BENCH_ROUNDS (7) interleaved rounds
with the per-round range (the machines are shared and noisy); speed = baseline time / ours.
"""

from __future__ import annotations

import mmap
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))

from _timing import interleaved, median_line  # noqa: E402

import torch  # noqa: E402

from hicache.effects import allocate_host, prefault  # noqa: E402

MADV_POPULATE_WRITE = 23


def ours(nbytes: int) -> None:
    buffer = allocate_host(nbytes)
    prefault(buffer)
    buffer.free()


def python_madvise(nbytes: int) -> None:
    mapping = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    mapping.madvise(MADV_POPULATE_WRITE)
    mapping.close()


def torch_touch(nbytes: int) -> None:
    tensor = torch.empty(nbytes, dtype=torch.uint8)
    tensor[:: os.sysconf("SC_PAGE_SIZE")] = 0
    del tensor


def main() -> None:
    gib = float(os.environ.get("HICACHE_BENCH_GIB", "2"))
    nbytes = int(gib * 2**30)
    times = interleaved(
        {"ours": lambda: ours(nbytes), "madvise": lambda: python_madvise(nbytes), "touch": lambda: torch_touch(nbytes)},
        rounds=int(os.environ.get("HICACHE_BENCH_ROUNDS", "7")),
    )
    threads = min(os.cpu_count() or 1, 16)
    label = f"host bring-up {gib:g} GiB, allocate+prefault+free ({threads} threads)"
    ms = {name: [t * 1e3 for t in values] for name, values in times.items()}
    print(median_line(label, ms["ours"], "one mmap.madvise(MADV_POPULATE_WRITE) from Python", ms["madvise"], "ms"))
    print(median_line(label, ms["ours"], "torch.empty + touch each page", ms["touch"], "ms"))


if __name__ == "__main__":
    main()
