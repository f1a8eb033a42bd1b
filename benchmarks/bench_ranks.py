"""A node's ranks starting together (issue #35): seconds from the start barrier until every
rank's pool is usable, the budget lock held only to decide (today's rule: pre-faults side by
side, registrations in turns at the turnstile) against the lock held through the whole fill
(the rule before issue #35, the baseline: one rank after another).

N = 2 and 4 rank processes (HICACHE_BENCH_RANKS, "2,4") each bring up a pool of
HICACHE_BENCH_RANK_MIB (2048) MiB through `hicache.effects.bring_up` (pipelined, the pools'
default; real memory, mapped and pre-faulted) on a fake driver registering at
HICACHE_BENCH_REGISTER_GBPS (10) GB/s under a host-wide driver lock (a flock, as the real
driver's hold is host-wide). The old rule is modelled exactly as it was: each rank holds one
host-wide flock from before its budget check until its pool is up. Medians of
HICACHE_BENCH_ROUNDS (3) interleaved rounds (per-round range). On a 2-core box pre-fault is
CPU-bound, so the gain here can only be one rank's pre-fault beside another's registration.
Each rank keeps its pool until every rank is up, as serving ranks do: a rank that gave its
memory back early would flatter the one-after-another baseline (the next rank faults in pages
just freed - measured so, that baseline ran 1.4-1.75x faster).
HICACHE_BENCH_MODE: the bring-up mode (default: the pools' pipelined; "blocking" to compare).
"""

from __future__ import annotations

import fcntl
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))

from _timing import median_line  # noqa: E402

MiB = 2**20
RATE = float(os.environ.get("HICACHE_BENCH_REGISTER_GBPS", "10")) * 1e9
ROUNDS = int(os.environ.get("HICACHE_BENCH_ROUNDS", "3"))
RANK_MIB = int(os.environ.get("HICACHE_BENCH_RANK_MIB", "2048"))
RANK_COUNTS = [int(n) for n in os.environ.get("HICACHE_BENCH_RANKS", "2,4").split(",")]


def _machine():
    from hicache.effects import MachineFacts

    return MachineFacts("6.8.0", None, 4096, "madvise", "madvise", (), None, None, 65530,
                        10**13, 10**13, None, None, 1, 1)


def child(rule: str, barrier: str) -> None:
    from hicache.effects import BufferRequest, bring_up
    from hicache.plan import Limits, plan_registration
    from hicache.testing import FakeCudart, FakeRuntime

    total = RANK_MIB * MiB
    plan = plan_registration(total, granularity_bytes=4096, limits=Limits(chunk_limit_bytes=256 * MiB))
    runtime = FakeRuntime(FakeCudart(register_bytes_per_s=RATE, driver_lock=os.path.join(barrier, "driver.lock")))
    open(os.path.join(barrier, f"ready-{os.getpid()}"), "w").close()
    while not os.path.exists(os.path.join(barrier, "go")):
        time.sleep(0.001)
    old_rule = os.open(os.path.join(barrier, "old-rule.lock"), os.O_RDWR | os.O_CREAT, 0o600)
    try:
        if rule == "old":  # the budget lock held from the check through the fill
            fcntl.flock(old_rule, fcntl.LOCK_EX)
        handle = bring_up([BufferRequest("kv", (total,), None, plan)], runtime=runtime, machine=_machine(),
                          mode=os.environ.get("HICACHE_BENCH_MODE"),
                          ranks_per_host=1, reserve_bytes=0)
        end = time.monotonic()
    finally:
        os.close(old_rule)
    path = os.path.join(barrier, f"result-{os.getpid()}")
    with open(path + ".tmp", "w") as out:
        json.dump({"end": end, "calls": len(handle.calls)}, out)
    os.rename(path + ".tmp", path)
    while not os.path.exists(os.path.join(barrier, "done")):  # a rank keeps its pool, as a serving one does:
        time.sleep(0.005)  # the next rank never faults in memory an earlier one has just given back
    handle.release()


def _round(rule: str, ranks: int) -> float:
    with tempfile.TemporaryDirectory() as tmp:
        runtime, barrier = Path(tmp, "run"), Path(tmp, "barrier")
        runtime.mkdir(mode=0o700)
        barrier.mkdir()
        env = {**os.environ, "HICACHE_RUNTIME_DIR": str(runtime)}
        children = [subprocess.Popen([sys.executable, __file__, "child", rule, str(barrier)], env=env)
                    for _ in range(ranks)]
        try:
            while len(list(barrier.glob("ready-*"))) < ranks:
                if any(c.poll() is not None for c in children):
                    raise RuntimeError("a benchmark rank exited early")
                time.sleep(0.01)
            go = time.monotonic()
            (barrier / "go").write_text("go")
            while len([p for p in barrier.glob("result-*") if not p.name.endswith(".tmp")]) < ranks:
                if any(c.poll() is not None for c in children):
                    raise RuntimeError("a benchmark rank exited before its pool was up")
                time.sleep(0.01)
            (barrier / "done").write_text("done")
            for c in children:
                if c.wait(timeout=600):
                    raise RuntimeError("a benchmark rank failed")
        finally:
            for c in children:
                if c.poll() is None:
                    c.kill()
        ends = [json.loads(p.read_text())["end"] for p in barrier.glob("result-*") if not p.name.endswith(".tmp")]
    return max(ends) - go


def main() -> None:
    for ranks in RANK_COUNTS:
        times = {"new": [], "old": []}
        for _ in range(ROUNDS):  # interleaved: the box's noise hits both rules alike
            for rule in times:
                times[rule].append(_round(rule, ranks))
        print(median_line(f"{ranks} ranks x {RANK_MIB} MiB at {RATE / 1e9:g} GB/s, until every rank is usable "
                          "(the lock decides)", times["new"], "the lock held through the fill (before #35)",
                          times["old"], "s"), flush=True)
        print(f"  per rank (new rule, median round): {sorted(times['new'])[len(times['new']) // 2] / ranks:.2f} s "
              f"of the makespan per rank; one rank's registration alone: {RANK_MIB * MiB / RATE:.2f} s", flush=True)


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "child":
        child(sys.argv[2], sys.argv[3])
    else:
        main()
