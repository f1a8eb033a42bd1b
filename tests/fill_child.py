"""One rank of tests/test_ranks_fill.py: import everything, wait at a file barrier, then bring a
pool up through `hicache.effects.bring_up` (pipelined, the default of hicache's pools) on the
fake driver with the host-wide driver lock and a shared call log.

The machine is the one of tests/rank_child.py: ``HICACHE_TEST_BASE`` bytes available at the
barrier, minus what the ranks' processes have really made resident since (their RSS growth). At
its first pre-fault piece a rank writes ``prefaulting-<pid>`` and waits (bounded: a hang guard,
``timeout-<pid>`` if it ran out) until every rank has either got that far or been refused
(``decided-<pid>``) - so the ranks that are admitted are all mid-pre-fault at once, and the
refused ones decided while an admitted one was mid-pre-fault. Mode ``stall`` waits there for
ever instead (the parent kills it). Mode ``numa ROOT NODE``: the pool is on NUMA node NODE of
the topology under ROOT (a fake sysfs: this box has one node, so the mbind itself is skipped -
tests/test_numa.py binds for real), the host has ``ranks`` ranks, and the rank traces to
``trace-<pid>.json`` in the barrier directory. A mode ending ``-blocking`` (``fill-blocking``,
``numa-blocking``) is that mode with ``bring_up(mode="blocking")``. Exit 0 admitted, 1 refused (``error[budget-refused]``).
"""

from __future__ import annotations

import os
import sys
import time

import torch  # noqa: F401 - imported before the barrier: not counted as a pool

from hicache.effects import Report, bring_up
from hicache.effects import HostSetup
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


def _on_node(root: str, node: int):
    """An allocator binding to ``node`` of the fake topology under ``root``."""
    import hicache.effects._host._memory as memory
    import hicache.effects._host._probes as probes
    from hicache.effects import HostTensorAllocator
    from hicache.effects._host._numa import node_cpus

    # what the budget's machine sample reads (probe_machine passes its own root: this one wins)
    probes.node_cpus = lambda **asked: node_cpus(**{**asked, "root": root})
    memory.bind = lambda ptr, length, node: None
    return HostTensorAllocator(numa_node=node)


def main(mode: str, barrier: str, ranks: int, pool_mib: int, *numa: str) -> int:
    import psutil

    blocking = mode.endswith("-blocking")  # any mode with -blocking: the same in blocking mode
    mode = mode.removesuffix("-blocking")
    on_node = mode == "numa"
    allocator = _on_node(numa[0], int(numa[1])) if on_node else None
    trace = os.path.join(barrier, f"trace-{os.getpid()}.json") if on_node else None
    wait_at_barrier(barrier)
    psutil.virtual_memory = _machine_from(barrier, int(os.environ["HICACHE_TEST_BASE"]))  # sampled under the lock
    pages = pool_mib * 2**20 // (2 * 2 * 64 * 16 * 2 * 2)  # MHA: 2 layers, 2 heads x 64, 16-token pages, bf16
    plan = plan_pool(MHALayout("page_first", layer_num=2, head_num=2, head_dim=64, page_size=16, page_num=pages,
                               itemsize=2), Limits(chunk_limit_bytes=16 << 20))
    cudart = FakeCudart(driver_lock=os.path.join(barrier, "driver.lock"), shared_log=os.path.join(barrier, "calls.log"))
    try:
        handle = bring_up(plan, host=HostSetup(runtime=FakeRuntime(cudart), ranks_per_host=ranks if allocator else 1, reserve_bytes=0, turnstile="auto",
                                               allocator=allocator), mode="blocking" if blocking else None,
                          report=Report("fill", prefault_progress=_at_first_piece(barrier, ranks, mode == "stall"),
                                        trace=trace))
    except CapacityError as error:
        open(os.path.join(barrier, f"decided-{os.getpid()}"), "w").close()
        print(f"error[budget-refused]: {error}", file=sys.stderr)
        return 1
    handle.release()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4]), *sys.argv[5:]))
