"""The private runtime directory where hicache's host-wide coordination files live: the budget
lock and its ledger (`_lock`), the registration turnstile (`_turnstile`), both beside it in
``_hostwide`` (their seconds settings are the environment table's rows).

Its scope is what "the host" means to hicache - processes that share it coordinate. Mode 0700, owned by us, not a symlink: another user must not be able to hold a
lock of ours or forge a ticket. Imports hicache.errors and the environment table only.
"""

from __future__ import annotations

import os
import stat
from pathlib import Path

from hicache.errors import LockDirectoryError
from hicache.plan.settings import env_value


def runtime_dir(env=None) -> Path:
    """HICACHE_RUNTIME_DIR, else $XDG_RUNTIME_DIR/hicache, else /tmp/hicache-<uid>."""
    env = os.environ if env is None else env
    if (given := env_value(env, "HICACHE_RUNTIME_DIR")) is not None:
        return Path(given)
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
    problem = _refusal(path, info)
    if problem is not None:
        raise LockDirectoryError(f"lock directory {problem}")
    return path


def _refusal(path: Path, info: os.stat_result) -> str | None:
    """What makes ``path`` (its ``lstat``) unfit to hold hicache's host-wide files - not a plain
    directory (a symlink, a file, a FIFO), or not ours with mode 0700 - else None."""
    if stat.S_ISLNK(info.st_mode) or not stat.S_ISDIR(info.st_mode):
        return f"{path} is not a plain directory"
    if info.st_uid != os.getuid() or info.st_mode & 0o077:
        return (f"{path} must be owned by uid {os.getuid()} with mode 0700 (found uid {info.st_uid}, "
                f"mode {oct(info.st_mode & 0o777)})")
    return None


def runtime_dir_problem(path: Path) -> str | None:
    """What `private_dir` would refuse about ``path``, leaving nothing behind (`hicache doctor`):
    None when it is ours, a plain directory of mode 0700 - or absent and creatable (tried: made
    and removed again)."""
    try:
        info = os.lstat(path)
    except FileNotFoundError:
        parent = path.parent
        if not parent.is_dir():
            return f"{path} does not exist and neither does its parent {parent}"
        # made and removed at once: os.access() says yes to root anywhere, /proc included, where
        # apply's mkdir then fails (issue #54) - the real call is the only true answer
        try:
            os.mkdir(path, 0o700)
        except FileExistsError:  # made by someone meanwhile: judge it as it is
            return runtime_dir_problem(path)
        except OSError as error:
            return f"{path} does not exist and cannot be created: {error.strerror}"
        try:
            os.rmdir(path)
        except OSError:
            pass
        return None
    except OSError as error:
        return f"{path} cannot be read: {error.strerror}"
    return _refusal(path, info)
