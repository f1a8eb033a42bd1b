"""Time to the first usable page: a progressive pool against the blocking constructor, with a
slow fake driver (hicache.testing.FakeCudart(register_bytes_per_s=...)) standing in for a GPU
machine's cudaHostRegister. A 100 GB pool at 10 GB/s takes ~10 s to pin; scaled down here to
HICACHE_BENCH_GIB (2) GiB at HICACHE_BENCH_REGISTER_GBPS (2) GB/s in HICACHE_BENCH_CHUNK_MIB (64) MiB
chunks (1/32 of the pool; a 100 GB pool at 256 MiB first calls is 1/400).

- first page: the progressive constructor's return (a page is usable from then on)
- total: the progressive pool's wait_ready(); baseline: the blocking constructor
Medians of HICACHE_BENCH_ROUNDS (3) interleaved rounds with the per-round range.
"""

from __future__ import annotations

import os
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))

from _timing import interleaved, median_line  # noqa: E402

from hicache.effects import BudgetLock, HostLedger, MachineFacts  # noqa: E402
from hicache.plan import Limits  # noqa: E402
from hicache.pools import MLATokenToKVPoolHost  # noqa: E402
from hicache.testing import FakeRuntime, MLADevicePool  # noqa: E402


def main() -> None:
    gib = float(os.environ.get("HICACHE_BENCH_GIB", "2"))
    rate = float(os.environ.get("HICACHE_BENCH_REGISTER_GBPS", "2")) * 1e9
    rounds = int(os.environ.get("HICACHE_BENCH_ROUNDS", "3"))
    chunk = int(float(os.environ.get("HICACHE_BENCH_CHUNK_MIB", "64")) * 2**20)
    directory = Path(tempfile.mkdtemp(prefix="hicache-bench-"))
    directory.chmod(0o700)
    machine = MachineFacts("6.8.0", None, 4096, "madvise", "madvise", (), None, None, 65530,
                           10**13, 10**13, None, None, 1, 1)
    device = MLADevicePool(size=64, layer_num=61, kv_lora_rank=512, qk_rope_head_dim=64, page_size=64)
    host_gb = gib * 2**30 / 1e9
    first, total, blocking = [], [], []

    def build(progressive: bool):
        return MLATokenToKVPoolHost(device, 1.0, host_gb, 64, "page_first_direct", True, "cpu",
                                    runtime=FakeRuntime(register_bytes_per_s=rate), ledger=HostLedger(),
                                    limits=Limits(chunk_limit_bytes=chunk), machine=machine,
                                    budget_lock=BudgetLock(directory), progressive=progressive)

    def progressive():
        start = time.perf_counter()
        pool = build(True)
        first.append(time.perf_counter() - start)
        assert pool.ready_pages() > 0
        pool.wait_ready()
        total.append(time.perf_counter() - start)
        pool.destroy()

    def block():
        start = time.perf_counter()
        pool = build(False)
        blocking.append(time.perf_counter() - start)
        pool.destroy()

    interleaved({"progressive": progressive, "blocking": block}, rounds=rounds)
    ms = lambda values: [v * 1e3 for v in values[-rounds:]]  # noqa: E731
    label = f"MLA pool {gib:g} GiB, fake driver at {rate / 1e9:g} GB/s"
    print(median_line(f"{label}: time to the first usable page", ms(first), "blocking constructor", ms(blocking), "ms"))
    print(median_line(f"{label}: progressive, until every page is ready", ms(total), "blocking constructor",
                      ms(blocking), "ms"))


if __name__ == "__main__":
    main()
