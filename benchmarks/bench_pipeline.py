"""Pipelined bring-up: pre-fault chunk k+1 while chunk k registers, against doing them one
after the other, with a slow fake driver (hicache.testing.FakeCudart(register_bytes_per_s=...)),
so registration costs real time without a GPU.

- ours: bring_up(..., mode="pipelined"): wall time of the bring-up (release not counted)
- baseline: bring_up(..., mode="blocking"): allocate + pre-fault, then register
Also reported: ours against max(pre-fault, register) of the sequential run (the ideal overlap).
Size HICACHE_BENCH_GIB (2), fake rate HICACHE_BENCH_REGISTER_GBPS (4), medians of
HICACHE_BENCH_ROUNDS (5) interleaved rounds.
"""

from __future__ import annotations

import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))

from _timing import interleaved, median_line  # noqa: E402

import torch  # noqa: E402,F401  (the state users run in)

from hicache.effects._hostwide._lock import BudgetLock  # noqa: E402
from hicache.effects._cuda._ledger import HostLedger  # noqa: E402
from hicache.effects import MachineFacts, bring_up  # noqa: E402
from hicache.effects import HostSetup
from hicache.plan import Limits, MHALayout, plan_pool  # noqa: E402
from hicache.testing import FakeRuntime  # noqa: E402

GiB = 2**30


def main() -> None:
    gib = float(os.environ.get("HICACHE_BENCH_GIB", "2"))
    rate = float(os.environ.get("HICACHE_BENCH_REGISTER_GBPS", "4")) * 1e9
    rounds = int(os.environ.get("HICACHE_BENCH_ROUNDS", "5"))
    per_page = 2 * 8 * 64 * 8 * 128 * 2
    layout = MHALayout("page_first_direct", layer_num=8, head_num=8, head_dim=128, page_size=64,
                       page_num=int(gib * GiB) // per_page, itemsize=2)
    plan = plan_pool(layout, Limits(chunk_limit_bytes=256 * 2**20))
    directory = Path(tempfile.mkdtemp(prefix="hicache-bench-"))
    directory.chmod(0o700)
    lock = BudgetLock(directory)
    machine = MachineFacts("6.8.0", None, 4096, "madvise", "madvise", (), None, None, 65530,
                           10**13, 10**13, None, None, 1, 1)
    split = {"prefault": [], "register": []}
    bring = {"pipelined": [], "sequential": []}  # bring-up alone: release is timed by neither

    def run(pipelined: bool) -> None:
        start = time.perf_counter()
        handle = bring_up(plan,
                          host=HostSetup(runtime=FakeRuntime(register_bytes_per_s=rate), machine=machine, lock=lock,
                                         ledger=HostLedger()),
                          mode="pipelined" if pipelined else "blocking")
        bring["pipelined" if pipelined else "sequential"].append(time.perf_counter() - start)
        if not pipelined:
            split["prefault"].append(handle.timings["allocate_prefault_s"])
            split["register"].append(handle.timings["register_s"])
        handle.release()

    interleaved({"pipelined": lambda: run(True), "sequential": lambda: run(False)}, rounds=rounds)
    ms = {k: [t * 1e3 for t in v[-rounds:]] for k, v in bring.items()}
    label = f"bring-up {gib:g} GiB, {plan.call_count} calls, fake driver at {rate / 1e9:g} GB/s"
    print(median_line(f"{label}, pipelined", ms["pipelined"], "pre-fault, then register", ms["sequential"], "ms"))
    ideal = [max(p, r) * 1e3 for p, r in zip(split["prefault"][-rounds:], split["register"][-rounds:])]
    print(median_line(f"{label}, pipelined", ms["pipelined"], "max(pre-fault, register) of the sequential run",
                      ideal, "ms"))
    print(f"  sequential parts: pre-fault median {statistics.median(split['prefault']) * 1e3:.0f} ms, "
          f"register median {statistics.median(split['register']) * 1e3:.0f} ms")


if __name__ == "__main__":
    main()
