"""One process of tests/test_turnstile.py: import everything, wait at a file barrier, then
either bring a pool up against a fake driver that is host-wide (``register``) or stand for a
co-located rank's ``cudaMemGetInfo`` probe (``probe``), and write what it saw as JSON.

register BARRIER POOL_MIB RATE CHUNK_MIB [together]: a blocking bring-up (budgeted, ROOMY
machine facts) whose register calls run at RATE bytes/s under the fake's host-wide driver lock
and land in the shared call log. ``together``: the process announces itself to the host's
turnstile before the barrier and stays announced until ``done`` exists - ranks that start
together, each seeing the others from its first call to its last whatever the scheduler does.
probe BARRIER: call ``cudaMemGetInfo`` every 10 ms until ``done`` exists; each call lands in
the shared log too (queued at ``start``, served at ``end``).
"""

from __future__ import annotations

import json
import os
import sys
import time

import torch  # noqa: F401  (imported before the barrier)

from machine import ROOMY

from hicache.effects import BufferRequest, bring_up
from hicache.effects import HostSetup
from hicache.effects._hostwide._turnstile import from_env
from hicache.plan import Limits, plan_registration
from hicache.testing import FakeCudart, FakeRuntime

MiB = 2**20


def _barrier(barrier: str) -> None:
    mine = os.path.join(barrier, f"ready-{os.getpid()}")
    with open(mine + ".tmp", "w") as handle:
        handle.write("ready")
    os.rename(mine + ".tmp", mine)
    while not os.path.exists(os.path.join(barrier, "go")):
        time.sleep(0.002)


def _write(barrier: str, result: dict) -> None:
    path = os.path.join(barrier, f"result-{os.getpid()}")
    with open(path + ".tmp", "w") as handle:
        json.dump(result, handle)
    os.rename(path + ".tmp", path)


def _done(barrier: str) -> bool:
    return os.path.exists(os.path.join(barrier, "done"))


def register(barrier: str, pool_mib: str, rate: str, chunk_mib: str, together: str = "") -> int:
    total = int(pool_mib) * MiB
    plan = plan_registration(total, granularity_bytes=4096, limits=Limits(chunk_limit_bytes=int(chunk_mib) * MiB))
    cudart = FakeCudart(register_bytes_per_s=float(rate), driver_lock=os.path.join(barrier, "driver.lock"),
                        shared_log=os.path.join(barrier, "calls.log"))
    turnstile = from_env() if together else None
    if turnstile is not None:
        turnstile.join()
    _barrier(barrier)
    handle = bring_up([BufferRequest("kv", (total,), None, plan)], mode="blocking",
                      host=HostSetup(runtime=FakeRuntime(cudart), machine=ROOMY))
    try:
        _write(barrier, {"calls": len(handle.calls), "sizes": [size for _, size in handle.registered_ranges()],
                         "waits": handle.turnstile_waits()["count"]})
    finally:
        handle.release()
    if turnstile is not None:
        while not _done(barrier):
            time.sleep(0.01)
        turnstile.leave()
    return 0


def probe(barrier: str) -> int:
    cudart = FakeCudart(driver_lock=os.path.join(barrier, "driver.lock"), shared_log=os.path.join(barrier, "calls.log"))
    _barrier(barrier)
    _write(barrier, {"probe": cudart.probe(lambda: _done(barrier))})
    return 0


if __name__ == "__main__":
    role, *args = sys.argv[1:]
    sys.exit(register(*args) if role == "register" else probe(*args))
