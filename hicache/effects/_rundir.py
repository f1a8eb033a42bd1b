"""The private runtime directory where hicache's host-wide coordination files live: the budget
lock and its ledger (`_bringup._lock`), the registration turnstile (`_cuda._turnstile`) - and
the one reading of their seconds settings (HICACHE_LOCK_TIMEOUT, HICACHE_PIN_MAX_STALL_S).

A leaf every room may use: its scope is what "the host" means to hicache - processes that share
it coordinate. Mode 0700, owned by us, not a symlink: another user must not be able to hold a
lock of ours or forge a ticket. Imports hicache.errors only.
"""

from __future__ import annotations

import math
import os
import stat
from pathlib import Path

from hicache.errors import EnvError, LockDirectoryError


def runtime_dir(env=None) -> Path:
    """HICACHE_RUNTIME_DIR, else $XDG_RUNTIME_DIR/hicache, else /tmp/hicache-<uid>."""
    env = os.environ if env is None else env
    if env.get("HICACHE_RUNTIME_DIR"):
        return Path(env["HICACHE_RUNTIME_DIR"])
    if env.get("XDG_RUNTIME_DIR"):
        return Path(env["XDG_RUNTIME_DIR"], "hicache")
    return Path(f"/tmp/hicache-{os.getuid()}")


def private_dir(path: Path) -> Path:
    try:
        os.mkdir(path, 0o700)
    except FileExistsError:
        pass
    except OSError as error:
        raise LockDirectoryError(
            f"lock directory {path} cannot be created: {error.strerror} (set HICACHE_RUNTIME_DIR to a "
            "private directory of yours)"
        ) from None
    try:
        info = os.lstat(path)
    except OSError as error:
        raise LockDirectoryError(f"lock directory {path} cannot be read: {error.strerror}") from None
    if stat.S_ISLNK(info.st_mode) or not stat.S_ISDIR(info.st_mode):
        raise LockDirectoryError(f"lock directory {path} is not a plain directory")
    if info.st_uid != os.getuid() or info.st_mode & 0o077:
        raise LockDirectoryError(
            f"lock directory {path} must be owned by uid {os.getuid()} with mode 0700 "
            f"(found uid {info.st_uid}, mode {oct(info.st_mode & 0o777)})"
        )
    return path


def env_seconds(env, name: str) -> float | None:
    """Environment variable ``name`` as a positive, finite number of seconds (None: unset or
    blank); anything else is an `EnvError` naming the variable and the value."""
    raw = env.get(name, "").strip()
    if not raw:
        return None
    try:
        seconds = float(raw)
    except ValueError:
        seconds = math.nan
    if not math.isfinite(seconds) or seconds <= 0:
        raise EnvError(f"environment variable {name}={raw!r} must be a positive number of seconds")
    return seconds
