"""Host bring-up of a multi-GiB buffer: allocate + pre-fault, ours vs two baselines, one run.

- ours: hicache allocate_host + prefault (MADV_POPULATE_WRITE through ctypes, N threads)
- baseline A: one mmap.madvise(MADV_POPULATE_WRITE) from Python (holds the GIL, one thread)
- baseline B: torch.empty + writing one byte per page (what "touch it first" code does)
Size: HICACHE_BENCH_GIB (default 2); best of HICACHE_BENCH_ROUNDS (3) interleaved rounds, as
the machines are shared and noisy. Each figure is GB/s; ratio = ours / baseline.
"""

from __future__ import annotations

import mmap
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))

from _timing import line  # noqa: E402

import torch  # noqa: E402

from hicache.effects import allocate_host, prefault  # noqa: E402

MADV_POPULATE_WRITE = 23


def ours(nbytes: int) -> float:
    start = time.perf_counter()
    buffer = allocate_host(nbytes)
    prefault(buffer)
    seconds = time.perf_counter() - start
    buffer.free()
    return nbytes / seconds / 1e9


def python_madvise(nbytes: int) -> float:
    start = time.perf_counter()
    mapping = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    mapping.madvise(MADV_POPULATE_WRITE)
    seconds = time.perf_counter() - start
    mapping.close()
    return nbytes / seconds / 1e9


def torch_touch(nbytes: int) -> float:
    start = time.perf_counter()
    tensor = torch.empty(nbytes, dtype=torch.uint8)
    tensor[:: os.sysconf("SC_PAGE_SIZE")] = 0
    seconds = time.perf_counter() - start
    del tensor
    return nbytes / seconds / 1e9


def main() -> None:
    gib = float(os.environ.get("HICACHE_BENCH_GIB", "2"))
    nbytes = int(gib * 2**30)
    methods = (("ours", ours), ("madvise", python_madvise), ("touch", torch_touch))
    ours(nbytes // 4)  # warm-up: first large mappings in a process pay for reclaim
    results = {name: 0.0 for name, _ in methods}
    for _ in range(int(os.environ.get("HICACHE_BENCH_ROUNDS", "3"))):  # interleaved, best of N
        for name, fn in methods:
            results[name] = max(results[name], fn(nbytes))
    threads = min(os.cpu_count() or 1, 16)
    label = f"host bring-up {gib:g} GiB, allocate+prefault ({threads} threads)"
    print(line(label, results["ours"], "GB/s", "one mmap.madvise from Python", results["madvise"]))
    print(line(label, results["ours"], "GB/s", "torch.empty + touch each page", results["touch"]))


if __name__ == "__main__":
    main()
