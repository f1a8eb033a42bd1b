"""The creators' lock of one arena path (hicache.effects' arena room): so one process creates an
arena and the others wait, then attach - a lock file of this user's own in hicache's private
runtime directory, never a lock on the shared directory (any user could hold that one: issue
#51). Imports the leaves and `_hostwide`'s runtime directory only.
"""

from __future__ import annotations

import fcntl
import hashlib
import os
import time

from hicache.effects._hostwide._rundir import private_dir, runtime_dir
from hicache.errors import ArenaBeingCreatedError, ArenaError, LockDirectoryError


class CreatorsLock:
    """The creators' lock of one arena path: an exclusive flock of a file of this user's in
    hicache's private runtime directory (mode 0700: no other user can hold it), named after the
    path. One process creates, the others wait here, then attach. The holder writes its pid
    in it, so a waiter that gives up names who held it. Released by close - and by the holder's
    death (the kernel drops a dead process's flock)."""

    def __init__(self, path: str, *, timeout_s: float, directory=None, clock=time.monotonic,
                 sleep=time.sleep) -> None:
        self.path = _lock_path(path, directory)
        try:
            self.fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK, 0o600)
        except OSError as error:
            raise ArenaError(f"store arena {path}: cannot open its creators' lock {self.path} ({error.strerror})") \
                from None
        deadline = clock() + timeout_s
        while True:
            try:
                fcntl.flock(self.fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if clock() > deadline:  # a hang guard: creating even a TB arena takes minutes
                    holder = os.pread(self.fd, 32, 0).decode(errors="replace").strip() or "unknown"
                    os.close(self.fd)
                    raise ArenaBeingCreatedError(
                        f"store arena {path}: another creator (pid {holder}) held its lock {self.path} for "
                        f"{timeout_s:.0f} s; is it still pre-faulting? (hicache store status {path} once it is done)",
                        creator=holder) from None
                sleep(0.01)
        os.ftruncate(self.fd, 0)
        os.pwrite(self.fd, f"{os.getpid()}\n".encode(), 0)

    def close(self) -> None:
        os.close(self.fd)  # drops the flock


def creator_at_work(path: str, *, directory=None) -> str | None:
    """The pid written in the creators' lock of ``path`` while a creator holds it; None when
    none does (no lock file yet, or a free one: a creator that died dropped it). Probes without
    waiting: the lock is taken and let go at once where it is free."""
    try:
        fd = os.open(_lock_path(path, directory), os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK)
    except FileNotFoundError:
        return None
    except OSError as error:
        raise ArenaError(f"store arena {path}: cannot open its creators' lock ({error.strerror})") from None
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        holder = os.pread(fd, 32, 0).decode(errors="replace").strip()
        os.close(fd)
        return holder or "unknown"
    os.close(fd)  # free: drops the probe's own flock
    return None


def _lock_path(path: str, directory) -> str:
    """The creators' lock file of the arena at ``path`` (named after its absolute path) in the
    private runtime directory (``directory``: its parent, default hicache's)."""
    try:
        base = private_dir(runtime_dir() if directory is None else directory)
    except LockDirectoryError as error:
        raise ArenaError(f"store arena {path}: no private directory for the creators' lock ({error})") from None
    return str(base / f"arena-{hashlib.sha256(os.path.abspath(path).encode()).hexdigest()[:24]}.lock")
