"""The files hicache writes where a user names them - a bring-up trace, `hicache trace merge
--out`, `hicache plan --out` - and the one rule they follow (issue #33): only a new file or a
regular one of this user's is replaced, through a private temp file in the same directory, so a
reader never sees half a file and an interrupted write leaves the old one (a replaced file keeps
its permissions, a new one is private: 0600); a symlink, device, FIFO, socket or directory at
the path is refused before anything is written (a FIFO would block the writer until someone
read it; a symlink would send the bytes wherever it points). A leaf: the standard library only,
so `hicache plan` stays light.
"""

from __future__ import annotations

import os
import stat
import tempfile

_KINDS = ((stat.S_ISDIR, "a directory"), (stat.S_ISCHR, "a character device"), (stat.S_ISBLK, "a block device"),
          (stat.S_ISFIFO, "a FIFO"), (stat.S_ISSOCK, "a socket"))


def check_output(path, *, what: str, error) -> str:
    """``path`` as an absolute path ``what`` (e.g. "trace file") may be written to: an existing
    regular file this user may write (it is replaced), or a new file in an existing writable
    directory. Anything else - a symlink, a device, a FIFO, a directory, a missing or read-only
    directory - raises ``error(message)`` saying which, before anything is written."""
    text = os.fspath(path)
    if not text.strip():
        raise error(f"{what}: an empty path")
    absolute = os.path.abspath(text)
    try:
        info = os.lstat(absolute)
    except FileNotFoundError:
        info = None
    except OSError as failure:
        raise error(f"{what} {text}: {failure.strerror}") from None
    if info is not None:
        if stat.S_ISLNK(info.st_mode):
            raise error(f"{what} {text} is a symbolic link: give the file's own path")
        kind = next((name for test, name in _KINDS if test(info.st_mode)), None)
        if kind is not None or not stat.S_ISREG(info.st_mode):
            raise error(f"{what} {text} is {kind or 'not a regular file'}: hicache replaces only a regular file")
        if not os.access(absolute, os.W_OK):
            raise error(f"{what} {text} is not writable")
    directory = os.path.dirname(absolute)
    if not os.path.isdir(directory):
        raise error(f"{what} {text}: directory {directory} does not exist")
    try:  # the one sure test (read-only mounts, /proc, root's permissions): make the temp file a write makes
        fd, probe = tempfile.mkstemp(prefix=f".{os.path.basename(absolute)}.", suffix=".tmp", dir=directory)
    except OSError as failure:
        raise error(f"{what} {text}: directory {directory} is not writable ({failure.strerror})") from None
    os.close(fd)
    os.unlink(probe)
    return absolute


def replace_file(path: str, write, *, what: str, error) -> None:
    """Write ``path`` (checked by `check_output` first) with ``write(handle)`` (a text handle)
    through a private temp file in its directory, checked again just before the rename - a
    device or link put there since is not replaced. Leaves no temp file on any failure (an
    interrupt included, which still propagates); an OSError is ``error(message)``."""
    temporary = None
    try:
        fd, temporary = tempfile.mkstemp(prefix=f".{os.path.basename(path)}.", suffix=".tmp",
                                         dir=os.path.dirname(path))
        with os.fdopen(fd, "w") as handle:
            write(handle)
        check_output(path, what=what, error=error)
        try:  # a replaced file keeps its permissions; a new one stays the temp file's 0600
            os.chmod(temporary, stat.S_IMODE(os.stat(path).st_mode))
        except FileNotFoundError:
            pass
        os.replace(temporary, path)  # a reader never sees half a file
        temporary = None
    except OSError as failure:
        raise error(f"{what} {path}: {failure.strerror or failure}") from None
    finally:
        if temporary is not None:
            try:
                os.unlink(temporary)
            except OSError:
                pass
