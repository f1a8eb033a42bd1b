"""One rank of tests/test_ranks_fill.py: import everything, wait at a file barrier, then bring a
pool up through `hicache.effects.bring_up` (pipelined, the default of hicache's pools) on the
fake driver with the host-wide driver lock and a shared call log.

The machine is the one of tests/rank_child.py: ``HICACHE_TEST_BASE`` bytes available at the
barrier, minus what the ranks' processes have really made resident since (their RSS growth). At
its first pre-fault piece a rank writes ``prefaulting-<pid>`` and waits (bounded: a hang guard,
``timeout-<pid>`` if it ran out) until every rank has either got that far or been refused
(``decided-<pid>``) - so the ranks that are admitted are all mid-pre-fault at once, and the
refused ones decided while an admitted one was mid-pre-fault. Mode ``stall`` waits there for
ever instead (the parent kills it). Exit 0 admitted, 1 refused (``error[budget-refused]``).
"""

from __future__ import annotations

import os
import sys
import time

import torch  # noqa: F401 - imported before the barrier: not counted as a pool

from hicache.effects import Report, bring_up
from hicache.errors import CapacityError
from hicache.plan import Limits, MHALayout, plan_pool
from hicache.testing import FakeCudart, FakeRuntime

from rank_child import _machine_from, wait_at_barrier

WAIT_S = 60.0  # the hang guard of the pre-fault barrier


def _count(barrier: str, *prefixes: str) -> int:
    return sum(1 for name in os.listdir(barrier) if name.startswith(prefixes))


def _at_first_piece(barrier: str, ranks: int, stall: bool):
    reached = []

    def on_piece(event) -> None:
        if reached:
            return
        reached.append(True)
        open(os.path.join(barrier, f"prefaulting-{os.getpid()}"), "w").close()
        if stall:
            while True:
                time.sleep(1)
        deadline = time.monotonic() + WAIT_S
        while _count(barrier, "prefaulting-", "decided-") < ranks:
            if time.monotonic() > deadline:
                open(os.path.join(barrier, f"timeout-{os.getpid()}"), "w").close()
                return
            time.sleep(0.005)

    return on_piece


def main(mode: str, barrier: str, ranks: int, pool_mib: int) -> int:
    import psutil

    wait_at_barrier(barrier)
    psutil.virtual_memory = _machine_from(barrier, int(os.environ["HICACHE_TEST_BASE"]))  # sampled under the lock
    pages = pool_mib * 2**20 // (2 * 2 * 64 * 16 * 2 * 2)  # MHA: 2 layers, 2 heads x 64, 16-token pages, bf16
    plan = plan_pool(MHALayout("page_first", layer_num=2, head_num=2, head_dim=64, page_size=16, page_num=pages,
                               itemsize=2), Limits(chunk_limit_bytes=16 << 20))
    cudart = FakeCudart(driver_lock=os.path.join(barrier, "driver.lock"), shared_log=os.path.join(barrier, "calls.log"))
    try:
        handle = bring_up(plan, runtime=FakeRuntime(cudart), ranks_per_host=1, reserve_bytes=0, turnstile="auto",
                          report=Report("fill", prefault_progress=_at_first_piece(barrier, ranks, mode == "stall")))
    except CapacityError as error:
        open(os.path.join(barrier, f"decided-{os.getpid()}"), "w").close()
        print(f"error[budget-refused]: {error}", file=sys.stderr)
        return 1
    handle.release()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])))
