"""One rank of tests/test_ranks.py: import everything, wait at a file barrier, then bring a
pool (its size given) up through `hicache apply` or a pool class, under `hicache.testing.fake_cuda`.

psutil reports a machine with ``HICACHE_TEST_BASE`` bytes available at the barrier, minus what
the ranks' processes have really made resident since then (their RSS growth: the pools the
earlier ranks pre-faulted), so the budget sees the ranks that came up before it exactly as it
would on a real host of that size - and nothing else running on this machine moves it.
"""

from __future__ import annotations

import os
import sys
import time

import psutil
import torch  # noqa: F401  (imported before the barrier: not counted as a pool)

from hicache.cli import main
from hicache.errors import CapacityError
from hicache.pools import MHATokenToKVPoolHost
from hicache.testing import MHADevicePool, fake_cuda


def _rank_growth(barrier: str) -> int:
    """Bytes the ranks' processes made resident since the barrier (a rank that exited, none)."""
    grown = 0
    for entry in os.listdir(barrier):
        if not entry.startswith("ready-"):
            continue
        pid, start = int(entry[len("ready-"):]), int(open(os.path.join(barrier, entry)).read() or 0)
        try:
            grown += max(0, psutil.Process(pid).memory_info().rss - start)
        except psutil.Error:
            pass
    return grown


def _machine_from(barrier: str, base: int):
    real = psutil.virtual_memory

    def virtual_memory():
        values = real()._asdict()
        values["available"] = max(0, base - _rank_growth(barrier))
        return type(real())(**values)

    return virtual_memory


def wait_at_barrier(barrier: str) -> None:
    """Say this rank is ready (with its RSS now: what `_rank_growth` measures from), then wait
    for the parent's ``go``."""
    mine = os.path.join(barrier, f"ready-{os.getpid()}")
    with open(mine + ".tmp", "w") as handle:
        handle.write(str(psutil.Process().memory_info().rss))
    os.rename(mine + ".tmp", mine)
    go = os.path.join(barrier, "go")
    while not os.path.exists(go):
        time.sleep(0.005)


def main_rank(mode: str, barrier: str, pool_gb: str, hold_s: float) -> int:
    wait_at_barrier(barrier)
    psutil.virtual_memory = _machine_from(barrier, int(os.environ["HICACHE_TEST_BASE"]))
    with fake_cuda():
        if mode == "apply":
            return main(["apply", "--model", "llama-3.1-8b", "--tp", "8", "--host-gb", pool_gb,
                         "--chunk-limit", "256MiB", "--hold", str(hold_s), "--reserve", "1GiB"])
        device = MHADevicePool(size=64, layer_num=2, head_num=2, head_dim=64, page_size=64)
        try:
            pool = MHATokenToKVPoolHost(device, 2.0, float(pool_gb), 64, "page_first_direct", True, "cpu")
        except CapacityError as error:
            print(f"error[budget-refused]: {error}", file=sys.stderr)
            return 1
        time.sleep(hold_s)
        pool.destroy()
        return 0


if __name__ == "__main__":
    sys.exit(main_rank(sys.argv[1], sys.argv[2], sys.argv[3], float(sys.argv[4])))
