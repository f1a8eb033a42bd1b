#!/usr/bin/env python3
"""Bring-up defaults on a real GPU (issue #53 item 4): a pool brought up by hicache's defaults
(4 GiB calls overlapping the pre-fault, hugepages="auto") against SGLang 0.5.23's path -
`mmap(MAP_SHARED|MAP_ANONYMOUS)`, one `MADV_POPULATE_WRITE` from one thread, one
`cudaHostRegister` - to a usable (registered) buffer, and each one's release, in interleaved
rounds, for 37.5 GiB and for 100 GB where the machine has the room (1.2x the size available).
Prints one JSON object; `scripts/gpu_check.py` includes it. The runtime (register/unregister)
is a parameter, so the suite runs this code on CPU under the fake driver at small sizes.
"""

from __future__ import annotations

import json
import mmap
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

GiB = 2**30
SIZES = {"37.5 GiB": int(37.5 * GiB), "100 GB": 100 * 10**9}
MADV_POPULATE_WRITE = 23
#: available memory a size needs: the pool and a margin (the two paths never hold memory at once)
ROOM = 1.2


def _ours(nbytes: int, runtime) -> tuple[float, float, dict]:
    """hicache's defaults: seconds to usable, seconds to release, and what its report says."""
    from hicache.effects import BufferRequest, HostTensorAllocator, bring_up
    from hicache.effects import HostSetup
    from hicache.effects._host._probes import probe_resolved_limits
    from hicache.plan import plan_registration

    limits = probe_resolved_limits().limits  # the defaults, as a pool resolves them: the call cap
    unit = 10 * 2**20  # a 64-token page of a 70B model's page_first_direct pool
    nbytes = nbytes // unit * unit
    plan = plan_registration(nbytes, granularity_bytes=unit, limits=limits)
    start = time.perf_counter()
    handle = bring_up([BufferRequest("kv", (nbytes,), None, plan)],
                      host=HostSetup(runtime=runtime, allocator=HostTensorAllocator()), budget=False)
    usable = time.perf_counter() - start
    facts = {"calls": plan.call_count, "page_rules": [list(r) for r in handle.page_rules()],
             "thp_brake": handle.thp_brake, "tiers": {n: t.as_dict() for n, t in handle.tiers()}}
    start = time.perf_counter()
    handle.release()
    return usable, time.perf_counter() - start, facts


def _sglangs(nbytes: int, runtime) -> tuple[float, float]:
    """SGLang 0.5.23's path: seconds to usable, seconds to release (unregister, unmap)."""
    from hicache.effects._host._libc import madvise_function

    start = time.perf_counter()
    mapping = mmap.mmap(-1, nbytes, flags=mmap.MAP_SHARED | mmap.MAP_ANONYMOUS)
    import ctypes

    address = ctypes.addressof(ctypes.c_char.from_buffer(mapping))
    if madvise_function()(address, nbytes, MADV_POPULATE_WRITE):
        raise OSError(ctypes.get_errno(), "MADV_POPULATE_WRITE failed")
    runtime.register(address, nbytes, 0)
    usable = time.perf_counter() - start
    start = time.perf_counter()
    runtime.unregister(address)
    del address
    try:
        mapping.close()
    except BufferError:  # the ctypes export above: the mapping goes with it
        pass
    return usable, time.perf_counter() - start


def bringup_table(runtime, *, sizes=None, rounds: int = 2, available: int | None = None,
                  deadline: float | None = None, clock=time.monotonic, emit=None) -> dict:
    """Per size: ours and SGLang's seconds to usable and to release (each round ours then
    theirs, the order swapped every other round), medians, and the ratio of SGLang's median to
    ours; a size needing more than ``available / ROOM`` bytes (default: psutil's) is skipped, and
    so is one whose rounds - the last measured size's seconds scaled by bytes - would end past
    ``deadline`` (on ``clock``: the GPU check's time limit; SGLang's path alone takes ~45 s for
    100 GB). ``emit(name, row)`` gets each row as it ends: a run cut short keeps the rows it made."""
    import psutil

    available = psutil.virtual_memory().available if available is None else available
    table: dict = {}
    per_byte = None  # seconds a byte of the last measured size took, every round of both paths
    for name, nbytes in (SIZES if sizes is None else sizes).items():
        table[name] = _skipped(nbytes, available, per_byte, deadline, clock)
        if not table[name]:
            began = clock()
            table[name] = _rows(runtime, nbytes, rounds)
            per_byte = (clock() - began) / nbytes
        if emit is not None:
            emit(name, table[name])
    return table


def _skipped(nbytes: int, available: int, per_byte: float | None, deadline: float | None, clock) -> dict:
    """Why a size is not measured (empty: it is)."""
    if ROOM * nbytes > available:  # one pool at a time: each is freed before the next is made
        return {"skipped": f"needs {ROOM * nbytes / 1e9:.0f} GB available, {available / 1e9:.0f} GB are"}
    if deadline is not None and per_byte is not None:
        need, left = per_byte * nbytes, deadline - clock()
        if need > left:
            return {"skipped": f"needs about {need:.0f} s (scaled from the size before it), {max(left, 0):.0f} s "
                               "left of the check's time limit"}
    return {}


def _rows(runtime, nbytes: int, rounds: int) -> dict:
    """One size's interleaved rounds, medians and ratio."""
    ours, theirs, facts = [], [], {}
    for index in range(rounds):
        order = ("ours", "sglang") if index % 2 == 0 else ("sglang", "ours")
        for who in order:
            if who == "ours":
                usable, release, facts = _ours(nbytes, runtime)
                ours.append((usable, release))
            else:
                theirs.append(_sglangs(nbytes, runtime))
    ours_usable = statistics.median(u for u, _ in ours)
    theirs_usable = statistics.median(u for u, _ in theirs)
    return {
        "ours_usable_s": [round(u, 3) for u, _ in ours], "ours_release_s": [round(r, 3) for _, r in ours],
        "sglang_usable_s": [round(u, 3) for u, _ in theirs], "sglang_release_s": [round(r, 3) for _, r in theirs],
        "speedup": round(theirs_usable / ours_usable, 2) if ours_usable else None, **facts,
    }


def main(argv: list[str] | None = None) -> int:
    import argparse

    from hicache.effects import CudaPythonRuntime, probe_cuda

    parser = argparse.ArgumentParser(description="hicache's bring-up defaults against SGLang's path (one JSON line)")
    parser.add_argument("--time-limit", type=float, default=None, metavar="S",
                        help="skip a size whose rounds would end more than S seconds from the start (default: none)")
    limit = parser.parse_args(argv).time_limit
    deadline = None if limit is None else time.monotonic() + limit
    facts = probe_cuda()
    if not facts.available:
        print(json.dumps({"ok": False, "reason": f"CUDA unavailable: {facts.error}"}))
        return 2
    print(json.dumps(bringup_table(CudaPythonRuntime(), deadline=deadline, emit=lambda name, row: print(
        json.dumps({"size": name, **row}, sort_keys=True), file=sys.stderr, flush=True)), sort_keys=True))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
