"""Time to the first usable page and to the whole pool: a progressive pool against the blocking
constructor, with a slow fake driver (hicache.testing.FakeCudart(register_bytes_per_s=...))
standing in for a GPU machine's cudaHostRegister at HICACHE_BENCH_REGISTER_GBPS (10) GB/s.

A 100 GB pool is scaled down to HICACHE_BENCH_GIB (2) GiB at the same rate, with the default
caps (one 64 GiB chunk limit: each buffer is one range, as a 100 GB pool's are a few), so every
time shrinks ~50x alike - except the first paced call and the pre-fault pieces at each end of a
chunk (16 MiB first and last), which are not scaled: the first page's share of the total, and
the last call's, are larger here than at 100 GB.

- first page: the progressive constructor's return (a page is usable from then on)
- total: the progressive pool's wait_ready(); baselines: the blocking constructor, and
  max(pre-fault, register) of the same buffers brought up one step after the other (the ideal
  overlap; the issue's target is total <= 1.1x of it)
MLA (one buffer) and MHA page_first (K and V halves in one buffer). Medians of
HICACHE_BENCH_ROUNDS (3) interleaved rounds with the per-round range.
"""

from __future__ import annotations

import os
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))

from _timing import interleaved, median_line  # noqa: E402

from hicache.effects._hostwide._lock import BudgetLock  # noqa: E402
from hicache.effects._cuda._ledger import HostLedger  # noqa: E402
from hicache.effects import HostSetup, MachineFacts, bring_up  # noqa: E402
from hicache.pools import HostPoolOptions, MHATokenToKVPoolHost, MLATokenToKVPoolHost  # noqa: E402
from hicache.testing import FakeRuntime, MHADevicePool, MLADevicePool  # noqa: E402

MACHINE = MachineFacts("6.8.0", None, 4096, "madvise", "madvise", (), None, None, 65530,
                       10**13, 10**13, None, None, 1, 1)


def measure(name: str, make, rate: float, rounds: int, lock: BudgetLock) -> None:
    first, total, blocking, ideal = [], [], [], []

    def progressive():
        start = time.perf_counter()
        pool = make(True, FakeRuntime(register_bytes_per_s=rate))
        first.append(time.perf_counter() - start)
        assert pool.ready_pages() > 0
        pool.wait_ready()
        total.append(time.perf_counter() - start)
        pool.destroy()

    def block():
        start = time.perf_counter()
        pool = make(False, FakeRuntime(register_bytes_per_s=rate))
        blocking.append(time.perf_counter() - start)
        plan = pool.pool_plan
        pool.destroy()
        handle = bring_up(plan,
                          host=HostSetup(runtime=FakeRuntime(register_bytes_per_s=rate), machine=MACHINE, lock=lock,
                                         ledger=HostLedger()),
                          mode="blocking")
        ideal.append(max(handle.timings["allocate_prefault_s"], handle.timings["register_s"]))
        handle.release()

    interleaved({"progressive": progressive, "blocking": block}, rounds=rounds)
    ms = lambda values: [v * 1e3 for v in values[-rounds:]]  # noqa: E731
    print(median_line(f"{name}: time to the first usable page", ms(first), "blocking constructor", ms(blocking), "ms"))
    print(median_line(f"{name}: progressive, until every page is ready", ms(total), "blocking constructor",
                      ms(blocking), "ms"))
    print(median_line(f"{name}: progressive, until every page is ready", ms(total),
                      "max(pre-fault, register) one after the other", ms(ideal), "ms"))


def main() -> None:
    gib = float(os.environ.get("HICACHE_BENCH_GIB", "2"))
    rate = float(os.environ.get("HICACHE_BENCH_REGISTER_GBPS", "10")) * 1e9
    rounds = int(os.environ.get("HICACHE_BENCH_ROUNDS", "3"))
    directory = Path(tempfile.mkdtemp(prefix="hicache-bench-"))
    directory.chmod(0o700)
    lock = BudgetLock(directory)
    host_gb = gib * 2**30 / 1e9
    mla = MLADevicePool(size=64, layer_num=61, kv_lora_rank=512, qk_rope_head_dim=64, page_size=64)
    mha = MHADevicePool(size=64, layer_num=32, head_num=8, head_dim=128, page_size=64)
    def doors(progressive, runtime) -> dict:
        return dict(host=HostSetup(runtime=runtime, ledger=HostLedger(), machine=MACHINE, lock=lock),
                    options=HostPoolOptions(progressive=progressive))

    def make_mla(progressive, runtime):
        return MLATokenToKVPoolHost(mla, 1.0, host_gb, 64, "page_first_direct", True, "cpu",
                                    **doors(progressive, runtime))

    def make_mha(progressive, runtime):
        return MHATokenToKVPoolHost(mha, 1.0, host_gb, 64, "page_first", True, "cpu", **doors(progressive, runtime))

    label = f"{gib:g} GiB, fake driver at {rate / 1e9:g} GB/s"
    measure(f"MLA pool {label}", make_mla, rate, rounds, lock)
    measure(f"MHA pool (page_first) {label}", make_mha, rate, rounds, lock)


if __name__ == "__main__":
    main()
