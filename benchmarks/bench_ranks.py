"""A node's ranks starting together (issue #35): seconds from the start barrier until every
rank's pool is usable, the budget lock held only to decide (today's rule: pre-faults side by
side, registrations in turns at the turnstile) against the lock held through the whole fill
(the rule before issue #35, the baseline: one rank after another).

N = 2 and 4 rank processes (HICACHE_BENCH_RANKS, "2,4") each bring up a pool of
HICACHE_BENCH_RANK_MIB (1024; docs/operations.md's figures are of 2048, which takes this script
3.5 minutes of `make bench`'s 10) through `hicache.effects.bring_up` (pipelined, the pools'
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
HICACHE_BENCH_RULES: which of new,old,sglang run (default all); HICACHE_BENCH_VERBOSE=1 prints each round.

A third rule, "sglang": SGLang 0.5.23's own `MHATokenToKVPoolHost` (pin_memory=True, the same
bytes; `make sglang`) in every rank without the plug-in - unbudgeted, all at once: its
`alloc_mmap` faults the pool in single-threaded (MAP_POPULATE), then `_cuda_host_register`
registers it through the same fake driver. Each rank also reports its pre-fault and register
seconds (hicache: the handle's timings; SGLang: construction start to its first register call,
and its register calls), the per-rank figures docs/operations.md's two-socket model is built from
(`node_model`, printed last: from this box's figures and from published ones).
"""

from __future__ import annotations

import fcntl
import importlib.util
import json
import os
import statistics
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
RANK_MIB = int(os.environ.get("HICACHE_BENCH_RANK_MIB", "1024"))
RANK_COUNTS = [int(n) for n in os.environ.get("HICACHE_BENCH_RANKS", "2,4").split(",")]


def _machine():
    from hicache.effects import MachineFacts

    return MachineFacts("6.8.0", None, 4096, "madvise", "madvise", (), None, None, 65530,
                        10**13, 10**13, None, None, 1, 1)


def _wait_for_go(barrier: str) -> None:
    open(os.path.join(barrier, f"ready-{os.getpid()}"), "w").close()
    while not os.path.exists(os.path.join(barrier, "go")):
        time.sleep(0.001)


def _report(barrier: str, result: dict) -> None:
    path = os.path.join(barrier, f"result-{os.getpid()}")
    with open(path + ".tmp", "w") as out:
        json.dump(result, out)
    os.rename(path + ".tmp", path)
    while not os.path.exists(os.path.join(barrier, "done")):  # a rank keeps its pool, as a serving one does:
        time.sleep(0.005)  # the next rank never faults in memory an earlier one has just given back


def sglang_child(barrier: str) -> None:
    """One rank of SGLang 0.5.23's own host pool, pinned through the fake driver, no plug-in."""
    import warnings

    import torch

    from hicache.testing import FakeCudart, sglang_on_cpu

    sglang_on_cpu()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        import sglang.srt.mem_cache.memory_pool as memory_pool
        import sglang.srt.mem_cache.pool_host.mha as mha
    cudart = FakeCudart(register_bytes_per_s=RATE, driver_lock=os.path.join(barrier, "driver.lock"))
    torch.cuda.cudart = lambda: cudart  # what SGLang's _cuda_host_register calls, no plug-in in between
    if True:
        device = memory_pool.MHATokenToKVPool(size=4096, page_size=16, dtype=torch.bfloat16, head_num=8, head_dim=128,
                                              layer_num=8, device="cpu", enable_memory_saver=False)
        info = device.get_device_pool_infos()[0].buffer_info
        tokens = RANK_MIB * MiB // (2 * 8 * 8 * 128 * 2)  # K and V, 8 layers x 8 heads x 128, bf16
        _wait_for_go(barrier)
        began = time.perf_counter()
        pool = mha.MHATokenToKVPoolHost(info, 2.0, 0, 16, "page_first", pin_memory=True, device_capacity_tokens=4096,
                                        start_layer=0, end_layer=7, host_token_capacity=tokens)
        end = time.monotonic()
        calls = [entry for entry in cudart.timeline if entry[0] == "register"]
        _report(barrier, {"end": end, "calls": len(calls), "prefault_s": calls[0][3] - began,
                          "register_s": sum(e[4] - e[3] for e in calls), "bytes": RANK_MIB * MiB})
        pool.destroy()


def child(rule: str, barrier: str, ranks: int) -> None:
    import torch  # noqa: F401 - a serving rank has torch imported long before its pool (as SGLang's child does)

    from hicache.effects import BufferRequest, HostTensorAllocator, bring_up
    from hicache.effects import HostSetup
    from hicache.plan import Limits, plan_registration
    from hicache.testing import FakeCudart, FakeRuntime

    total = RANK_MIB * MiB
    plan = plan_registration(total, granularity_bytes=4096, limits=Limits(chunk_limit_bytes=256 * MiB))
    runtime = FakeRuntime(FakeCudart(register_bytes_per_s=RATE, driver_lock=os.path.join(barrier, "driver.lock")))
    _wait_for_go(barrier)
    old_rule = os.open(os.path.join(barrier, "old-rule.lock"), os.O_RDWR | os.O_CREAT, 0o600)
    try:
        if rule == "old":  # the budget lock held from the check through the fill
            fcntl.flock(old_rule, fcntl.LOCK_EX)
        # the new rule: the host's ranks each pre-fault on an equal share of the CPUs; the old: one
        # rank at a time, each on all of them (its default then: the CPUs, at most 16)
        allocator = HostTensorAllocator(prefault_threads=min(os.cpu_count() or 1, 16)) if rule == "old" else None
        handle = bring_up([BufferRequest("kv", (total,), None, plan)],
                          host=HostSetup(runtime=runtime, machine=_machine(), ranks_per_host=ranks, reserve_bytes=0,
                                         allocator=allocator),
                          mode=os.environ.get("HICACHE_BENCH_MODE"))
        end = time.monotonic()
    finally:
        os.close(old_rule)
    calls = [entry for entry in runtime.cudart.timeline if entry[0] == "register"]
    _report(barrier, {"end": end, "calls": len(calls), "prefault_s": handle.timings.get("prefault_s", 0.0),
                      "register_s": sum(e[4] - e[3] for e in calls), "bytes": total})
    handle.release()


def _round(rule: str, ranks: int) -> tuple[float, list]:
    with tempfile.TemporaryDirectory() as tmp:
        runtime, barrier = Path(tmp, "run"), Path(tmp, "barrier")
        runtime.mkdir(mode=0o700)
        barrier.mkdir()
        env = {**os.environ, "HICACHE_RUNTIME_DIR": str(runtime)}
        argv = [sys.executable, __file__, "sglang-child", str(barrier)] if rule == "sglang" else \
            [sys.executable, __file__, "child", rule, str(barrier), str(ranks)]
        children = [subprocess.Popen(argv, env=env) for _ in range(ranks)]
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
        results = [json.loads(p.read_text()) for p in barrier.glob("result-*") if not p.name.endswith(".tmp")]
    return max(r["end"] for r in results) - go, results


def _median(values: list) -> float:
    return statistics.median(values) if values else float("nan")


def _per_rank(label: str, rounds: list, seconds) -> dict:
    """Median per-rank pre-fault and register rates (GB/s) over every rank of every round, and the
    host's pre-fault rate (a round's bytes over ``seconds`` of its ranks' pre-fault seconds: their
    sum where ranks fault one after another, their max where side by side; median); printed."""
    results = [r for ranks in rounds for r in ranks]
    fault = [r["bytes"] / r["prefault_s"] / 1e9 for r in results if r["prefault_s"] > 0]
    register = [r["bytes"] / r["register_s"] / 1e9 for r in results if r["register_s"] > 0]
    host = [sum(r["bytes"] for r in ranks) / seconds(r["prefault_s"] for r in ranks) / 1e9 for ranks in rounds
            if max(r["prefault_s"] for r in ranks) > 0]
    print(f"  per rank, {label}: pre-fault {_median(fault):.2f} GB/s ({min(fault, default=0):.2f}-"
          f"{max(fault, default=0):.2f}; the host's {_median(host):.2f} GB/s), in register calls "
          f"{_median(register):.2f} GB/s (queueing for the driver lock included)", flush=True)
    return {"rank": _median(fault), "host": _median(host)}


#: docs/operations.md's node: two sockets, eight ranks of 100 GiB, four on each socket.
NODE_RANKS, NODE_SOCKETS, NODE_RANK_BYTES = 8, 2, 100 * 2**30


def node_model(alone: float, socket: float, single: float, register: float) -> dict:
    """Seconds until every rank of the node is usable, per rule, from GB/s rates: ``alone`` one
    rank's pre-fault with all its threads, ``socket`` a socket's with all its ranks side by side,
    ``single`` one thread's (SGLang's MAP_POPULATE), ``register`` the driver's, host-wide.
    - the lock through the fill: rank after rank, each pipelined (its slower phase);
    - the lock decides: both sockets pre-fault at once, registrations queue host-wide, pipelined;
    - SGLang's own: every rank populates single-threaded at once (a socket's share at most),
      then the registrations queue host-wide (each starts only once its rank has populated)."""
    size, per_socket = NODE_RANK_BYTES / 1e9, NODE_RANKS // NODE_SOCKETS
    return {
        "old": NODE_RANKS * max(size / alone, size / register),
        "new": max(per_socket * size / socket, NODE_RANKS * size / register),
        "sglang": size / min(single, socket / per_socket) + NODE_RANKS * size / register,
    }


def _print_model(label: str, rates: dict) -> None:
    times = node_model(**rates)
    print(f"node model ({NODE_SOCKETS} sockets, {NODE_RANKS} ranks x {NODE_RANK_BYTES // 2**30} GiB), {label} "
          f"[{', '.join(f'{k} {v:.2f} GB/s' for k, v in rates.items())}]: the lock through the fill {times['old']:.0f} s,"
          f" the lock decides {times['new']:.0f} s ({times['old'] / times['new']:.2f}x), SGLang's own "
          f"{times['sglang']:.0f} s ({times['sglang'] / times['new']:.2f}x)", flush=True)


def main() -> None:
    rules = [r for r in os.environ.get("HICACHE_BENCH_RULES", "new,old,sglang").split(",") if r]
    if "sglang" in rules and importlib.util.find_spec("sglang") is None:
        print("bench_ranks: SGLang is not installed (make sglang): its own pools' row is left out", flush=True)
        rules.remove("sglang")
    figures: dict = {}
    for ranks in RANK_COUNTS:
        times: dict = {rule: [] for rule in rules}
        results: dict = {rule: [] for rule in rules}
        _round(rules[0], ranks)  # a warm-up round, untimed: the first to run reclaims the page cache
        # (one for every rule took 36 s of `make bench`'s 600 for nothing a timed round depends on)
        for _ in range(ROUNDS):  # interleaved: the box's noise hits every rule alike
            for rule in rules:
                makespan, ranks_results = _round(rule, ranks)
                if os.environ.get("HICACHE_BENCH_VERBOSE"):
                    print(f"    {rule}: {makespan:.3f} s", flush=True)
                times[rule].append(makespan)
                results[rule].append(ranks_results)
        if "new" in rules and "old" in rules:
            print(median_line(f"{ranks} ranks x {RANK_MIB} MiB at {RATE / 1e9:g} GB/s, until every rank is usable "
                              "(the lock decides)", times["new"], "the lock held through the fill (before #35)",
                              times["old"], "s"), flush=True)
        if "sglang" in rules and "new" in rules:
            print(median_line(f"{ranks} ranks, the lock decides", times["new"],
                              "SGLang 0.5.23's own pools, unbudgeted, all at once", times["sglang"], "s"), flush=True)
        for rule, label, seconds in (("new", "the lock decides", max), ("old", "the lock through the fill", sum),
                                     ("sglang", "SGLang's own pools", max)):
            if rule in rules:
                figures.setdefault(rule, (ranks, _per_rank(label, results[rule], seconds)))  # the fewest ranks'
    if {"new", "old", "sglang"} <= set(figures):
        # this box as one socket, from the runs with the fewest ranks (the least oversubscribed);
        # SGLang's single thread: its host rate over the CPUs the ranks had
        (_, new), (_, old), (sglang_ranks, sglang) = figures["new"], figures["old"], figures["sglang"]
        single = sglang["host"] / min(sglang_ranks, os.cpu_count() or 1)
        _print_model("this box's rates", dict(alone=old["rank"], socket=new["host"], single=single,
                                               register=RATE / 1e9))
    # published rates: pre-touch 500 GB in 21 s on a host (pegaflow #277; half a host per socket),
    # lazy single-threaded faulting 1-1.3 GB/s, registering resident pages 10 GB/s (vLLM #51080)
    _print_model("published rates", dict(alone=12.0, socket=12.0, single=1.2, register=10.0))


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "child":
        child(sys.argv[2], sys.argv[3], int(sys.argv[4]))
    elif len(sys.argv) > 1 and sys.argv[1] == "sglang-child":
        sglang_child(sys.argv[2])
    else:
        main()
