"""The host's registration turnstile: what a co-located rank's driver call waits, and what the
turnstile costs the ranks bringing pools up - with it (HICACHE_PIN_CONCURRENCY=1) against
without it (off, the baseline: each process registers its plan's calls as they come).

A fake driver stands in for a GPU machine's: hicache.testing.FakeCudart pinning at
HICACHE_BENCH_REGISTER_GBPS (1) GB/s under a host-wide driver lock (a flock, as the real
driver's hold is host-wide: TensorRT-LLM #17429). Four rank processes bring up a 256 MiB
pool each at once (blocking mode: the calls of all four land at the driver together), one
call each unpaced - a 64 GiB call of a TB-scale pool at ~10x the time scale -, and a fifth
process probes ``cudaMemGetInfo`` every 10 ms. The stall budget is scaled alike (25 ms for
the default 0.25 s). Figures per configuration, medians of HICACHE_BENCH_ROUNDS (3)
interleaved rounds (per-round range):

- probe: the longest a probe call waited for the driver in the round;
- makespan: the barrier to the last rank's pool being registered;
- both with HICACHE_PIN_CONCURRENCY=1 (always paced) and auto (the default: turns and pacing
  once the ranks see each other);
- alone: one process registering 2 GiB at 10 GB/s in-process - turnstile off, auto (nobody
  else brings up pools: no tickets, no pacing) and forced 1 (paced) - the cost of the
  turnstile to a process with the driver to itself.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))

from _timing import interleaved, median_line  # noqa: E402

MiB = 2**20
RATE = float(os.environ.get("HICACHE_BENCH_REGISTER_GBPS", "1")) * 1e9
ROUNDS = int(os.environ.get("HICACHE_BENCH_ROUNDS", "3"))  # 5 took 74 s of `make bench`'s 600
RANKS, POOL_MIB, STALL = 4, 256, "0.025"


def _machine():
    from hicache.effects import MachineFacts

    return MachineFacts("6.8.0", None, 4096, "madvise", "madvise", (), None, None, 65530,
                        10**13, 10**13, None, None, 1, 1)


def _wait_for(path: str) -> None:
    while not os.path.exists(path):
        time.sleep(0.001)


def _ready(barrier: str) -> None:
    with open(os.path.join(barrier, f"ready-{os.getpid()}"), "w"):
        pass
    _wait_for(os.path.join(barrier, "go"))


def _result(barrier: str, data: dict) -> None:
    path = os.path.join(barrier, f"result-{os.getpid()}")
    with open(path + ".tmp", "w") as handle:
        json.dump(data, handle)
    os.rename(path + ".tmp", path)


def child(role: str, barrier: str) -> None:
    import torch  # noqa: F401  (before the barrier)

    from hicache.effects import BufferRequest, bring_up
    from hicache.effects import HostSetup
    from hicache.plan import Limits, plan_registration
    from hicache.testing import FakeCudart, FakeRuntime

    driver = os.path.join(barrier, "driver.lock")
    if role == "probe":
        cudart = FakeCudart(driver_lock=driver)
        _ready(barrier)
        _result(barrier, {"probe": cudart.probe(lambda: os.path.exists(os.path.join(barrier, "done")))})
        return
    total = POOL_MIB * MiB
    plan = plan_registration(total, granularity_bytes=4096, limits=Limits(chunk_limit_bytes=total))
    runtime = FakeRuntime(FakeCudart(register_bytes_per_s=RATE, driver_lock=driver))
    _ready(barrier)
    handle = bring_up([BufferRequest("kv", (total,), None, plan)], mode="blocking",
                      host=HostSetup(runtime=runtime, machine=_machine()))
    end = time.monotonic()
    _result(barrier, {"end": end, "calls": len(handle.calls)})
    handle.release()


def _round(concurrency: str) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        runtime, barrier = Path(tmp, "run"), Path(tmp, "barrier")
        runtime.mkdir(mode=0o700)
        barrier.mkdir()
        env = {**os.environ, "HICACHE_RUNTIME_DIR": str(runtime), "HICACHE_PIN_CONCURRENCY": concurrency,
               "HICACHE_PIN_MAX_STALL_S": STALL}
        roles = ["register"] * RANKS + ["probe"]
        children = [subprocess.Popen([sys.executable, __file__, "child", role, str(barrier)], env=env) for role in roles]
        try:
            while len(list(barrier.glob("ready-*"))) < len(children):
                if any(c.poll() is not None for c in children):
                    raise RuntimeError("a benchmark child exited early")
                time.sleep(0.01)
            go = time.monotonic()
            (barrier / "go").write_text("go")
            for c in children[:RANKS]:
                if c.wait(timeout=300):
                    raise RuntimeError("a rank failed")
            (barrier / "done").write_text("done")
            children[-1].wait(timeout=60)
        finally:
            for c in children:
                if c.poll() is None:
                    c.kill()
        results = [json.loads(p.read_text()) for p in barrier.glob("result-*") if not p.name.endswith(".tmp")]
    probe = next(r["probe"] for r in results if "probe" in r)
    ranks = [r for r in results if "end" in r]
    return {"probe": max(probe), "makespan": max(r["end"] for r in ranks) - go,
            "calls": statistics.median(r["calls"] for r in ranks)}


def _alone() -> None:
    from hicache.effects import admission, apply_plan
    from hicache.plan import Limits, plan_registration
    from hicache.testing import FakeCudart, FakeRuntime

    plan = plan_registration(2 * 2**30, granularity_bytes=4096, limits=Limits(chunk_limit_bytes=256 * MiB))
    with tempfile.TemporaryDirectory() as tmp:
        os.chmod(tmp, 0o700)

        def run(turnstile):
            def once():
                apply_plan(plan, base_ptr=1 << 40, runtime=FakeRuntime(FakeCudart(register_bytes_per_s=10e9)),
                           turnstile=turnstile).release()
            return once

        times = interleaved({
            "off": run(None),
            "auto": run(admission.Turnstile(Path(tmp), auto=True, max_stall_s=float(STALL))),
            "forced": run(admission.Turnstile(Path(tmp), auto=False, max_stall_s=float(STALL))),
        }, rounds=ROUNDS)
    print(median_line("alone, turnstile auto (no other process: no tickets, no pacing)", times["auto"], "off", times["off"]))
    print(median_line("alone, turnstile forced 1 (paced to 25 ms)", times["forced"], "off", times["off"]))


def main() -> None:
    rounds = {"off": [], "1": [], "auto": []}
    for _ in range(ROUNDS):  # interleaved: machine noise hits all alike
        for concurrency in rounds:
            rounds[concurrency].append(_round(concurrency))
    for setting in ("1", "auto"):
        for key, unit in (("probe", "s"), ("makespan", "s")):
            on, off = [r[key] for r in rounds[setting]], [r[key] for r in rounds["off"]]
            print(median_line(f"{RANKS} ranks x {POOL_MIB} MiB, {key} with HICACHE_PIN_CONCURRENCY={setting}",
                              on, "off", off, unit))
    calls = {k: statistics.median(r["calls"] for r in v) for k, v in rounds.items()}
    print(f"calls per rank: 1: {calls['1']:.0f}, auto: {calls['auto']:.0f}, off: {calls['off']:.0f}; one unpaced "
          f"call lasts {POOL_MIB * MiB / RATE:.3f} s at {RATE / 1e9:g} GB/s")
    _alone()


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "child":
        child(sys.argv[2], sys.argv[3])
    else:
        main()
