"""Ranks that start together on one host never overcommit it: with room for one pool, exactly
one of four is admitted (`hicache apply` and the pools alike), the others exit 1 with the
budget message. Real processes, real memory (a quarter of a GB each), fake CUDA."""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

import pytest

pytestmark = pytest.mark.concurrency  # processes, threads, signals or waits: `make test-loaded`

RANKS = 4
POOL_GB = "0.25"  # room for one: 0.4e9 bytes beyond the reserve (two would need 0.5e9 or more)
ROOM = int(0.4e9)


@pytest.mark.parametrize("mode", [
    pytest.param("apply", marks=pytest.mark.load_free("the same budget lock as the pool case, reached through the "
                                                       "CLI: the pool case runs under load")),
    "pool",
])
def test_ranks_starting_together_admit_exactly_one(tmp_path, mode, fork_server):
    """Ranks starting together against room for one: exactly one comes up, the others are refused
    with error[budget-refused]."""
    runtime = tmp_path / "run"
    runtime.mkdir(mode=0o700)
    barrier = tmp_path / "barrier"
    barrier.mkdir()
    # room for one pool beyond the reserve, not for two (pool_host reserve: 10 GiB; apply's --reserve 1GiB)
    reserve = 2**30 if mode == "apply" else 10 * 2**30
    env = {**os.environ, "HICACHE_RUNTIME_DIR": str(runtime), "HICACHE_RANKS_PER_HOST": "1",
           "HICACHE_TEST_BASE": str(reserve + ROOM)}
    child = Path(__file__).parent / "rank_child.py"
    ranks = [fork_server.spawn([sys.executable, str(child), mode, str(barrier), POOL_GB, "2"], env=env)
             for _ in range(RANKS)]  # forked: tests/forked.py
    try:
        deadline = time.monotonic() + 120
        while len([p for p in barrier.glob("ready-*") if not p.name.endswith(".tmp")]) < RANKS:
            assert time.monotonic() < deadline and all(r.poll() is None for r in ranks), [r.communicate() for r in ranks if r.poll() is not None]
            time.sleep(0.02)
        (barrier / "go").write_text("go")
        results = [(r.wait(timeout=120), *r.communicate()) for r in ranks]
    finally:
        for r in ranks:
            if r.poll() is None:
                r.kill()
    codes = sorted(code for code, _, _ in results)
    assert codes == [0] + [1] * (RANKS - 1), results
    for code, _, err in results:
        if code:
            assert "error[budget-refused]" in err and "host memory budget refused" in err, err
