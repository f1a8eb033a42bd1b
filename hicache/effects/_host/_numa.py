"""NUMA placement of host pools: bind a mapping to the node its GPU sits on.

Owns ``mbind``/``get_mempolicy`` through ctypes (glibc does not export them; the syscall
numbers are per architecture), the online-node list and each node's free memory from sysfs,
binding a mapping, and where a rank's pre-fault threads run (issue #35 item 2: `fault_share` -
on its pool's node's CPUs, an equal share of them for each rank the node hosts; `_threads`
pins them). Resolving ``numa_node`` = ``"auto" | "off" | N`` needs the GPUs' PCI
placement and lives with the probes (`_probes.resolve_numa_node`). Binding happens before
pre-fault, so every page is placed there. Imports nothing of hicache.effects.
"""

from __future__ import annotations

import ctypes
import errno
import os
import platform
import re
from pathlib import Path

import attrs

from hicache.errors import HostOutOfMemoryError

MPOL_BIND = 2
MPOL_F_ADDR = 1 << 1
_SYSCALLS = {"x86_64": (237, 239), "aarch64": (235, 236)}  # (mbind, get_mempolicy)
_MAX_NODES = 1024


def parse_node_list(text: str) -> tuple[int, ...]:
    """A kernel node/CPU list ("0", "0-3", "0,2-3") as numbers; empty for an empty list."""
    nodes: list[int] = []
    for part in text.strip().split(","):
        part = part.strip()
        if not part:
            continue
        low, _, high = part.partition("-")
        nodes.extend(range(int(low), int(high or low) + 1))
    return tuple(nodes)


def online_nodes(*, root: str = "/") -> tuple[int, ...]:
    """The online NUMA nodes (``/sys/devices/system/node/online``: "0", "0-3", "0,2")."""
    try:
        text = Path(root, "sys/devices/system/node/online").read_text()
    except OSError:
        return (0,)
    return parse_node_list(text) or (0,)


def allowed_nodes(*, root: str = "/") -> tuple[int, ...]:
    """The online nodes this process may allocate on: its cpuset's effective mems
    (``Mems_allowed_list`` in ``/proc/self/status``, what ``cpuset.mems.effective`` gives the
    process); every online node where that cannot be read."""
    online = online_nodes(root=root)
    try:
        status = Path(root, "proc/self/status").read_text()
    except OSError:
        return online
    match = re.search(r"^Mems_allowed_list:\s*(\S*)\s*$", status, re.MULTILINE)
    if not match:
        return online
    try:
        allowed = set(parse_node_list(match[1]))
    except ValueError:
        return online
    return tuple(n for n in online if n in allowed) or online


def memory_only_nodes(*, root: str = "/") -> tuple[int, ...]:
    """Online nodes without CPUs (CXL or other memory-only nodes): an empty ``cpulist``."""
    found = []
    for node in online_nodes(root=root):
        try:
            cpus = Path(root, f"sys/devices/system/node/node{node}/cpulist").read_text()
        except OSError:
            continue  # unreadable: assume it has CPUs
        if not cpus.strip():
            found.append(node)
    return tuple(found)


def node_free_bytes(*, root: str = "/") -> dict[int, int]:
    """Free memory (``MemFree`` of its meminfo), in bytes, of each node this process may use
    (`allowed_nodes`: online and in its cpuset)."""
    free = {}
    for node in allowed_nodes(root=root):
        try:
            text = Path(root, f"sys/devices/system/node/node{node}/meminfo").read_text()
        except OSError:
            continue
        match = re.search(r"MemFree:\s+(\d+)\s*kB", text)
        if match:
            free[node] = int(match[1]) * 1024
    return free


def process_cpus() -> tuple[int, ...]:
    """The CPUs this process may run on (its affinity: taskset, cpuset); every CPU where that
    cannot be asked."""
    try:
        return tuple(sorted(os.sched_getaffinity(0)))
    except (AttributeError, OSError):
        return tuple(range(os.cpu_count() or 1))


def node_cpus(*, root: str = "/", allowed_cpus=None) -> tuple[tuple[int, tuple[int, ...]], ...]:
    """``(node, cpus)`` for each node this process may use (`allowed_nodes`): the node's
    ``cpulist`` less the CPUs outside this process's affinity (``allowed_cpus``, default
    `process_cpus`). A memory-only node, or one whose CPUs this process may not use, has none."""
    allowed = set(process_cpus() if allowed_cpus is None else allowed_cpus)
    pairs = []
    for node in allowed_nodes(root=root):
        try:
            text = Path(root, f"sys/devices/system/node/node{node}/cpulist").read_text()
            cpus = parse_node_list(text)
        except (OSError, ValueError):
            cpus = ()
        pairs.append((node, tuple(cpu for cpu in cpus if cpu in allowed)))
    return tuple(pairs)


#: The most pre-fault threads one rank runs by default (faulting stops scaling well before).
MAX_FAULT_THREADS = 16


@attrs.frozen
class FaultShare:
    """Where one rank's pre-fault runs: ``threads`` threads, each pinned to ``cpus`` (None: not
    pinned), on ``node`` (None: the pool is bound nowhere) that ``ranks_on_node`` ranks share."""

    threads: int
    cpus: tuple[int, ...] | None
    node: int | None
    ranks_on_node: int


def fault_share(node: int | None, *, node_cpus, all_cpus, ranks_per_host: int, threads: int | None = None) -> FaultShare:
    """The pre-fault threads of a rank whose pool is bound to ``node`` (issue #35 item 2).

    Bound to a node with CPUs: its threads run on that node's CPUs (``node_cpus``: `node_cpus`'s
    pairs), next to the memory they fault, so the ranks of different nodes fill side by side on
    their own memory controllers; a node hosts ``ceil(ranks_per_host / nodes with CPUs)``
    ranks (ranks are spread over the nodes their GPUs sit on), and each takes an equal share of
    its CPUs: the same number of threads at the same priority, so no rank starves another
    whatever order they start in. Not bound (or to a memory-only node): unpinned, an equal
    share of ``all_cpus`` (the process's) among the host's ranks. ``threads`` (the caller's
    ``prefault_threads``) overrides the count, never the placement. At most
    `MAX_FAULT_THREADS`, at least one.
    """
    ranks = max(1, int(ranks_per_host))
    cpus_of = dict(node_cpus)
    home = cpus_of.get(node) if node is not None else None
    if home:
        nodes = max(1, sum(1 for cpus in cpus_of.values() if cpus))
        sharing = -(-ranks // nodes)
        count = len(home) // sharing
        pinned: tuple[int, ...] | None = tuple(home)
    else:
        sharing, count, pinned = ranks, len(all_cpus) // ranks, None
    count = max(1, min(MAX_FAULT_THREADS, count)) if not threads else threads
    return FaultShare(count, pinned, node, sharing)


def _syscalls():
    numbers = _SYSCALLS.get(platform.machine())
    if numbers is None:
        return None
    return ctypes.CDLL(None, use_errno=True), numbers


def _mask(node: int):
    words = _MAX_NODES // 64
    mask = (ctypes.c_ulong * words)()
    mask[node // 64] = 1 << (node % 64)
    return mask


def bind(ptr: int, length: int, node: int) -> None:
    """Bind ``[ptr, ptr + length)`` (page aligned, not yet faulted) to NUMA ``node``."""
    calls = _syscalls()
    if calls is None:
        raise HostOutOfMemoryError(f"NUMA binding is not supported on {platform.machine()}")
    libc, (mbind, _) = calls
    result = libc.syscall(mbind, ctypes.c_void_p(ptr), ctypes.c_ulong(length), MPOL_BIND, _mask(node),
                          ctypes.c_ulong(_MAX_NODES), 0)
    if result != 0:
        code = ctypes.get_errno()
        raise HostOutOfMemoryError(f"mbind to NUMA node {node} failed: {os.strerror(code)} ({errno.errorcode.get(code, code)})")


def bound_node(ptr: int) -> int | None:
    """The node the page at ``ptr`` is bound to (None: no binding policy, or unknown)."""
    calls = _syscalls()
    if calls is None:
        return None
    libc, (_, get_mempolicy) = calls
    policy, mask = ctypes.c_int(-1), _mask(0)
    mask[0] = 0
    if libc.syscall(get_mempolicy, ctypes.byref(policy), mask, ctypes.c_ulong(_MAX_NODES), ctypes.c_void_p(ptr),
                    MPOL_F_ADDR) != 0 or policy.value != MPOL_BIND:
        return None
    for word, bits in enumerate(mask):
        if bits:
            return word * 64 + (bits & -bits).bit_length() - 1
    return None
