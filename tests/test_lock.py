"""The cross-process budget lock: exclusive, private, and it remembers who allocated."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from hicache.effects.admission import budget_lock
from hicache.errors import RegistrationStateError

pytestmark = pytest.mark.concurrency  # processes, threads, signals or waits: `make test-loaded`


def test_lock_excludes_other_processes(tmp_path):
    """While held here, another process cannot take it (it times out)."""
    code = (
        "import sys; from pathlib import Path; from hicache.effects._hostwide._lock import budget_lock\n"
        "try:\n"
        f"    with budget_lock(directory=Path({str(tmp_path)!r}), timeout_s=0.3): print('got')\n"
        "except Exception as e: print(type(e).__name__, isinstance(e, RuntimeError))\n"
    )
    with budget_lock(directory=tmp_path):
        out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert out.stdout.strip() == "LockTimeoutError True", out.stderr  # a RegistrationStateError too
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert out.stdout.strip() == "got"


def test_peers_lists_live_allocators_only(tmp_path):
    """record() adds this process; dead pids are pruned; peers() excludes ourselves."""
    tmp_path.chmod(0o700)
    (tmp_path / "budget.lock").write_text('{"999999999": 5, "%d": 7}' % os.getppid())
    with budget_lock(directory=tmp_path) as lock:
        assert lock.peers() == {os.getppid(): 7}
        lock.record(100)
        assert lock.peers() == {os.getppid(): 7}
        lock.forget()
    with budget_lock(directory=tmp_path) as lock:
        assert os.getpid() not in lock._entries()


def test_symlinked_or_shared_directories_are_refused(tmp_path):
    """A lock directory that is a symlink, or that its group or others may read or write, is refused."""
    real = tmp_path / "real"
    real.mkdir(mode=0o700)
    link = tmp_path / "link"
    link.symlink_to(real)
    with pytest.raises(RegistrationStateError, match="not a plain directory"):
        budget_lock(directory=link)
    for mode in (0o755, 0o770, 0o750, 0o720, 0o705, 0o702):  # each guarded bit on its own: group or other,
        shared = tmp_path / f"shared-{mode:o}"  # read or write (0755 alone sets both)
        shared.mkdir()
        shared.chmod(mode)
        with pytest.raises(RegistrationStateError, match="mode 0700"):
            budget_lock(directory=shared)


def _runtime_dir_case(tmp_path, case: str):
    """A path in one of the states hicache's runtime directory can be found in."""
    path = tmp_path / "runtime"
    if case == "absent":
        return path
    if case == "a symlink to ours":
        real = tmp_path / "real"
        real.mkdir(mode=0o700)
        path.symlink_to(real)
    elif case == "a file":
        path.write_bytes(b"")
        path.chmod(0o600)
    elif case == "a FIFO":
        os.mkfifo(path, 0o600)
    elif case == "another user's":
        path.mkdir(mode=0o700)
        try:
            os.chown(path, os.getuid() + 1, -1)
        except PermissionError:
            pytest.skip("only root can give a directory away here")
    else:  # a mode
        path.mkdir()
        path.chmod(int(case, 8))
    return path


@pytest.mark.parametrize("case", ["absent", "0700", "0750", "0702", "a symlink to ours", "a file", "a FIFO",
                                  "another user's"])
def test_the_doctor_refuses_a_runtime_directory_exactly_as_a_bring_up_would(tmp_path, case):
    """HICACHE_RUNTIME_DIR as `hicache doctor` checks it (`environment_problems`) and as every
    bring-up takes it (the budget lock's directory) is judged by one rule: a plain directory of
    ours with mode 0700, or none yet (made) - a symlink, a file, a FIFO, another user's or a shared
    mode refused by both, naming the same problem; the doctor leaves nothing made."""
    from hicache.effects.for_cli import environment_problems

    path = _runtime_dir_case(tmp_path, case)
    problems = environment_problems({"HICACHE_RUNTIME_DIR": str(path)})
    assert (case == "absent") == (not path.exists() and not path.is_symlink())  # the doctor made nothing
    if case in ("absent", "0700"):
        assert problems == []
        with budget_lock(directory=path):
            pass
        return
    (problem,) = problems
    with pytest.raises(RegistrationStateError) as refused:
        with budget_lock(directory=path):
            pass
    reason = str(refused.value).removeprefix("lock directory ")
    assert problem.reason == f"environment variable HICACHE_RUNTIME_DIR={str(path)!r}: {reason}"


_HOLD = (
    "import sys, time; from pathlib import Path; from hicache.effects._hostwide._lock import budget_lock\n"
    "with budget_lock(directory=Path(sys.argv[1])):\n"
    "    print('held', flush=True); time.sleep(float(sys.argv[2]))\n"
)


def test_a_waiter_says_who_holds_the_lock_and_a_timeout_names_the_holder(tmp_path, caplog):
    """Another process holds the host-wide lock: a waiting bring-up logs the holder's pid and
    since when every few seconds (here every 0.2 s of an injected clock that each poll's sleep
    moves on) instead of waiting in silence, and with HICACHE_LOCK_TIMEOUT it ends in a clean
    LockTimeoutError naming that pid - at the first poll past the timeout, not later."""
    import logging

    from hicache.effects._hostwide._lock import POLL_S, BudgetLock
    from hicache.errors import LockTimeoutError

    tmp_path.chmod(0o700)
    holder = subprocess.Popen([sys.executable, "-c", _HOLD, str(tmp_path), "600"], stdout=subprocess.PIPE, text=True)
    now = [1000.0]
    sleeps = []

    def sleep(seconds):
        sleeps.append(seconds)
        now[0] += seconds

    try:
        assert holder.stdout.readline().strip() == "held"
        lock = BudgetLock(tmp_path, timeout_s=1.0, report_every_s=0.2, clock=lambda: now[0], sleep=sleep)
        with caplog.at_level(logging.WARNING, logger="hicache.effects._hostwide._lock"):
            with pytest.raises(LockTimeoutError, match=rf"timed out after 1 s .* held by pid {holder.pid} since "):
                lock.__enter__()
        assert 1.0 < now[0] - 1000.0 <= 1.0 + POLL_S + 1e-9 and set(sleeps) == {POLL_S}
        reports = [r.getMessage() for r in caplog.records if "waiting" in r.getMessage()]
        assert 4 <= len(reports) <= 5  # every 0.2 s of the injected clock over its 1 s
        assert all(f"held by pid {holder.pid}" in r and "HICACHE_LOCK_TIMEOUT" in r for r in reports)
    finally:
        holder.kill()
        holder.communicate()
    with BudgetLock(tmp_path, timeout_s=5):  # a killed holder blocks nobody
        pass


def test_hicache_lock_timeout_sets_the_default_wait_and_is_validated(tmp_path):
    """HICACHE_LOCK_TIMEOUT is the budget lock's default wait, an explicit timeout beats it, and a
    bad value names the variable."""
    from hicache.effects._hostwide._lock import budget_lock, lock_timeout_s
    from hicache.errors import EnvError

    assert lock_timeout_s({}) is None and lock_timeout_s({"HICACHE_LOCK_TIMEOUT": "2.5"}) == 2.5
    assert budget_lock(directory=tmp_path, env={"HICACHE_LOCK_TIMEOUT": "7"}).timeout_s == 7.0
    assert budget_lock(directory=tmp_path, timeout_s=3, env={"HICACHE_LOCK_TIMEOUT": "7"}).timeout_s == 3
    for bad in ("0", "-1", "soon", "nan", "inf"):
        with pytest.raises(EnvError, match=f"HICACHE_LOCK_TIMEOUT={bad!r}"):
            lock_timeout_s({"HICACHE_LOCK_TIMEOUT": bad})
