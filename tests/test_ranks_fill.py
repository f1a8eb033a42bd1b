"""A node's ranks bring up together, not one after another (issue #35 item 1): the budget lock
decides, it does not fill. Real processes, real memory (128 MiB a rank), the fake driver with the
host-wide driver lock and a shared call log (tests/fill_child.py); order and overlap from events
(files the ranks write at their first pre-fault piece), never from seconds.

- Room for all four: every rank is mid-pre-fault at once (each waits at its first piece until
  all are there - with the lock held through the fill that wait would never end), and the
  register calls of the four never overlap (the driver lock and the turnstile).
- Room for one: exactly one is admitted, and the three others decide while it is mid-pre-fault
  (it waits for them there) - its pending bytes count against them though the kernel does not
  count them yet.
- A rank SIGKILLed mid-fill: its claim is gone, and the next rank, against room for one, is
  admitted - its figure counts none of the dead rank's memory.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import time
from pathlib import Path

import pytest

pytestmark = pytest.mark.concurrency  # processes, threads, signals or waits: `make test-loaded`

POOL_MIB = 128
POOL = POOL_MIB * 2**20
CHILD = Path(__file__).parent / "fill_child.py"


def _env(tmp_path: Path, base: int) -> dict:
    runtime = tmp_path / "run"
    runtime.mkdir(mode=0o700, exist_ok=True)
    return {**os.environ, "HICACHE_RUNTIME_DIR": str(runtime), "HICACHE_RANKS_PER_HOST": "1",
            "HICACHE_TEST_BASE": str(base), "HICACHE_PIN_CONCURRENCY": "1",
            "PYTHONPATH": os.pathsep.join([str(CHILD.parent), os.environ.get("PYTHONPATH", "")])}


def _start(server, barrier: Path, env: dict, ranks: int, mode: str = "fill", extra=lambda rank: ()) -> list:
    """``ranks`` of tests/fill_child.py, forked from the fork server (tests/forked.py);
    ``extra(rank)``: that rank's further arguments."""
    return [server.spawn([sys.executable, str(CHILD), mode, str(barrier), str(ranks), str(POOL_MIB), *extra(rank)],
                         env=env) for rank in range(ranks)]


def _go(barrier: Path, children: list, expected: int) -> None:
    deadline = time.monotonic() + 120  # a hang guard: the ranks import torch first
    while len([p for p in barrier.glob("ready-*") if not p.name.endswith(".tmp")]) < expected:
        assert time.monotonic() < deadline and all(c.poll() is None for c in children), \
            [c.communicate() for c in children if c.poll() is not None]
        time.sleep(0.02)
    (barrier / "go").write_text("go")


def _results(children: list) -> list:
    try:
        return [(c.wait(timeout=180), *c.communicate()) for c in children]
    finally:
        for c in children:
            if c.poll() is None:
                c.kill()


def _barrier(tmp_path: Path, name: str) -> Path:
    barrier = tmp_path / name
    barrier.mkdir()
    return barrier


def test_ranks_with_room_for_all_pre_fault_side_by_side_and_register_in_turns(tmp_path, fork_server):
    """Four ranks with room for all: all four are mid-pre-fault at once (none timed out at the
    first-piece barrier), all are admitted, and no two register calls overlap."""
    barrier = _barrier(tmp_path, "all")
    children = _start(fork_server, barrier, _env(tmp_path, 16 * POOL), 4)
    _go(barrier, children, 4)
    results = _results(children)
    assert [code for code, _, _ in results] == [0] * 4, results
    assert len(list(barrier.glob("prefaulting-*"))) == 4 and not list(barrier.glob("timeout-*"))
    calls = sorted((entry["start"], entry["end"], entry["pid"]) for entry in map(json.loads, (barrier / "calls.log")
                   .read_text().splitlines()) if "op" not in entry)
    assert len({pid for _, _, pid in calls}) == 4
    assert all(end <= next_start for (_, end, _), (next_start, _, _) in zip(calls, calls[1:])), "calls overlapped"


@pytest.mark.parametrize("mode", ["fill", "fill-blocking"], ids=["pipelined", "blocking"])
def test_ranks_with_room_for_one_admit_one_while_it_is_mid_pre_fault(tmp_path, fork_server, mode):
    """Room for one (and a half), pipelined and blocking: exactly one rank is admitted; the three
    others were refused while it waited mid-pre-fault - its claim's pending bytes counted
    against them."""
    barrier = _barrier(tmp_path, "one")
    children = _start(fork_server, barrier, _env(tmp_path, POOL * 3 // 2), 4, mode=mode)
    _go(barrier, children, 4)
    results = _results(children)
    assert sorted(code for code, _, _ in results) == [0, 1, 1, 1], results
    assert len(list(barrier.glob("prefaulting-*"))) == 1 and len(list(barrier.glob("decided-*"))) == 3
    assert not list(barrier.glob("timeout-*")), "the admitted rank's pre-fault did not wait for the others' decisions"
    assert all("error[budget-refused]" in err for code, _, err in results if code)


def test_a_rank_killed_mid_fill_leaves_nothing_the_next_rank_counts(tmp_path, fork_server):
    """A rank SIGKILLed while mid-pre-fault: its claim is pruned, and the next rank, against room
    for one, is admitted (it counted none of the dead rank's bytes)."""
    from hicache.effects import BudgetLock

    env = _env(tmp_path, POOL * 3 // 2)
    first = _barrier(tmp_path, "first")
    (stalled,) = _start(fork_server, first, env, 1, mode="stall")
    _go(first, [stalled], 1)
    deadline = time.monotonic() + 120  # a hang guard
    while not list(first.glob("prefaulting-*")):
        assert time.monotonic() < deadline and stalled.poll() is None, stalled.communicate()
        time.sleep(0.02)
    with BudgetLock(tmp_path / "run", timeout_s=60) as lock:
        assert lock.claims()[stalled.pid].pending > 0  # mid-fill: its claim counts
    stalled.send_signal(signal.SIGKILL)
    stalled.wait(timeout=60)
    stalled.communicate()
    with BudgetLock(tmp_path / "run", timeout_s=60) as lock:
        assert stalled.pid not in lock.claims() and lock.pending_bytes() == 0
    second = _barrier(tmp_path, "second")
    children = _start(fork_server, second, env, 1)
    _go(second, children, 1)
    results = _results(children)
    assert [code for code, _, _ in results] == [0], results


def _two_nodes(root: Path) -> Path:
    """A sysfs of two NUMA nodes, CPU 0 on node 0 and CPU 1 on node 1 (the CPUs of a 2-core box)."""
    (root / "sys/devices/system/node").mkdir(parents=True)
    (root / "sys/devices/system/node/online").write_text("0-1\n")
    for node in (0, 1):
        (root / f"sys/devices/system/node/node{node}").mkdir()
        (root / f"sys/devices/system/node/node{node}/cpulist").write_text(f"{node}\n")
    return root


def _spans(events: list, name: str) -> dict:
    by_pid: dict = {}
    for event in events:
        if event.get("ph") == "X" and event["name"] == name:
            by_pid.setdefault(event["pid"], []).append(event)
    return by_pid


@pytest.mark.skipif(not hasattr(os, "sched_setaffinity") or not {0, 1} <= os.sched_getaffinity(0),
                    reason="needs CPUs 0 and 1 in this process's affinity (Linux)")
@pytest.mark.parametrize("mode", ["numa", "numa-blocking"], ids=["pipelined", "blocking"])
def test_ranks_on_two_nodes_pre_fault_on_their_own_cpus_side_by_side(tmp_path, fork_server, mode):
    """Four ranks, two on each of two NUMA nodes, with room for all (issue #35 item 2), pipelined
    and blocking: in their traces merged by `hicache trace merge`, every pre-fault piece of a
    rank ran on its own node's CPU only, each rank ran the same number of pre-fault threads (an
    equal share), the ranks of the two nodes pre-faulted at the same time, and no two register
    calls overlapped."""
    from hicache.cli import main as cli

    root = _two_nodes(tmp_path / "topology")
    barrier = _barrier(tmp_path, "numa")
    nodes = {}
    children = _start(fork_server, barrier, _env(tmp_path, 16 * POOL), 4, mode=mode,
                      extra=lambda rank: (str(root), str(rank % 2)))
    for rank, child in enumerate(children):
        nodes[child.pid] = rank % 2
    _go(barrier, children, 4)
    results = _results(children)
    assert [code for code, _, _ in results] == [0] * 4, results
    assert not list(barrier.glob("timeout-*")), "a rank's pre-fault did not overlap the others'"
    merged = tmp_path / "node.json"
    traces = sorted(str(p) for p in barrier.glob("trace-*.json"))
    assert len(traces) == 4 and cli(["trace", "merge", "--out", str(merged), *traces]) == 0
    events = json.loads(merged.read_text())["traceEvents"]
    faults = _spans(events, "pre-fault")
    assert set(faults) == set(nodes), faults.keys()
    for pid, pieces in faults.items():
        assert {piece["args"]["cpus"] for piece in pieces} == {str(nodes[pid])}, (pid, nodes[pid])
    assert len({len({piece["tid"] for piece in pieces}) for pieces in faults.values()}) == 1, "unequal shares"
    window = {pid: (min(p["ts"] for p in pieces), max(p["ts"] + p["dur"] for p in pieces))
              for pid, pieces in faults.items()}
    for a in nodes:
        for b in nodes:
            if nodes[a] != nodes[b]:
                assert window[a][0] < window[b][1] and window[b][0] < window[a][1], "the nodes took turns"
    calls = sorted((e["ts"], e["ts"] + e["dur"]) for pieces in _spans(events, "cudaHostRegister").values()
                   for e in pieces)
    assert calls and all(end <= start for (_, end), (start, _) in zip(calls, calls[1:])), "register calls overlapped"
