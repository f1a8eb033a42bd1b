"""Which filesystem a node store's arena would live on, and how much room it has: the mount from
/proc/self/mountinfo (tmpfs, or hugetlbfs with its ``pagesize=``), free bytes from statvfs, free
hugepages from sysfs.

A disk filesystem is refused: its pages are written back and, since Linux 6.5, a writable
long-term pin of a regular disk-file mapping is refused (tmpfs and hugetlbfs are exempt). Parsing
is a pure function of the mountinfo text (tests pass their own); `backing_of` reads the machine.
"""

from __future__ import annotations

import os
import stat
from pathlib import Path

import attrs

from hicache.errors import ArenaError
from hicache.plan.settings import DEFAULT_HUGEPAGE_BYTES  # a hugetlbfs mount without pagesize= has it

MEMORY_FILESYSTEMS = ("tmpfs", "hugetlbfs")
_SIZES = {"k": 2**10, "m": 2**20, "g": 2**30}


@attrs.frozen
class Mount:
    """One mount: where, its filesystem type, its super options, and its page size in bytes
    (hugetlbfs' ``pagesize=``; None for others)."""

    point: str
    fstype: str
    options: tuple[str, ...]
    pagesize_bytes: int | None


def _unescape(field: str) -> str:
    # mountinfo escapes space, tab, newline and backslash as \ooo octal
    out, i = [], 0
    while i < len(field):
        if field[i] == "\\" and i + 4 <= len(field) and field[i + 1:i + 4].isdigit():
            out.append(chr(int(field[i + 1:i + 4], 8)))
            i += 4
        else:
            out.append(field[i])
            i += 1
    return "".join(out)


def _pagesize(options: tuple[str, ...]) -> int | None:
    for option in options:
        if option.startswith("pagesize="):
            value = option.split("=", 1)[1].strip().lower()
            if value and value[-1] in _SIZES:
                return int(value[:-1]) * _SIZES[value[-1]]
            return int(value)
    return None


def parse_mountinfo(text: str) -> list[Mount]:
    """The mounts of a /proc/<pid>/mountinfo text, in its order (later mounts stack on earlier)."""
    mounts = []
    for line in text.splitlines():
        fields = line.split()
        if "-" not in fields:
            continue
        dash = fields.index("-")
        if dash < 5 or dash + 1 >= len(fields):  # no mount point before it, or no type after it
            continue
        point = _unescape(fields[4])
        fstype = fields[dash + 1]
        options = tuple(fields[dash + 3].split(",")) if len(fields) > dash + 3 else ()
        pagesize = _pagesize(options) if fstype == "hugetlbfs" else None
        mounts.append(Mount(point, fstype, options, pagesize))
    return mounts


def mount_of(directory: str, mounts: list[Mount]) -> Mount:
    """The mount ``directory`` (an absolute, resolved path) lives on: the longest mount point
    containing it, the latest such mount when several stack there."""
    best = None
    for mount in mounts:
        point = mount.point.rstrip("/") or "/"
        inside = directory == point or directory.startswith(point + "/") or point == "/"
        if inside and (best is None or len(point) >= len(best.point.rstrip("/") or "/")):
            best = mount
    if best is None:
        raise ArenaError(f"store arena: no mount holds {directory} (mountinfo lists none)")
    return best


@attrs.frozen
class Backing:
    """Where an arena's file would go: the directory, its mount, its free bytes (statvfs) and,
    on hugetlbfs, free hugepages of its page size (sysfs; None where the mount says nothing)."""

    directory: str
    mount: Mount
    free_bytes: int

    @property
    def kind(self) -> str:
        return self.mount.fstype

    @property
    def unit_bytes(self) -> int:
        """The backing's page: hugetlbfs' ``pagesize=`` (the kernel's default hugepage size,
        2 MiB on x86-64, where a mount names none), else 4 KiB."""
        if self.mount.pagesize_bytes:
            return self.mount.pagesize_bytes
        return DEFAULT_HUGEPAGE_BYTES if self.kind == "hugetlbfs" else 4096


def mounts(*, root: str = "/") -> list[Mount]:
    """This process's mounts (/proc/self/mountinfo under ``root``); OSError when unreadable."""
    return parse_mountinfo(Path(root, "proc/self/mountinfo").read_text())


_KINDS = ((stat.S_ISLNK, "a symbolic link (give the arena's own path)"), (stat.S_ISDIR, "a directory"),
          (stat.S_ISFIFO, "a FIFO"), (stat.S_ISSOCK, "a socket"), (stat.S_ISCHR, "a character device"),
          (stat.S_ISBLK, "a block device"))


def refuse_non_regular(path: str, info: os.stat_result | None = None) -> os.stat_result | None:
    """The lstat of ``path`` (None when nothing is there); `ArenaError` naming what it is when
    that is not a regular file - before anything opens it (a FIFO's open would block)."""
    if info is None:
        try:
            info = os.lstat(path)
        except FileNotFoundError:
            return None
        except OSError as error:
            raise ArenaError(f"store arena {path}: cannot be read ({error.strerror})") from None
    if not stat.S_ISREG(info.st_mode):
        what = next((name for test, name in _KINDS if test(info.st_mode)), "not a regular file")
        raise ArenaError(f"store arena {path}: is {what}, not an arena file")
    return info


def backing_of(path: str, *, root: str = "/") -> Backing:
    """The backing of an arena at ``path`` (its directory must exist): `ArenaError` naming the
    filesystem when it is not tmpfs or hugetlbfs - and first, naming what is at ``path`` when that
    is not a regular file (a mount point given as the arena's path is a directory, whatever its
    parent's filesystem)."""
    refuse_non_regular(path)
    directory = os.path.realpath(os.path.dirname(os.path.abspath(path)))
    if not os.path.isdir(directory):
        raise ArenaError(f"store arena {path}: directory {directory} does not exist")
    try:
        found = mounts(root=root)
    except OSError as error:
        raise ArenaError(f"store arena {path}: cannot read /proc/self/mountinfo ({error.strerror})") from None
    mount = mount_of(directory, found)
    if mount.fstype not in MEMORY_FILESYSTEMS:
        raise ArenaError(
            f"store arena {path}: {mount.point} is {mount.fstype}, not tmpfs or hugetlbfs (a disk file's pages are "
            "written back and cannot be pinned long-term since Linux 6.5): put it under /dev/shm or a hugetlbfs mount"
        )
    stats = os.statvfs(directory)
    free = stats.f_bavail * stats.f_frsize
    backing = Backing(directory, mount, free)
    if mount.fstype == "hugetlbfs":
        from hicache.effects._host._memory import free_hugepages

        unit = backing.unit_bytes
        _, free_pages = free_hugepages(unit, root=root)
        pool_free = free_pages * unit
        # a hugetlbfs mount without size= reports no blocks: the pool's free pages are the room
        backing = Backing(directory, mount, min(free, pool_free) if stats.f_blocks else pool_free)
    return backing
