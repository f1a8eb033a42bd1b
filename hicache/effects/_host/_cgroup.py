"""The memory a cgroup lets this process have: the limit and the usage of the group, among the
process's own and every group above it, with the least room left - usage less the group's page
cache, as MemAvailable counts the host's (so the figure sits beside psutil's available memory).
Reads ``/proc/self/cgroup`` and the cgroup mounts under a root; imports nothing of hicache.

Why every level: a parent's limit binds its children (a systemd slice over its services, a
Kubernetes pod over its containers, a Slurm job over its steps), and the group a process sits
in often has none of its own. Why v1 too: the memory controller is still mounted as cgroup v1
on hosts that booted with it (a "hybrid" layout: v1 controllers, an empty unified tree beside
them) - there psutil's available memory is the host's, and only the group's file says the job
will be OOM-killed at its limit. The same rules as SGLang 0.5.23's own headroom
(``sglang.srt.mem_cache.host_memory``): v2's ``memory.high`` (where reclaim and throttling
start) is a limit too, and the page cache is the file LRU's pages, active and inactive (shmem,
tmpfs included, sits on the anon LRU and stays counted).
"""

from __future__ import annotations

from pathlib import Path
from typing import NamedTuple

#: At or above this a v1 limit means none: the kernel says "unlimited" with PAGE_COUNTER_MAX
#: pages (9223372036854771712 bytes on 4 KiB pages, just under 2^63 for any page size)
V1_UNLIMITED = 1 << 62


class _Version(NamedTuple):
    mount: str  # under the root
    limits: tuple[str, ...]  # files whose value is a limit ("max": none)
    usage: str
    page_cache: tuple[str, ...]  # memory.stat keys of the file LRU (v1's total_: the group's and its children's,
    #                              as its usage counts them; its unprefixed counters omit descendants)


_V2 = _Version("sys/fs/cgroup", ("memory.max", "memory.high"), "memory.current", ("active_file", "inactive_file"))
_V1 = _Version("sys/fs/cgroup/memory", ("memory.limit_in_bytes",), "memory.usage_in_bytes",
               ("total_active_file", "total_inactive_file"))


def _read_int(path: Path) -> int | None:
    try:
        text = path.read_text().strip()
    except OSError:
        return None
    return int(text) if text.isdigit() else None  # "max" (v2's no limit) and anything unreadable: None


def _without_page_cache(directory: Path, usage: int | None, keys: tuple[str, ...]) -> int | None:
    """The group's usage less its page cache (memory.stat), which the kernel reclaims before it
    OOM-kills: raw usage counts cache that fills a group up to its limit, which would read as
    no room at all."""
    if usage is None:
        return None
    try:
        stat = (directory / "memory.stat").read_text()
    except OSError:
        return usage
    values = dict(line.partition(" ")[::2] for line in stat.splitlines())
    cache = sum(int(values[key]) for key in keys if values.get(key, "").strip().isdigit())
    return max(0, usage - cache)


def _groups(text: str) -> tuple[str | None, str | None]:
    """The process's v1 memory group and its v2 group from /proc/self/cgroup's lines
    (``ID:controllers:path``; v2's is ``0::path``)."""
    v1 = v2 = None
    for line in text.splitlines():
        parts = line.split(":", 2)
        if len(parts) != 3:
            continue
        hierarchy, controllers, path = parts
        if hierarchy == "0" and not controllers:
            v2 = path
        elif "memory" in controllers.split(","):
            v1 = path
    return v1, v2


def _levels(path: str) -> list[str]:
    """``/a/b`` -> ``["a/b", "a", ""]``: the group, each group above it, the mount's root."""
    parts = [part for part in path.split("/") if part]
    return ["/".join(parts[:end]) for end in range(len(parts), -1, -1)]


def memory_limit(root: str = "/") -> tuple[int | None, int | None]:
    """``(limit, usage)`` in bytes of the group with the least room (limit - usage) among this
    process's memory group and those above it, or ``(None, None)`` where none has a limit.
    The v1 memory controller where /proc/self/cgroup names one, else cgroup v2. A level that
    is not visible is skipped: inside a container its own group is the mount's root."""
    try:
        text = Path(root, "proc/self/cgroup").read_text()
    except OSError:
        return None, None
    v1, v2 = _groups(text)
    path, version = (v1, _V1) if v1 is not None else (v2, _V2)
    if path is None:
        return None, None
    found: list[tuple[int, int | None]] = []  # (limit, usage) of every limit on the way up
    for level in _levels(path):
        directory = Path(root, version.mount, level)
        limits = [value for name in version.limits if (value := _read_int(directory / name)) is not None
                  and value < V1_UNLIMITED]
        if limits:
            usage = _without_page_cache(directory, _read_int(directory / version.usage), version.page_cache)
            found += [(limit, usage) for limit in limits]
    return min(found, key=lambda pair: pair[0] - (pair[1] or 0), default=(None, None))
