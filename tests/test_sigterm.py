"""SIGTERM and SIGHUP - what `timeout`, systemd and Kubernetes send - handled as Ctrl-C is
(issue #33 item 5): a real `hicache apply --fake-cuda` stopped at each phase of its work exits
143 (129 for SIGHUP) with one error line, nothing registered and its budget claim gone; `hicache
store create` stopped mid-pre-fault leaves no arena and no claim. In the library, a bring-up
on the main thread undoes itself on them too, and a server's own handlers are kept.

The signal is sent by the process itself at a known point (tests/signal_child.py): the phase is
chosen by an event, never by a guess at how long the work takes."""

from __future__ import annotations

import json
import os
import signal
import sys
from pathlib import Path

import pytest
from store_support import shm_dir  # noqa: F401 - a fixture
from hicache.effects import HostSetup

CHILD = Path(__file__).with_name("signal_child.py")
APPLY = ["apply", "--fake-cuda", "--model", "llama-3.1-8b", "--tp", "8", "--host-gb", "0.05", "--chunk-limit",
         "16MiB", "--threads", "1", "--host-memory", "64GB", "--ranks-per-host", "1", "--reserve", "0"]
PHASES = ["probe", "budget", "prefault", "register", "hold", "release"]


def _stopped(server, tmp_path: Path, phase: str, signame: str, argv: list[str]):
    """Run the child to its end (a hang guard, not a timing): exit code, stderr, report, claims."""
    runtime = tmp_path / "runtime"
    runtime.mkdir(mode=0o700, exist_ok=True)
    report = tmp_path / f"{phase}.json"
    env = {**os.environ, "HICACHE_RUNTIME_DIR": str(runtime)}
    result = server.run([sys.executable, str(CHILD), phase, signame, str(report), "--", *argv], env=env,
                        timeout=300)  # forked: tests/forked.py
    ledger = runtime / "budget.lock"
    claims = json.loads(ledger.read_text() or "{}") if ledger.exists() else {}
    return result, json.loads(report.read_text()), claims


def _one_error_line(stderr: str, said: str) -> None:
    lines = stderr.strip().splitlines()
    assert "Traceback" not in stderr, stderr
    assert lines[-2].startswith(f"error[interrupted]: {said}"), stderr
    assert lines[-1] == "hint: nothing is left registered", stderr
    assert sum(line.startswith("error[") for line in lines) == 1, stderr


@pytest.mark.parametrize("phase", PHASES)
def test_sigterm_at_each_phase_of_apply_undoes_everything_and_exits_143(tmp_path, phase, fork_server):
    """probe, budget claim, pre-fault, mid-registration, hold, mid-release: exit 143, one error
    line saying SIGTERM, the fake driver holds nothing, the child's claim is gone - and the
    phase really was reached (the hook fired; a registration had begun where it should)."""
    argv = [*APPLY, "--hold", "inf"] if phase == "hold" else APPLY
    result, report, claims = _stopped(fork_server, tmp_path, phase, "SIGTERM", argv)
    assert result.returncode == 143, result.stderr
    assert report["reached"] == [phase]
    _one_error_line(result.stderr, "stopped by SIGTERM")
    assert all(held == [] for held in report["held"]), report
    assert claims == {}, claims  # the child was the only claimant of this runtime directory
    if phase in ("register", "hold", "release"):
        assert report["registers"] >= 2 and report["unregisters"] >= 2, report  # it was registered, then undone
    if phase in ("probe", "budget"):
        assert report["registers"] == 0, report


def test_sighup_is_handled_as_sigterm(tmp_path, fork_server):
    """SIGHUP (a closed terminal, a reload) mid-registration: exit 129, everything undone."""
    result, report, claims = _stopped(fork_server, tmp_path, "register", "SIGHUP", APPLY)
    assert result.returncode == 129, result.stderr
    _one_error_line(result.stderr, "stopped by SIGHUP")
    assert all(held == [] for held in report["held"]) and claims == {}


def test_sigterm_during_store_create_leaves_no_arena_and_no_claim(tmp_path, shm_dir, fork_server):  # noqa: F811
    """`hicache store create` stopped mid-pre-fault: exit 143, one error line, the arena file
    unlinked, the node claim gone."""
    path = shm_dir / "arena"
    result, report, claims = _stopped(fork_server, tmp_path, "store-prefault", "SIGTERM",
                                      ["store", "create", str(path), "--size-gb", "0.15", "--slot-bytes", "65536",
                                       "--threads", "1"])
    assert result.returncode == 143 and report["reached"] == ["store-prefault"], result.stderr
    assert "Traceback" not in result.stderr and "error[interrupted]: stopped by SIGTERM" in result.stderr
    assert not path.exists() and list(shm_dir.iterdir()) == [] and claims == {}


def test_a_bring_up_on_the_main_thread_handles_sigterm_only_where_nobody_else_does(monkeypatch):
    """With SIGTERM at its default, bring_up raises TerminationSignal on it (so its rollback
    runs) and puts the default back after; a server's own handler, or SIG_IGN, is left in
    place throughout - observed from inside the bring-up (its allocator)."""
    from hicache.effects import bring_up
    from hicache.effects import HostSetup
    from hicache.effects._interrupts import _raise_termination
    from hicache.plan import Limits, MHALayout, plan_pool
    from hicache.testing import fake_cuda

    plan = plan_pool(MHALayout("page_first_direct", layer_num=2, head_num=2, head_dim=64, page_size=4, page_num=8,
                               itemsize=2), Limits(chunk_limit_bytes=64 * 1024))
    seen = []

    class Watching:
        """An allocator that notes the SIGTERM handler while the bring-up runs."""

        can_map_unfaulted = False

        def allocate(self, dims, dtype, device="cpu", pin_memory=False):
            import torch

            seen.append(signal.getsignal(signal.SIGTERM))
            return torch.zeros(dims, dtype=dtype)

        def free_all(self, **_):
            pass

    def server_handler(signum, frame):
        raise AssertionError("not sent")

    for installed in (signal.SIG_DFL, server_handler, signal.SIG_IGN):
        previous = signal.signal(signal.SIGTERM, installed)
        try:
            with fake_cuda():
                handle = bring_up(plan, budget=False, host=HostSetup(turnstile=None,
                                                                     allocator=Watching(), owns_memory=False))
                handle.release()
            assert signal.getsignal(signal.SIGTERM) is installed  # put back as it was
        finally:
            signal.signal(signal.SIGTERM, previous)
    assert seen[0] is _raise_termination and seen[1] is server_handler and seen[2] is signal.SIG_IGN, seen


@pytest.mark.concurrency
def test_a_bring_up_off_the_main_thread_touches_no_handler():
    """Only the main thread may set handlers: a bring-up in another thread leaves them as they are."""
    import threading

    from hicache.effects import terminate_as_interrupt

    seen = []

    def run():
        with terminate_as_interrupt():
            seen.append(signal.getsignal(signal.SIGTERM))

    before = signal.getsignal(signal.SIGTERM)
    thread = threading.Thread(target=run)
    thread.start()
    thread.join()
    assert seen == [before] and signal.getsignal(signal.SIGTERM) is before
