"""Host bring-up of a multi-GiB buffer: allocate + pre-fault, ours against SGLang's path, one
run, at HICACHE_BENCH_SIZES_GIB (2) GiB (the README's figures: 4,8 - 1.8 minutes of
`make bench`'s 10 minutes; 2,4 took 56 s of it). Each round frees its memory after the clock stops
(the issue times allocate + pre-fault; unmapping costs both paths the same).

- ours: hicache allocate_host + prefault with the default settings (4 KiB pages,
  MADV_POPULATE_WRITE through ctypes from one thread per core), with hugepages="thp", and -
  where enough 2 MiB pages are reserved (/proc/sys/vm/nr_hugepages) - hugepages="required"
- baseline: SGLang's path - torch.empty + one madvise(MADV_POPULATE_WRITE) over the tensor
  (one thread; through ctypes, as it must be: the tensor is not an mmap object)
Medians of HICACHE_BENCH_ROUNDS (5) interleaved rounds with the per-round range; speed =
baseline time / ours. Last, at the first size: the longest a 1 MiB mmap + munmap in another
thread (a serving engine allocating beside a progressive pool's background pre-fault) waits
while each path pre-faults - each MADV_POPULATE_WRITE call holds the process's mmap lock for
its whole range. The first line says what the machine does with freed memory: under a
hypervisor that takes freed pages back (virtio-balloon free page reporting), every pre-fault
pays for the host faulting them in again - a cost no page size or thread count removes and a
GPU server (bare metal, or guest memory pinned for the GPU's passthrough) does not have.
"""

from __future__ import annotations

import ctypes
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))

from _timing import interleaved, longest_mmap_wait, median_line  # noqa: E402

import torch  # noqa: E402

from hicache.effects._host._memory import allocate_host, free_hugepages, prefault  # noqa: E402

MADV_POPULATE_WRITE = 23
_libc = ctypes.CDLL(None, use_errno=True)
_libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]


def ours(nbytes: int, hugepages: str):
    buffer = allocate_host(nbytes, hugepages=hugepages)
    prefault(buffer)
    return buffer.free  # untimed


def sglang_path(nbytes: int):
    tensor = torch.empty(nbytes, dtype=torch.uint8)
    page = os.sysconf("SC_PAGE_SIZE")
    start = -(-tensor.data_ptr() // page) * page
    end = (tensor.data_ptr() + nbytes) // page * page
    if _libc.madvise(start, end - start, MADV_POPULATE_WRITE) != 0:
        raise OSError(ctypes.get_errno(), "madvise(MADV_POPULATE_WRITE)")
    held = [tensor]
    del tensor
    return held.clear  # untimed: drops the last reference, torch frees


def machine_line() -> str:
    def read(path: str) -> str:
        try:
            return Path(path).read_text().strip()
        except OSError:
            return "n/a"

    reporting = Path("/sys/module/page_reporting/parameters")
    freed = "freed memory stays with this kernel"
    if reporting.is_dir():
        order = read(reporting / "page_reporting_order")
        freed = (f"free page reporting on (freed blocks of order >= {order} go back to the hypervisor; "
                 f"reported so far {int(read(reporting / 'reported_kib') or 0) // 2**20} GiB)"
                 if read(reporting / "reported_kib") != "n/a" else f"free page reporting module loaded (order {order})")
    thp = read("/sys/kernel/mm/transparent_hugepage/enabled")
    return f"machine: {os.cpu_count()} cores, THP {thp}; {freed}"


def main() -> None:
    sizes = [float(v) for v in os.environ.get("HICACHE_BENCH_SIZES_GIB", "2").split(",")]
    rounds = int(os.environ.get("HICACHE_BENCH_ROUNDS", "5"))
    threads = min(os.cpu_count() or 1, 16)
    print(machine_line())
    for gib in sizes:
        nbytes = int(gib * 2**30)
        jobs = {"ours": lambda: ours(nbytes, "off"), "thp": lambda: ours(nbytes, "thp"),
                "sglang": lambda: sglang_path(nbytes)}
        _, free = free_hugepages(2 * 2**20)
        if free * 2 * 2**20 >= nbytes:
            jobs["hugetlbfs"] = lambda: ours(nbytes, "required")
        times = interleaved(jobs, rounds=rounds)
        ms = {name: [t * 1e3 for t in values] for name, values in times.items()}
        base = "SGLang's torch.empty + one madvise(MADV_POPULATE_WRITE)"
        print(median_line(f"allocate+prefault {gib:g} GiB, ours (default: 4 KiB pages, {threads} threads)",
                          ms["ours"], base, ms["sglang"], "ms"))
        print(median_line(f"allocate+prefault {gib:g} GiB, ours with hugepages='thp'", ms["thp"], base,
                          ms["sglang"], "ms"))
        if "hugetlbfs" in ms:
            print(median_line(f"allocate+prefault {gib:g} GiB, ours with hugepages='required' (2 MiB, reserved)",
                              ms["hugetlbfs"], base, ms["sglang"], "ms"))
        else:
            print(f"  hugetlbfs: not measured ({free} free 2 MiB pages reserved; needs {nbytes // (2 * 2**20)})")
    nbytes = int(sizes[0] * 2**30)
    waits: dict = {"ours": [], "sglang": []}
    for _ in range(max(3, rounds // 2)):
        for name, job in (("ours", lambda: ours(nbytes, "off")), ("sglang", lambda: sglang_path(nbytes))):
            teardown, wait = longest_mmap_wait(job)
            teardown()
            waits[name].append(wait * 1e3)
    print(median_line(f"longest wait of a 1 MiB mmap in another thread while {sizes[0]:g} GiB pre-faults, ours",
                      waits["ours"], "SGLang's one madvise", waits["sglang"], "ms"))


if __name__ == "__main__":
    main()
