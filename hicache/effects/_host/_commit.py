"""Strict overcommit (``vm.overcommit_memory`` 2): the kernel refuses a mapping past its commit
limit however much memory is free, so there the room a pool has is CommitLimit - Committed_AS,
and an mmap's ENOMEM means that, not "out of memory". Reads /proc under a root; imports nothing
of hicache.
"""

from __future__ import annotations

import re
from pathlib import Path

_COMMIT = re.compile(r"^(CommitLimit|Committed_AS):\s+(\d+) kB", re.M)


def _read(root: str, path: str) -> str | None:
    try:
        return Path(root, path).read_text().strip()
    except OSError:
        return None


def commit_room(*, root: str = "/") -> int | None:
    """Bytes a new mapping may still commit under strict overcommit; None in the heuristic modes
    (0, 1), where free memory is what counts, or where /proc does not say."""
    if _read(root, "proc/sys/vm/overcommit_memory") != "2":
        return None
    fields = dict(_COMMIT.findall(_read(root, "proc/meminfo") or ""))
    if len(fields) != 2:
        return None
    return max(0, int(fields["CommitLimit"]) - int(fields["Committed_AS"])) * 1024


def commit_refusal(root: str = "/") -> str:
    """What to add to an mmap's ENOMEM under strict overcommit (empty elsewhere): the commit
    limit refused it, and how much room was left."""
    room = commit_room(root=root)
    if room is None:
        return ""
    return (f" - vm.overcommit_memory=2: {room} bytes were left to commit (CommitLimit - Committed_AS in "
            "/proc/meminfo), however much memory is free; set vm.overcommit_memory=0 or raise vm.overcommit_ratio")
