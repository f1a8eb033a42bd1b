"""Budget truth with a stated host figure (issue #33 item 2): `--host-memory` /
``host_memory_bytes=`` stands for the host's available memory, so live peers' claims on this
host come off it as the kernel takes them off a measured figure, and `--ranks-per-host` never
lets more claims in than the ranks stated. In-process over a ledger holding live peers, and
four `hicache apply` processes at once: exactly one admitted, the others refused naming the
peers' claims."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest
from machine import ROOMY

from hicache.effects import BufferRequest, bring_up
from hicache.effects import HostSetup
from hicache.effects import BudgetLock
from hicache.errors import CapacityError
from hicache.plan import Limits, plan_registration
from hicache.testing import FakeRuntime

MB = 10**6
POOL = 4 * 2**20


@pytest.fixture
def peer():
    """A live process standing for a peer that holds host memory (its pid in the ledger)."""
    child = subprocess.Popen([sys.executable, "-c", "import sys; sys.stdin.read()"], stdin=subprocess.PIPE)
    yield child.pid
    child.stdin.close()
    child.wait(timeout=60)


def _with_claims(directory, claims: dict) -> None:
    with BudgetLock(directory) as lock:
        lock._write(claims)


def _bring_up(directory, *, host_memory: int | None, ranks: int):
    plan = plan_registration(POOL, granularity_bytes=2**20, limits=Limits(chunk_limit_bytes=2**20))
    return bring_up([BufferRequest("kv", (POOL,), None, plan)],
                    host=HostSetup(runtime=FakeRuntime(), machine=ROOMY, lock=BudgetLock(directory), reserve_bytes=0,
                                   host_memory_bytes=host_memory, ranks_per_host=ranks))


def test_a_peer_filling_the_stated_ranks_is_refused_by_name(tmp_path, peer):
    """One rank stated, one live peer holding 4 MiB of the stated 8 MiB: refused, the peer and
    its claim named - room enough in bytes or not, the stated ranks are taken."""
    _with_claims(tmp_path, {peer: POOL})
    with pytest.raises(CapacityError, match=rf"1 other process\(es\) on this host \(pids {peer}\) already claim"):
        _bring_up(tmp_path, host_memory=2 * POOL, ranks=1)


def test_peers_claims_come_off_the_stated_figure(tmp_path, peer):
    """Two ranks stated over 8 MiB, a peer holding 4 MiB: 4 MiB are left, so 4 MiB is admitted;
    over 7 MiB it would not be (3 MiB left)."""
    _with_claims(tmp_path, {peer: POOL})
    _bring_up(tmp_path, host_memory=2 * POOL, ranks=2).release()
    with pytest.raises(CapacityError, match="host memory budget refused"):
        _bring_up(tmp_path, host_memory=2 * POOL - 2**20, ranks=2)


def test_a_measured_figure_is_not_charged_twice(tmp_path, peer):
    """Without a stated figure the machine's available memory already lacks the peers' pages:
    their claims are not subtracted again (a huge claim does not refuse a roomy machine)."""
    _with_claims(tmp_path, {peer: 10**15})
    _bring_up(tmp_path, host_memory=None, ranks=2).release()


def test_a_dead_peers_claim_is_no_claim(tmp_path):
    """A ledger entry of a process that is gone takes no room (a pid far past pid_max)."""
    _with_claims(tmp_path, {2**30: 10 * POOL})
    _bring_up(tmp_path, host_memory=2 * POOL, ranks=1).release()


@pytest.mark.concurrency  # processes side by side: `make test-loaded` runs it again under load
def test_four_applies_at_once_with_one_stated_rank_admit_exactly_one(tmp_path, fork_server):
    """Four `hicache apply --fake-cuda --host-memory 64MB --ranks-per-host 1` processes, each
    asking 8 MB and holding what it got: exactly one is admitted (it says it holds), the three
    others exit 1 naming the peer's claim; the admitted one then ends on Ctrl-C."""
    env = {**os.environ, "HICACHE_RUNTIME_DIR": str(tmp_path)}
    argv = [sys.executable, "-m", "hicache", "apply", "--fake-cuda", "--model", "llama-3.1-8b", "--tp", "8",
            "--host-gb", "0.008", "--chunk-limit", "4MiB", "--threads", "1", "--host-memory", "64MB",
            "--ranks-per-host", "1", "--reserve", "1", "--hold", "inf"]
    children = [fork_server.spawn(argv, env=env) for _ in range(4)]  # forked: tests/forked.py
    try:
        deadline = time.monotonic() + 600  # a hang guard: the refused ones exit as soon as they sample
        while sum(c.poll() is not None for c in children) < 3:
            assert time.monotonic() < deadline, "hang guard"
            time.sleep(0.05)
        refused = [c for c in children if c.poll() is not None]
        (admitted,) = [c for c in children if c.poll() is None]
        assert [c.returncode for c in refused] == [1, 1, 1]
        errors = [c.communicate()[1] for c in refused]
        assert all(f"(pids {admitted.pid}) already claim" in e and "error[budget-refused]" in e for e in errors)
        # the lock decides, it does not fill: the refusals may come before it holds (issue #35)
        while "holding" not in admitted.output()[1]:  # its own --hold never ends by itself
            assert admitted.poll() is None, f"the admitted apply ended without holding: {admitted.communicate()}"
            assert time.monotonic() < deadline, "hang guard"
            time.sleep(0.02)
        admitted.send_signal(signal.SIGINT)
        assert admitted.wait(timeout=120) == 130
    finally:
        for child in children:
            if child.poll() is None:
                child.kill()
                child.wait()
