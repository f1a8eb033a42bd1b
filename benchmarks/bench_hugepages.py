"""Page size for host pools: allocate + pre-fault of 2 GiB (freed after the clock stops) with
4 KiB pages against transparent huge pages (MADV_HUGEPAGE) and, where the machine has them
reserved, hugetlbfs 2 MiB pages. Medians of HICACHE_BENCH_ROUNDS (7) interleaved rounds with the per-round range.
The default (`hugepages="off"`, 4 KiB) is chosen from these figures: see the README.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))

from _timing import interleaved, median_line  # noqa: E402

import torch  # noqa: E402,F401  (the state users run in)

from hicache.effects._host._memory import allocate_host, free_hugepages, prefault  # noqa: E402


def bring(nbytes: int, mode: str):
    buffer = allocate_host(nbytes, hugepages=mode)
    prefault(buffer)
    return buffer.free  # untimed


def main() -> None:
    gib = float(os.environ.get("HICACHE_BENCH_GIB", "2"))
    nbytes = int(gib * 2**30)
    jobs = {"4k": lambda: bring(nbytes, "off"), "thp": lambda: bring(nbytes, "thp")}
    _, free = free_hugepages(2 * 2**20)
    if free * 2 * 2**20 >= nbytes:
        jobs["hugetlbfs"] = lambda: bring(nbytes, "required")
    times = interleaved(jobs, rounds=int(os.environ.get("HICACHE_BENCH_ROUNDS", "7")))
    ms = {k: [t * 1e3 for t in v] for k, v in times.items()}
    for name in jobs:
        if name != "4k":
            print(median_line(f"allocate+prefault {gib:g} GiB, {name}", ms[name], "4 KiB pages", ms["4k"], "ms"))
    if "hugetlbfs" not in jobs:
        print(f"  hugetlbfs: not measured ({free} free 2 MiB pages reserved; needs {nbytes // (2 * 2**20)})")


if __name__ == "__main__":
    main()
