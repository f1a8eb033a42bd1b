"""The cross-process budget lock: exclusive, private, and it remembers who allocated."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from hicache.effects._bringup._lock import budget_lock
from hicache.errors import RegistrationStateError


def test_lock_excludes_other_processes(tmp_path):
    """While held here, another process cannot take it (it times out)."""
    code = (
        "import sys; from pathlib import Path; from hicache.effects._bringup._lock import budget_lock\n"
        "try:\n"
        f"    with budget_lock(directory=Path({str(tmp_path)!r}), timeout_s=0.3): print('got')\n"
        "except Exception as e: print(type(e).__name__)\n"
    )
    with budget_lock(directory=tmp_path):
        out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert out.stdout.strip() == "RegistrationStateError", out.stderr
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
    """A lock directory that is a symlink, or readable by others, is refused."""
    real = tmp_path / "real"
    real.mkdir(mode=0o700)
    link = tmp_path / "link"
    link.symlink_to(real)
    with pytest.raises(RegistrationStateError, match="not a plain directory"):
        budget_lock(directory=link)
    shared = tmp_path / "shared"
    shared.mkdir()
    shared.chmod(0o755)
    with pytest.raises(RegistrationStateError, match="mode 0700"):
        budget_lock(directory=shared)
