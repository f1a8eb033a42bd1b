"""Machine probes: with `_environment` (the HICACHE_* variables) and `_cgroup` (the memory a
cgroup allows), where hicache reads the machine's facts - /proc and /sys.

Owns turning the machine into data (`MachineFacts`, `CudaFacts`) and into `Limits`
(`probe_limits`), and resolving a pool's ``numa_node`` (the current GPU's node). ``root`` re-roots /proc and /sys reads
so tests can feed a fake tree.
"""

from __future__ import annotations

import os
import re
import resource
from pathlib import Path

import attrs

from hicache.effects._host._cgroup import memory_limit
from hicache.effects._host._commit import commit_room
from hicache.effects._hostwide._rundir import runtime_dir
from hicache.effects._host._memory import os_page_bytes
from hicache.effects._cuda._runtime import default_binding
from hicache.effects._host._numa import allowed_nodes, memory_only_nodes, node_cpus, online_nodes, process_cpus
from hicache.errors import EnvError, PlanError
from hicache.effects._host._environment import ranks_per_host
from hicache.plan import (
    Limits,
    ResolvedLimits,
    kernel_pin_cap,
    resolve_limits,
)

@attrs.frozen
class HugepagePool:
    size_bytes: int
    total: int
    free: int


@attrs.frozen
class MachineFacts:
    """What this machine will do to a plan (see `hicache doctor`)."""

    kernel_release: str
    kernel_pin_cap_bytes: int | None
    os_page_bytes: int
    thp_enabled: str | None
    thp_defrag: str | None
    hugepages: tuple[HugepagePool, ...]
    memlock_soft: int | None  # None: unlimited
    memlock_hard: int | None
    max_map_count: int | None
    total_bytes: int
    available_bytes: int
    cgroup_limit_bytes: int | None
    cgroup_usage_bytes: int | None
    numa_nodes: int
    ranks_per_host: int
    numa_allowed_nodes: tuple = ()  # the nodes this process may use (its cpuset); () if unknown
    numa_memory_only_nodes: tuple = ()  # online nodes without CPUs
    free_2mib_blocks: int | None = None  # free physically contiguous 2 MiB blocks (/proc/buddyinfo)
    thp_page_bytes: int | None = None  # a transparent huge page's size (hpage_pmd_size); None: not said
    container: str | None = None  # the container runtime this process runs in (docker, podman, kubernetes, ...)
    runtime_dir: str | None = None  # where the host-wide budget lock, ledger and turnstile live (`runtime_dir`)
    commit_room_bytes: int | None = None  # under strict overcommit (mode 2): CommitLimit - Committed_AS; else None
    numa_node_cpus: tuple = ()  # (node, cpus) of each allowed node: the CPUs this process may use there
    cpus: tuple = ()  # the CPUs this process may use (its affinity); () if unknown


def _read(root: str, path: str) -> str | None:
    try:
        return Path(root, path.lstrip("/")).read_text().strip()
    except OSError:
        return None


def _selected(text: str | None) -> str | None:
    """'always [madvise] never' -> 'madvise'."""
    if text is None:
        return None
    match = re.search(r"\[(\w+)\]", text)
    return match[1] if match else text


def _rlimit(value: int) -> int | None:
    return None if value == resource.RLIM_INFINITY else value


def _numa_nodes(root: str) -> int:
    online = _read(root, "/sys/devices/system/node/online")
    if not online:
        return 1
    count = 0
    for part in online.split(","):
        low, _, high = part.partition("-")
        count += int(high or low) - int(low) + 1
    return count


def _hugepages(root: str) -> tuple[HugepagePool, ...]:
    base = Path(root, "sys/kernel/mm/hugepages")
    pools = []
    for entry in sorted(base.glob("hugepages-*kB")) if base.is_dir() else ():
        size = int(entry.name[len("hugepages-") : -len("kB")]) * 1024
        total = int(_read(root, f"/sys/kernel/mm/hugepages/{entry.name}/nr_hugepages") or 0)
        free = int(_read(root, f"/sys/kernel/mm/hugepages/{entry.name}/free_hugepages") or 0)
        pools.append(HugepagePool(size, total, free))
    return tuple(sorted(pools, key=lambda p: p.size_bytes))


#: (a file under the root, the runtime that leaves it) - the marks container runtimes leave
_CONTAINER_FILES = ((".dockerenv", "docker"), ("run/.containerenv", "podman"))
#: (a word in PID 1's cgroup path, the runtime) where a runtime leaves no file (cgroup v1 shows it)
_CONTAINER_CGROUPS = (("kubepods", "kubernetes"), ("libpod", "podman"), ("docker", "docker"), ("containerd", "containerd"),
                      ("lxc", "lxc"))


def container_kind(*, root: str = "/", env=None) -> str | None:
    """The container runtime this process runs in, as far as it leaves a mark (its file under
    ``root``, a Kubernetes pod's service variables, PID 1's cgroup path); None: none seen - a
    host, or a container that hides itself (cgroup v2 namespaces show '0::/')."""
    env = os.environ if env is None else env
    for name, kind in _CONTAINER_FILES:
        if Path(root, name).exists():
            return kind
    if env.get("KUBERNETES_SERVICE_HOST"):
        return "kubernetes"
    cgroup = _read(root, "/proc/1/cgroup") or ""
    return next((kind for word, kind in _CONTAINER_CGROUPS if word in cgroup), None)


def _runtime_dir(env) -> str | None:
    """Where the host-wide files live for ``env``; None where HICACHE_RUNTIME_DIR cannot be read
    (the environment check names it)."""
    try:
        return str(runtime_dir(env))
    except EnvError:
        return None


def thp_page_bytes(*, root: str = "/") -> int | None:
    """The size of a transparent huge page here (``hpage_pmd_size``: 2 MiB on x86-64 and 4 KiB-page
    arm64, 512 MiB under 64 KiB base pages); None where the kernel does not say."""
    text = _read(root, "/sys/kernel/mm/transparent_hugepage/hpage_pmd_size")
    return int(text) if text and text.isdigit() and int(text) > 0 else None


def free_2mib_blocks(*, root: str = "/", page_bytes: int = 4096, node: int | None = None) -> int | None:
    """Free 2 MiB blocks the buddy allocator holds, over every zone of ``node`` (None: every
    node) (``/proc/buddyinfo``: free blocks per order; a block of order k >= 9 (4 KiB pages)
    holds 2^(k-9) of them) - what THP can get at fault time without compacting. None if unreadable."""
    text = _read(root, "/proc/buddyinfo")
    if not text:
        return None
    order = (2 * 2**20 // page_bytes).bit_length() - 1
    total = 0
    for line in text.splitlines():
        head, _, rest = line.partition(",")  # "Node 0, zone Normal c0 c1 ..."
        if node is not None and head.split()[-1:] != [str(node)]:
            continue
        counts = rest.split()[2:]
        try:
            total += sum(int(count) << (k - order) for k, count in enumerate(counts) if k >= order)
        except ValueError:
            return None
    return total


def probe_machine(*, root: str = "/", env=None) -> MachineFacts:
    """Read this machine's memory, kernel and limit facts (no CUDA)."""
    import psutil  # lazy: the plan path must not import it

    env = os.environ if env is None else env
    release = _read(root, "/proc/sys/kernel/osrelease") or os.uname().release
    soft, hard = resource.getrlimit(resource.RLIMIT_MEMLOCK)
    max_map = _read(root, "/proc/sys/vm/max_map_count")
    memory = psutil.virtual_memory()
    limit, usage = memory_limit(root)
    return MachineFacts(
        kernel_release=release,
        kernel_pin_cap_bytes=kernel_pin_cap(release),
        os_page_bytes=os_page_bytes(),
        thp_enabled=_selected(_read(root, "/sys/kernel/mm/transparent_hugepage/enabled")),
        thp_defrag=_selected(_read(root, "/sys/kernel/mm/transparent_hugepage/defrag")),
        hugepages=_hugepages(root),
        memlock_soft=_rlimit(soft),
        memlock_hard=_rlimit(hard),
        max_map_count=int(max_map) if max_map and max_map.isdigit() else None,
        total_bytes=memory.total,
        available_bytes=memory.available,
        cgroup_limit_bytes=limit,
        cgroup_usage_bytes=usage,
        numa_nodes=_numa_nodes(root),
        numa_allowed_nodes=allowed_nodes(root=root),
        numa_memory_only_nodes=memory_only_nodes(root=root),
        free_2mib_blocks=free_2mib_blocks(root=root, page_bytes=os_page_bytes()),
        thp_page_bytes=thp_page_bytes(root=root),
        container=container_kind(root=root, env=env),
        runtime_dir=_runtime_dir(env),
        commit_room_bytes=commit_room(root=root),
        numa_node_cpus=node_cpus(root=root),
        cpus=process_cpus(),
        ranks_per_host=ranks_per_host(env),
    )


def probe_kernel_release(*, root: str = "/") -> str:
    """The running kernel's release string (``/proc/sys/kernel/osrelease`` under ``root``)."""
    return _read(root, "/proc/sys/kernel/osrelease") or os.uname().release


def probe_resolved_limits(
    *, env=None, root: str = "/", chunk_limit_bytes: int | None = None,
    kernel_release: str | None = None, hugepage_bytes: int | None = None, flag_names=None,
) -> ResolvedLimits:
    """`resolve_limits` with this machine's environment, kernel release and page size: the
    limits every entry point that touches the machine plans with, and the source of each cap."""
    env = os.environ if env is None else env
    release = probe_kernel_release(root=root)
    return resolve_limits(
        env=env, chunk_limit_bytes=chunk_limit_bytes, kernel_release=kernel_release,
        hugepage_bytes=hugepage_bytes, machine_kernel_release=release,
        os_page_bytes=os_page_bytes(), flag_names=flag_names,
    )


def probe_limits(*, env=None, root: str = "/", chunk_limit_bytes: int | None = None) -> Limits:
    """`Limits` for this machine: environment overrides, else the kernel's and driver's caps.

    ``chunk_limit_bytes`` (an explicit argument) beats ``HICACHE_REGISTER_CHUNK``, which beats
    the 64 GiB default. Raises ``EnvError`` naming a variable whose value cannot be read.
    """
    return probe_resolved_limits(env=env, root=root, chunk_limit_bytes=chunk_limit_bytes).limits


@attrs.frozen
class CudaFacts:
    """CUDA as cuda-python sees it, probed without creating a context."""

    available: bool
    driver_version: int | None
    runtime_version: int | None
    device_count: int
    error: str | None


def probe_cuda(binding=None) -> CudaFacts:
    """Driver/runtime versions and device count; ``available`` False with the reason."""
    try:
        if binding is None:
            binding = default_binding()
    except Exception as error:  # an unusable cuda-python install is a finding, not a crash
        return CudaFacts(False, None, None, 0, f"cuda-python cannot be imported: {error}")

    def ask(name):
        try:
            status, value = getattr(binding, name)()
        except Exception as error:
            return None, f"{name}: {error}"
        if int(status) != 0:
            return None, f"{name} returned {getattr(status, 'name', status)} ({int(status)})"
        return int(value), None

    driver, driver_error = ask("cudaDriverGetVersion")
    runtime_version, _ = ask("cudaRuntimeGetVersion")
    count, count_error = ask("cudaGetDeviceCount")
    error = count_error or driver_error
    if not driver:
        error = "no CUDA driver found (driver version 0)" + (f"; {count_error}" if count_error else "")
    available = bool(driver) and bool(count)
    return CudaFacts(available, driver or None, runtime_version, count or 0, None if available else error)


@attrs.frozen
class GpuFacts:
    """One CUDA device: its index, PCI bus id and the NUMA node its host memory is closest to
    (None where the platform does not say)."""

    index: int
    pci_bus_id: str | None
    numa_node: int | None


def probe_gpus(binding=None, *, root: str = "/") -> tuple[GpuFacts, ...]:
    """Each CUDA device's PCI bus id and NUMA node (``/sys/bus/pci/devices/<id>/numa_node``);
    empty when CUDA is unavailable."""
    facts = probe_cuda(binding)
    if not facts.available:
        return ()
    binding = default_binding() if binding is None else binding
    gpus = []
    for index in range(facts.device_count):
        bus = None
        try:
            result = binding.cudaDeviceGetPCIBusId(64, index)
            if int(result[0]) == 0:
                raw = result[1]
                bus = (raw.decode() if isinstance(raw, bytes) else str(raw)).strip("\x00").strip().lower()
        except Exception:  # an old binding or driver: the bus id is a finding, not a crash
            bus = None
        node = None
        if bus:
            text = _read(root, f"/sys/bus/pci/devices/{bus}/numa_node")
            if text is not None and re.fullmatch(r"-?\d+", text) and int(text) >= 0:
                node = int(text)
        gpus.append(GpuFacts(index, bus, node))
    return tuple(gpus)


def package_version(name: str) -> str | None:
    """The installed version of a distribution (never imports it: torch stays unloaded)."""
    from importlib import metadata

    try:
        return metadata.version(name)
    except metadata.PackageNotFoundError:
        return None


def resolve_numa_node(numa, *, cuda_binding=None, root: str = "/") -> tuple[int | None, str | None]:
    """``numa`` ("auto", "off", None or a node number) -> (node or None, a note when auto
    cannot be honoured). A node that is not online is a PlanError naming the online ones."""
    if numa is None or numa == "off":
        return None, None
    if numa == "auto":
        if len(online_nodes(root=root)) == 1:
            return None, None  # one node: nothing to choose, nothing to probe
        gpus = probe_gpus(cuda_binding, root=root)
        device = _current_device()
        gpu = next((g for g in gpus if g.index == device), None)
        if gpu is None or gpu.numa_node is None:
            return None, "NUMA placement auto: no CUDA device with a known NUMA node; memory is not bound"
        allowed = allowed_nodes(root=root)
        if gpu.numa_node not in allowed:  # binding there would fail (EINVAL) or fight the cpuset
            return None, (f"NUMA placement auto: the GPU's node {gpu.numa_node} is outside this process's "
                          f"cpuset (mems {','.join(map(str, allowed))}); memory is not bound")
        if gpu.numa_node in memory_only_nodes(root=root):
            return None, (f"NUMA placement auto: the GPU's node {gpu.numa_node} has no CPUs (memory-only); "
                          "memory is not bound (pass the node explicitly to bind there)")
        return gpu.numa_node, None
    try:
        node = int(numa)
    except (TypeError, ValueError):
        raise PlanError(f"numa_node must be 'auto', 'off' or a node number, got {numa!r}") from None
    nodes = online_nodes(root=root)
    if node not in nodes:
        raise PlanError(f"numa_node {node} is not online; online nodes: {', '.join(map(str, nodes))}")
    allowed = allowed_nodes(root=root)
    if node not in allowed:
        raise PlanError(f"numa_node {node} is outside this process's cpuset; it may use nodes "
                        f"{', '.join(map(str, allowed))}")
    if node in memory_only_nodes(root=root):
        return node, f"numa_node {node} has no CPUs (memory-only): bound there as asked"
    return node, None


def _current_device() -> int:
    try:
        import torch

        if torch.cuda.is_available() and torch.cuda.is_initialized():
            return torch.cuda.current_device()
    except Exception:  # no torch, no CUDA: device 0 is what a process starts on
        pass
    return 0
