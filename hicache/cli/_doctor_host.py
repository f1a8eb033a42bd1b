"""`hicache doctor`'s rules about the machine: the kernel's pin cap, the caps it plans with, huge
pages, what the pools will do, memlock, mappings, memory, NUMA, the host copy path, the page
allocator, versions, the CUDA binding, GPUs and CUDA itself. Each reads the `Context` and returns one `Check`.
"""

from __future__ import annotations

import os

from hicache.plan import assess_budget, format_bytes
from hicache.plan.thp import THP_USABLE, size_taken

from hicache.cli._doctor_context import Check, Context


def _kernel(c: Context) -> Check:
    cap = c.facts.kernel_pin_cap_bytes
    if cap is None:
        return Check("kernel", "pass", f"Linux {c.facts.kernel_release}: no per-pin cap")
    if c.plan is not None and c.largest > cap:
        return Check("kernel", "fail",
                     f"Linux {c.facts.kernel_release} pins at most {format_bytes(cap)} per call; the plan's largest call is {format_bytes(c.largest)}",
                     f"re-plan with --kernel-release {c.facts.kernel_release} (or HICACHE_KERNEL_PIN_CAP)")
    return Check("kernel", "warn", f"Linux {c.facts.kernel_release} pins at most {format_bytes(cap)} per call",
                 "hicache apply and the pools keep calls under it; for saved plans use --kernel-release")


def _limits(c: Context) -> Check:
    from hicache.plan import EnvError

    if isinstance(c.resolved, EnvError):
        return Check("limits", "fail", str(c.resolved), "fix or unset the HICACHE_* variable it names")
    limits, sources = c.resolved.limits, c.resolved.sources
    parts = [f"chunk limit {format_bytes(limits.chunk_limit_bytes)} ({sources['chunk_limit']})",
             f"driver ceiling {format_bytes(limits.hard_ceiling_bytes)} ({sources['driver_ceiling']})"]
    cap = limits.kernel_cap_bytes
    parts.append(f"kernel cap {format_bytes(cap) if cap else 'none'} ({sources['kernel_cap']})")
    call = limits.call_cap_bytes
    parts.append(f"call cap {format_bytes(call) if call else 'none'} ({sources.get('call_cap', 'default')})")
    if limits.hugepage_bytes:
        parts.append(f"hugepage {format_bytes(limits.hugepage_bytes)} ({sources['hugepage']})")
    finding = "this machine plans with " + ", ".join(parts)
    if c.plan is not None and c.largest > limits.hard_cap_bytes:  # what `apply --plan` refuses
        return Check("limits", "fail", finding + f"; the saved plan's largest call is {format_bytes(c.largest)}, over "
                     f"this machine's {format_bytes(limits.hard_cap_bytes)} cap: hicache apply --plan refuses it",
                     "re-plan on this machine (hicache apply without --plan does)")
    if c.plan is not None and c.largest > limits.effective_cap_bytes:
        return Check("limits", "warn", finding + f"; the saved plan's largest call is {format_bytes(c.largest)}, over "
                     "the chunk limit (the machine accepts it)", "re-plan on this machine (hicache apply without --plan does)")
    planned_page = getattr(c.limits, "os_page_bytes", None)
    if c.plan is not None and planned_page and planned_page < c.facts.os_page_bytes:
        # its boundaries keep whole copy units but may cut this machine's pages: two registrations
        # on one page are what drivers accept today, not what the plan promises (cuda-host-registration)
        return Check("limits", "warn", finding + f"; the saved plan was made for {format_bytes(planned_page)} pages, "
                     f"this machine's are {format_bytes(c.facts.os_page_bytes)}: its boundaries are not aligned to them",
                     "re-plan on this machine (hicache apply without --plan does)")
    return Check("limits", "pass", finding)


def _thp(c: Context) -> Check:
    size = _odd_thp_size(c.facts)
    sized = f", {format_bytes(size)} pages: auto keeps base pages here" if size else ""
    if c.facts.thp_enabled == "always":
        return Check("thp", "warn", f"transparent huge pages: always (defrag: {c.facts.thp_defrag}){sized}",
                     "compaction can stall any process's page faults; hicache's pools take THP only for pieces "
                     "free 2 MiB blocks cover (HICACHE_HUGEPAGES=auto, the default) and none with HICACHE_HUGEPAGES=off")
    return Check("thp", "pass", f"transparent huge pages: {c.facts.thp_enabled or 'unknown'}{sized}")


def _odd_thp_size(facts) -> int | None:
    """A transparent huge page's size where it is not the 2 MiB auto takes (512 MiB under 64 KiB
    base pages, the THP rule `thp-size`); None where it is 2 MiB or not said."""
    size = getattr(facts, "thp_page_bytes", None)
    return None if size_taken(size) else size


def _hugepages(c: Context) -> Check:
    pools_text = ", ".join(f"{format_bytes(p.size_bytes)}: {p.free}/{p.total} free" for p in c.facts.hugepages) or "none"
    hugepage = c.limits.hugepage_bytes if c.limits is not None else None
    if not hugepage:
        return Check("hugepages", "pass", f"reserved hugepages: {pools_text}")
    free, needed, hint = _hugepage_need(c, hugepage)
    if free < needed:
        return Check("hugepages", "fail", f"the plan needs {needed} pages of {format_bytes(hugepage)} for {c.ranks} rank(s), {free} free ({pools_text})",
                     hint)
    return Check("hugepages", "pass", f"{free} free pages of {format_bytes(hugepage)} cover {needed} needed")


def _hugepage_need(c: Context, size: int) -> tuple[int, int | None, str]:
    """Free reserved pages of ``size``, how many the plan needs for every rank (None without a
    plan), and the hint that reserves them."""
    pool = next((p for p in c.facts.hugepages if p.size_bytes == size), None)
    free = pool.free if pool else 0
    if c.plan is None:
        return free, None, "reserve them (hicache doctor --plan FILE says how many)"
    needed = -(-c.total // size) * c.ranks
    return free, needed, f"reserve them: echo {needed} > /sys/kernel/mm/hugepages/hugepages-{size // 1024}kB/nr_hugepages"


def _pools(c: Context) -> Check:
    """What host pools built here without hicache keywords (SGLang's call sites) will do."""
    from hicache.effects import pool_settings
    from hicache.plan import DEFAULT_HUGEPAGE_BYTES, HUGETLBFS_MODES
    from hicache.plan import EnvError
    try:
        settings = pool_settings(c.env)
    except EnvError as error:
        return Check("pools", "fail", str(error), "fix or unset the variable it names")
    mode = ("progressive (HICACHE_PROGRESSIVE): serving from the first registered page" if settings.progressive
            else "registered all at construction (HICACHE_PROGRESSIVE unset)")
    pages = _pages_said(settings.hugepages, c.facts.thp_enabled, _odd_thp_size(c.facts))
    said = (f"HICACHE_HUGEPAGES={settings.hugepages}" if (c.env or {}).get("HICACHE_HUGEPAGES")
            else "HICACHE_HUGEPAGES unset")
    finding = f"host pools: {mode}; {pages} ({said})"
    if settings.hugepages == "thp" and c.facts.thp_enabled not in THP_USABLE:
        return Check("pools", "warn", finding + f", but transparent huge pages are {c.facts.thp_enabled or 'unreadable'} "
                     "here: the pools get 4 KiB pages", "echo madvise > /sys/kernel/mm/transparent_hugepage/enabled, "
                     "or leave HICACHE_HUGEPAGES unset (auto takes THP where it is enabled and free)")
    if settings.hugepages not in HUGETLBFS_MODES:
        return Check("pools", "pass", finding)
    size = (c.limits.hugepage_bytes if c.limits is not None else None) or DEFAULT_HUGEPAGE_BYTES
    free, needed, hint = _hugepage_need(c, size)
    if free and needed is None:  # how many it needs is the plan's to say
        return Check("pools", "pass", finding + f"; {free} free pages of {format_bytes(size)}")
    if needed is not None and free >= needed:
        return Check("pools", "pass", finding + f"; {free} free pages of {format_bytes(size)} cover {needed}")
    short = (f"; no free pages of {format_bytes(size)} reserved" if needed is None
             else f"; {free} free pages of {format_bytes(size)}, {needed} needed")
    if settings.hugepages == "required":
        return Check("pools", "fail", finding + short, hint)
    return Check("pools", "warn", finding + short + ": the pools fall back to 4 KiB pages", hint)


def _pages_said(mode: str, thp_enabled: str | None, odd_size: int | None = None) -> str:
    """What the pools' page setting ``mode`` gives on a machine whose THP setting is ``thp_enabled``
    (``odd_size``: its huge pages' size where it is not 2 MiB)."""
    if mode == "auto":
        if thp_enabled not in THP_USABLE:
            return f"auto: 4 KiB pages here (transparent huge pages: {thp_enabled or 'unreadable'})"
        if odd_size:
            return (f"auto: base pages here (transparent huge pages are {format_bytes(odd_size)} here; auto takes "
                    "only 2 MiB ones)")
        return ("auto: transparent huge pages for each pre-fault piece the free 2 MiB blocks cover, else 4 KiB "
                "pages, and 4 KiB pages for the rest once THP faults in slower")
    return {"off": "4 KiB pages", "thp": "transparent huge pages"}.get(mode, f"hugetlbfs pages ({mode})")


def _buddyinfo(c: Context) -> Check:
    """Before a THP run: enough free contiguous 2 MiB blocks for every rank's pool, or THP falls
    back to 4 KiB pages mid-pre-fault (a 2-5x cliff) or stalls compacting; under `auto` (the
    default), how much of the pool they let take THP - the rest is 4 KiB pages by design."""
    from hicache.effects import pool_settings
    from hicache.plan import EnvError
    blocks = c.facts.free_2mib_blocks
    try:
        mode = pool_settings(c.env).hugepages
    except EnvError:
        mode = None  # the pools rule names the bad variable
    if blocks is None:
        return Check("buddyinfo", "pass", "free 2 MiB blocks: unknown (/proc/buddyinfo unreadable)")
    finding = f"{blocks:,} free 2 MiB blocks ({format_bytes(blocks * 2 * 2**20)}, /proc/buddyinfo)"
    huge = mode == "thp" or (mode == "auto" and c.facts.thp_enabled in THP_USABLE and not _odd_thp_size(c.facts))
    if not huge or c.plan is None:
        return Check("buddyinfo", "pass", finding)
    needed = -(-c.total // (2 * 2**20)) * c.ranks
    if blocks >= needed:
        return Check("buddyinfo", "pass", finding + f" cover the pool's {needed:,} for {c.ranks} rank(s)")
    if mode == "auto":
        return Check("buddyinfo", "pass", finding + f" cover {blocks:,} of the pool's {needed:,} for {c.ranks} "
                     "rank(s): auto keeps the rest on 4 KiB pages")
    return Check("buddyinfo", "warn", finding + f" for a THP pool needing {needed:,} for {c.ranks} rank(s): the rest "
                 "falls back to 4 KiB pages or waits on compaction",
                 "compact first (echo 1 > /proc/sys/vm/compact_memory), reserve hugetlbfs pages at boot, or use "
                 "HICACHE_HUGEPAGES=auto (THP only where free blocks cover a piece)")


def _memlock(c: Context) -> Check:
    memlock = c.facts.memlock_soft
    text = "unlimited" if memlock is None else format_bytes(memlock)
    if memlock is not None and c.plan is not None and memlock < c.total:
        return Check("memlock", "warn", f"RLIMIT_MEMLOCK {text} is below the plan's {format_bytes(c.total)}",
                     "cudaHostRegister pins through the driver, but RDMA registration of the same memory (Mooncake, NIXL) counts against it: ulimit -l unlimited")
    return Check("memlock", "pass", f"RLIMIT_MEMLOCK {text}")


def _max_map_count(c: Context) -> Check:
    if c.facts.max_map_count is None or c.plan is None:
        return Check("max_map_count", "pass", f"vm.max_map_count {c.facts.max_map_count}")
    need = 2 * c.calls * c.ranks  # a registration can split a mapping; be generous
    status = "fail" if need > c.facts.max_map_count else "pass"
    return Check("max_map_count", status, f"vm.max_map_count {c.facts.max_map_count:,}; the plan needs about {need:,} mappings for {c.ranks} rank(s)",
                 "" if status == "pass" else "raise vm.max_map_count or --chunk-limit")


def _memory(c: Context) -> Check:
    f = c.facts
    text = f"{format_bytes(f.available_bytes)} available of {format_bytes(f.total_bytes)}"
    if f.cgroup_limit_bytes is not None:
        text += f"; cgroup limit {format_bytes(f.cgroup_limit_bytes)}"
    room = getattr(f, "commit_room_bytes", None)
    if room is not None:
        text += f"; strict overcommit (vm.overcommit_memory=2): {format_bytes(room)} left to commit"
    if c.plan is None:
        return Check("memory", "pass", text)
    if room is not None and c.total * c.ranks > room:
        return Check("memory", "fail", text + f", the plan maps {format_bytes(c.total * c.ranks)} for {c.ranks} "
                     "rank(s): its mmap is refused however much memory is free",
                     "vm.overcommit_memory=0 (the default), or raise vm.overcommit_ratio / vm.overcommit_kbytes")
    verdict = assess_budget(c.total, available_bytes=f.available_bytes, ranks_per_host=c.ranks,
                            cgroup_limit_bytes=f.cgroup_limit_bytes, cgroup_usage_bytes=f.cgroup_usage_bytes or 0)
    return Check("memory", "pass" if verdict.ok else "fail", f"{text}; {verdict.explain(binary=True)}",
                 "" if verdict.ok else "lower --host-gb or the ranks per host")


def _numa(c: Context) -> Check:
    from hicache.effects import for_cli

    numa = c.facts.numa_nodes
    allowed = tuple(c.facts.numa_allowed_nodes)
    memory_only = set(c.facts.numa_memory_only_nodes)
    free = for_cli.node_free_bytes(root=c.root)  # the nodes this process may use
    detail = "; free: " + ", ".join(
        f"node {n} {format_bytes(b)}" + (" (memory-only: no CPUs)" if n in memory_only else "")
        for n, b in sorted(free.items())) if free else ""
    if allowed and len(allowed) < numa:
        detail += f"; this process may use node(s) {','.join(map(str, allowed))} only (its cpuset)"
    detail += "; " + _fault_shares(c, for_cli)
    return Check("numa", "pass", f"{numa} NUMA node(s){detail}",
                 "" if numa == 1 else "pools bind to their GPU's node by default (numa_node / --numa auto), "
                 "within this process's cpuset and never to a memory-only node unless asked")


def _fault_shares(c: Context, for_cli) -> str:
    """Where each rank's pre-fault runs (`fault_share`, what the bring-up uses): threads per rank
    on each node with CPUs, or unpinned on this process's CPUs."""
    pairs = tuple(c.facts.numa_node_cpus)
    cpus = tuple(c.facts.cpus) or tuple(range(os.cpu_count() or 1))
    homes = [node for node, node_cpus in pairs if node_cpus]
    if len(homes) > 1:
        shares = [for_cli.fault_share(node, node_cpus=pairs, all_cpus=cpus, ranks_per_host=c.ranks) for node in homes]
        return ("pre-fault: " + ", ".join(f"node {s.node} {s.threads} thread(s) per rank on its CPUs" for s in shares)
                + f" ({shares[0].ranks_on_node} of the {c.ranks} rank(s) per node)")
    share = for_cli.fault_share(None, node_cpus=pairs, all_cpus=cpus, ranks_per_host=c.ranks)
    return f"pre-fault: {share.threads} thread(s) per rank, {c.ranks} rank(s) sharing {len(cpus)} CPU(s)"


def _host_copy(c: Context) -> Check:
    return host_copy_check(c.env)


def host_copy_check(env) -> Check:
    """Whether host<->host page copies run through the native helper (see effects/_copy)."""
    from hicache.effects import for_cli
    from hicache.errors import EnvError

    try:
        info = for_cli.host_copy_info(env)
    except EnvError as error:
        return Check("host_copy", "fail", str(error), "unset HICACHE_HOST_COPY or set it to auto")
    if info.mode == "native":
        return Check("host_copy", "pass", f"native batched host copies, up to {info.threads} thread(s)")
    if info.asked == "python":
        built = "" if info.native_built else " (the native helper is not built either)"
        return Check("host_copy", "pass", f"ctypes memmove copies, as {info.env_var} asks{built}")
    if not info.native_built:
        return Check("host_copy", "warn", "native copy helper not built: CPU page copies use ctypes memmove (slower)",
                     "reinstall hicache where a C compiler (gcc/cc) is available")
    return Check("host_copy", "pass", f"ctypes memmove copies ({info.env_var})")


def _page_allocator(c: Context, *, installed=None) -> Check:
    """Which page allocator the host pools built here take (``installed``: name -> whether it imports)."""
    import importlib.util

    said = "host pools' page allocator: "
    if not (installed or (lambda name: importlib.util.find_spec(name) is not None))("torch"):
        return Check("page_allocator", "pass", said + "none yet - the pools need torch, which is not installed "
                     "(pip install \"hicache[cuda]\")")
    from hicache.pools import PageAllocator

    if PageAllocator(1, 1).native:  # what every pool built here takes by default
        return Check("page_allocator", "pass", said + "the C helper (a free-page stack, one call per alloc or free)")
    return Check("page_allocator", "warn", said + "the torch fallback - the C helper is not built (frees are merged by "
                 "torch operations, slower as a pool fills)", "reinstall hicache where a C compiler (gcc/cc) is available")


def _transfer(c: Context) -> Check:
    return transfer_check(c.env, cuda=_cuda_facts(c))


def transfer_check(env, *, cuda=None, warm=None, installed=None) -> Check:
    """Which engine the pools' host<->GPU transfers take, by layout and direction (the engine
    table, hicache.plan._transfer, for a Llama-8B-like page: 2 KiB rows, 128 KiB page runs), and
    what runs the gather: on a GPU (``cuda``: `probe_cuda`'s facts) the kernel is built and
    launched on device 0 as a pool's build does (``warm(device, word)``: the reason it cannot,
    or None), so a Triton that cannot build for this GPU shows here, not as slower transfers.
    ``installed(name)``: whether a package imports (find_spec by default)."""
    import importlib.util

    from hicache.errors import EnvError
    from hicache.plan.settings import env_value
    from hicache.plan.transfer import DEFAULT_PROGRAMS, choose_engine

    try:
        setting = env_value(env, "HICACHE_TRANSFER") or "auto"
        programs = env_value(env, "HICACHE_TRANSFER_PROGRAMS") or DEFAULT_PROGRAMS
    except EnvError as error:
        return Check("transfer", "fail", str(error), "unset HICACHE_TRANSFER / HICACHE_TRANSFER_PROGRAMS")
    if installed is None:
        installed = lambda name: importlib.util.find_spec(name) is not None  # noqa: E731
    triton = installed("triton")
    pieces = {"page_first": 2048, "layer_first": 128 * 2**10, "page_first_direct": 128 * 2**10}
    picks = "; ".join(
        f"{layout} load {choose_engine('load', piece, on_gpu=True, setting=setting).engine}, backup "
        f"{choose_engine('backup', piece, on_gpu=True, setting=setting).engine}" for layout, piece in pieces.items())
    how = (f"Triton, {programs} programs at most" if triton else "torch's index kernels (Triton is not installed)"
           if installed("torch") else "nothing yet: torch is not installed (pip install \"hicache[cuda]\")")
    reason = None
    if triton and setting != "dma" and cuda is not None and cuda.available:
        if warm is None:
            from hicache.effects import for_cli

            warm = for_cli.warm_gather_kernel
        reason = warm("cuda:0", 8)
        how = (f"Triton, {programs} programs at most (built and launched on cuda:0)" if reason is None else
               f"torch's index kernels: Triton's kernel does not run on cuda:0 ({reason})")
    detail = f"HICACHE_TRANSFER={setting}: {picks}; the gather runs through {how} (page_head: a piece per head, by the same rules)"
    if reason is not None:
        return Check("transfer", "warn", detail, "install the Triton your torch pins (pip show torch), or HICACHE_TRANSFER=dma")
    return Check("transfer", "pass", detail)


def _versions(c: Context) -> Check:
    import platform

    from hicache import __version__
    from hicache.effects import package_version

    torch = package_version("torch")
    binding = package_version("cuda-bindings") or package_version("cuda-python")
    cuda = _cuda_facts(c)
    driver = f"{cuda.driver_version // 1000}.{cuda.driver_version % 1000 // 10}" if cuda.driver_version else "none"
    finding = (f"hicache {__version__}, python {platform.python_version()}, torch {torch or 'not installed'}, "
               f"cuda-bindings {binding or 'not installed'}, CUDA driver {driver}")
    if torch is None or binding is None:
        return Check("versions", "warn", finding, 'pip install "hicache[cuda]" for apply, pools and compat')
    return Check("versions", "pass", finding)


def _binding(c: Context) -> Check:
    """cuda-bindings follows the driver's CUDA major version: 13.x needs an r580+ driver."""
    from hicache.effects import package_version

    binding = package_version("cuda-bindings")
    cuda = _cuda_facts(c)
    if binding is None and package_version("cuda-python") is None:
        return Check("binding", "fail", "cuda-bindings is not installed: hicache cannot call CUDA",
                     'pip install "hicache[cuda]"')
    if binding is None or not cuda.driver_version:
        return Check("binding", "pass", f"cuda-bindings {binding or '(cuda-python)'}; no driver to match")
    major, driver_major = int(binding.split(".")[0]), cuda.driver_version // 1000
    if major > driver_major:
        return Check("binding", "fail", f"cuda-bindings {binding} needs a CUDA {major} driver; this one is CUDA {driver_major}",
                     f'pip install "cuda-bindings>={driver_major}.0,<{driver_major + 1}"')
    return Check("binding", "pass", f"cuda-bindings {binding} fits the CUDA {driver_major} driver")


def _gpus(c: Context) -> Check:
    from hicache.effects import for_cli

    gpus = for_cli.probe_gpus(c.cuda_binding, root=c.root)
    if not gpus:
        return Check("gpus", "pass", "no CUDA device visible")
    nodes = ", ".join(f"GPU {g.index} ({g.pci_bus_id or 'bus unknown'}) -> NUMA node "
                      f"{g.numa_node if g.numa_node is not None else 'unknown'}" for g in gpus)
    return Check("gpus", "pass", nodes)


def _cuda_facts(c: Context):
    from hicache.effects import probe_cuda

    return probe_cuda(c.cuda_binding)


def _cuda(c: Context) -> Check:
    from hicache.effects import probe_cuda

    cuda = probe_cuda(c.cuda_binding)
    if cuda.available:
        return Check("cuda", "pass", f"driver {cuda.driver_version}, runtime {cuda.runtime_version}, {cuda.device_count} device(s)")
    from hicache.effects import package_version

    if package_version("cuda-bindings") is None and package_version("cuda-python") is None:  # not the driver
        return Check("cuda", "fail", f"CUDA unavailable: {cuda.error}", 'pip install "hicache[cuda]"')
    return Check("cuda", "fail", f"CUDA unavailable: {cuda.error}", "install the NVIDIA driver or run on a GPU node")
