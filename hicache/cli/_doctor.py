"""`hicache doctor`: what this machine will do to a plan, as a table of rules.

Each rule reads one `Context` (the plan, if any, the machine's facts, the caps this machine
resolves with their sources, CUDA) and returns one `Check` (pass / warn / fail, a hint).
Loaded only by `doctor`; it imports hicache.effects when it runs.
"""

from __future__ import annotations

import json
import sys

import attrs

from hicache.cli._saved import load_plan, pool_plans
from hicache.plan import CapacityPlan, assess_budget, format_bytes

DESCRIPTION = (
    "Check this machine against a saved plan (or in general): kernel pin cap, the caps this "
    "machine plans with and where each comes from, hugepages, what host pools will do "
    "(HICACHE_PROGRESSIVE, HICACHE_HUGEPAGES), memlock, mappings, memory budget, "
    "NUMA, the host copy path, CUDA, the SGLang plug-in and room for a node store (--store: an arena). "
    "Exit 1 when a check fails. "
    "Example: hicache doctor --plan plan.json"
)


@attrs.frozen
class Check:
    """One doctor finding."""

    name: str
    status: str  # pass | warn | fail
    finding: str
    hint: str = ""


@attrs.frozen
class Context:
    """Everything the rules read."""

    plan: object
    facts: object
    resolved: object  # ResolvedLimits of this machine, or an EnvError
    env: object
    cuda_binding: object
    total: int
    calls: int
    largest: int
    ranks: int
    limits: object  # the plan's Limits, or None
    root: str = "/"
    store: str | None = None  # a node store arena to check (--store)


def _environment(c: Context) -> list[Check]:
    """Every HICACHE_* variable of the one table (hicache/plan/_env.py), as the bring-ups will
    read it: one FAIL line per bad value, named by the variable; a set HICACHE_* variable the
    table does not know is a warning (a typo reads as unset)."""
    from hicache.effects import environment_problems
    from hicache.plan._env import SETTINGS, unknown_variables

    problems = environment_problems(c.env)
    unknown = unknown_variables(c.env)
    given = [s.name for s in SETTINGS if (c.env.get(s.name) or "").strip()]
    bad = {p.name for p in problems}
    checks = [Check(p.name, "fail", p.reason, f"fix or unset {p.name} (docs/environment.md: what it takes)")
              for p in problems]
    finding = (f"{len(SETTINGS)} HICACHE_* settings known; set: "
               + (", ".join(f"{n}={c.env[n]!r}" for n in given) if given else "none"))
    if unknown:
        finding += f"; unknown: {', '.join(unknown)} (read as unset)"
    if problems:
        return [Check("environment", "fail", finding + f"; {len(bad)} cannot be used (below)",
                      "fix or unset each variable named below")] + checks
    if unknown:
        return [Check("environment", "warn", finding,
                      "check the spelling against docs/environment.md")]
    return [Check("environment", "pass", finding + "; all valid")]


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
    return Check("limits", "pass", finding)


def _thp(c: Context) -> Check:
    if c.facts.thp_enabled == "always":
        return Check("thp", "warn", f"transparent huge pages: always (defrag: {c.facts.thp_defrag})",
                     "compaction can stall pre-fault; hicache's mappings opt out unless asked")
    return Check("thp", "pass", f"transparent huge pages: {c.facts.thp_enabled or 'unknown'}")


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
    pages = {"off": "4 KiB pages", "thp": "transparent huge pages"}.get(settings.hugepages,
                                                                          f"hugetlbfs pages ({settings.hugepages})")
    said = (f"HICACHE_HUGEPAGES={settings.hugepages}" if (c.env or {}).get("HICACHE_HUGEPAGES")
            else "HICACHE_HUGEPAGES unset")
    finding = f"host pools: {mode}; {pages} ({said})"
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


def _buddyinfo(c: Context) -> Check:
    """Before a THP run: enough free contiguous 2 MiB blocks for the pool, or THP falls back to
    4 KiB pages mid-pre-fault (a 2-5x cliff) or stalls compacting."""
    from hicache.effects import pool_settings
    from hicache.plan import EnvError

    blocks = c.facts.free_2mib_blocks
    try:
        thp = pool_settings(c.env).hugepages == "thp"
    except EnvError:
        thp = False  # the pools rule names the bad variable
    if blocks is None:
        return Check("buddyinfo", "pass", "free 2 MiB blocks: unknown (/proc/buddyinfo unreadable)")
    finding = f"{blocks:,} free 2 MiB blocks ({format_bytes(blocks * 2 * 2**20)}, /proc/buddyinfo)"
    if not thp or c.plan is None:
        return Check("buddyinfo", "pass", finding)
    needed = -(-c.total // (2 * 2**20))
    if blocks >= needed:
        return Check("buddyinfo", "pass", finding + f" cover the pool's {needed:,}")
    return Check("buddyinfo", "warn", finding + f" for a THP pool needing {needed:,}: the rest falls back to 4 KiB "
                 "pages or waits on compaction",
                 "compact first (echo 1 > /proc/sys/vm/compact_memory), reserve hugetlbfs pages at boot, or use 4 KiB pages")


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
    if c.plan is None:
        return Check("memory", "pass", text)
    verdict = assess_budget(c.total, available_bytes=f.available_bytes, ranks_per_host=c.ranks,
                            cgroup_limit_bytes=f.cgroup_limit_bytes, cgroup_usage_bytes=f.cgroup_usage_bytes or 0)
    return Check("memory", "pass" if verdict.ok else "fail", f"{text}; {verdict.explain(binary=True)}",
                 "" if verdict.ok else "lower --host-gb or the ranks per host")


def _numa(c: Context) -> Check:
    from hicache.effects import node_free_bytes

    numa = c.facts.numa_nodes
    allowed = tuple(c.facts.numa_allowed_nodes)
    memory_only = set(c.facts.numa_memory_only_nodes)
    free = node_free_bytes(root=c.root)  # the nodes this process may use
    detail = "; free: " + ", ".join(
        f"node {n} {format_bytes(b)}" + (" (memory-only: no CPUs)" if n in memory_only else "")
        for n, b in sorted(free.items())) if free else ""
    if allowed and len(allowed) < numa:
        detail += f"; this process may use node(s) {','.join(map(str, allowed))} only (its cpuset)"
    return Check("numa", "pass", f"{numa} NUMA node(s){detail}",
                 "" if numa == 1 else "pools bind to their GPU's node by default (numa_node / --numa auto), "
                 "within this process's cpuset and never to a memory-only node unless asked")


def _host_copy(c: Context) -> Check:
    return host_copy_check(c.env)


def host_copy_check(env) -> Check:
    """Whether host<->host page copies run through the native helper (see effects/_copy)."""
    from hicache.effects import host_copy_info
    from hicache.errors import EnvError

    try:
        info = host_copy_info(env)
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
    from hicache.effects import probe_gpus

    gpus = probe_gpus(c.cuda_binding, root=c.root)
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


def _sglang(c: Context) -> Check:
    """Whether SGLang is installed, and whether hicache's plug-in will load in its processes."""
    from hicache.compat import sglang_plugin
    from hicache.effects import sglang_plugin_enabled
    from hicache.errors import EnvError

    replaces = ", ".join(target.rsplit(".", 1)[1] for target in sglang_plugin.TARGETS)
    try:
        enabled = sglang_plugin_enabled(c.env)
    except EnvError as error:
        return Check("sglang", "fail", str(error), "HICACHE_SGLANG=on or off")
    version = sglang_plugin.sglang_version()
    if version is None:
        return Check("sglang", "pass", "SGLang is not installed: the plug-in has nothing to load into")
    low, high = (".".join(map(str, v)) for v in sglang_plugin.TESTED_RANGE)
    if "hicache" not in sglang_plugin.entry_point_names():
        return Check("sglang", "fail", f"SGLang {version}: hicache's entry point is not in group sglang.srt.plugins",
                     'reinstall hicache in this environment: pip install "hicache[cuda]"')
    if not sglang_plugin.admitted(c.env):
        return Check("sglang", "warn", f"SGLang {version}: SGLANG_PLUGINS={c.env.get('SGLANG_PLUGINS')!r} leaves "
                     "hicache out: SGLang's own registration stays", "add hicache to SGLANG_PLUGINS")
    if not enabled:
        return Check("sglang", "warn", f"SGLang {version}: HICACHE_SGLANG=off: SGLang's own registration stays",
                     "unset HICACHE_SGLANG to let hicache register host pools")
    if not sglang_plugin.supported(version):
        return Check("sglang", "warn", f"SGLang {version} is outside the tested range (>={low}, <{high}): the plug-in "
                     "patches nothing", f"run SGLang {low}, or hicache's drop-in helpers (docs/sglang.md)")
    return Check("sglang", "pass", f"SGLang {version}: the hicache plug-in loads in every SGLang process and "
                 f"replaces {replaces}")


SHM = "/dev/shm"
SHM_SMALL_BYTES = 10**9  # Docker's default /dev/shm is 64 MB: a node store needs GBs


def _store_room(c: Context) -> Check:
    """Room for a node store: /dev/shm's tmpfs and every hugetlbfs mount with its free pages."""
    from hicache.effects import arena
    from hicache.errors import ArenaError

    parts, status, hint = [], "pass", ""
    try:
        shm = arena.backing_of(f"{SHM}/arena", root=c.root)  # a file there: its directory is /dev/shm
        parts.append(f"{SHM} ({shm.kind}) {format_bytes(shm.free_bytes)} free")
        if shm.free_bytes < SHM_SMALL_BYTES:
            status, hint = "warn", "a container's /dev/shm is 64 MB by default: docker run --shm-size=64g (docs/store.md)"
    except ArenaError as error:
        status, hint = "warn", "node store arenas go on tmpfs or hugetlbfs (docs/store.md)"
        parts.append(str(error).split(": ", 1)[-1])
    try:
        huge = [m for m in arena.mounts(root=c.root) if m.fstype == "hugetlbfs"]
    except OSError:
        huge = []
    for mount in huge:
        try:
            room = arena.backing_of(f"{mount.point}/arena", root=c.root).free_bytes
            parts.append(f"hugetlbfs {mount.point} ({format_bytes(mount.pagesize_bytes or 2**21)} pages) "
                         f"{format_bytes(room)} free")
        except (ArenaError, OSError):
            parts.append(f"hugetlbfs {mount.point} (not readable)")
    return Check("store_room", status, "; ".join(parts) or "no tmpfs or hugetlbfs found", hint)


def _store(c: Context) -> Check:
    """The arena `--store PATH` names: its geometry, pages held and torn slots (nothing changed)."""
    if c.store is None:
        return Check("store", "pass", "no arena given (--store PATH checks one)")
    from hicache.effects import arena
    from hicache.errors import ArenaError
    from hicache.store import SlotIndex

    try:
        attached = arena.attach_arena(c.store, root=c.root)
    except ArenaError as error:
        return Check("store", "fail", str(error), "hicache store create PATH makes one (docs/store.md)")
    try:
        census = SlotIndex(attached).census()
        plan = attached.plan
        finding = (f"{c.store}: {attached.backing.kind}, {plan.slots:,} slots of {plan.slot_bytes:,} bytes, "
                   f"{census.pages:,} pages held, {census.torn} torn")
        if census.torn:
            return Check("store", "warn", finding, "torn slots are a dead writer's: the next engine's attach reclaims them")
        return Check("store", "pass", finding)
    finally:
        attached.close()


#: The rules, in the order they print.
RULES = (_versions, _environment, _kernel, _limits, _thp, _hugepages, _pools, _buddyinfo, _memlock, _max_map_count, _memory, _numa, _host_copy,
         _cuda, _binding, _gpus, _sglang, _store_room, _store)


def doctor_checks(plan=None, *, root: str = "/", env=None, cuda_binding=None, facts=None,
                  store: str | None = None) -> list[Check]:
    """Every rule of `hicache doctor`, against ``plan`` when one is given. ``facts``: injected
    `MachineFacts` (default: probed under ``root``)."""
    import os

    from hicache.effects import probe_machine, probe_resolved_limits
    from hicache.plan import EnvError

    env = os.environ if env is None else env
    if facts is None:
        try:
            facts = probe_machine(root=root, env=env)
        except EnvError:  # a bad HICACHE_RANKS_PER_HOST: the environment rule's FAIL line names it
            facts = probe_machine(root=root, env={k: v for k, v in env.items() if k != "HICACHE_RANKS_PER_HOST"})
    try:
        resolved = probe_resolved_limits(env=env, root=root)
    except EnvError as error:
        resolved = error
    pools = pool_plans(plan) if plan is not None else []
    ranks = facts.ranks_per_host
    if isinstance(plan, CapacityPlan) and plan.ranks_per_host:
        ranks = plan.ranks_per_host
    context = Context(
        plan=plan, facts=facts, resolved=resolved, env=env, cuda_binding=cuda_binding,
        total=sum(p.total_bytes for _, p in pools), calls=sum(p.call_count for _, p in pools),
        largest=max((p.largest_call_bytes for _, p in pools), default=0), ranks=ranks,
        limits=pools[0][1].limits if pools else None, root=root, store=store,
    )
    checks = []
    for rule in RULES:
        found = rule(context)
        checks.extend(found if isinstance(found, list) else [found])
    return checks


def render_checks(checks: list[Check], fmt: str) -> str:
    if fmt == "json":
        return json.dumps({"schema": "hicache.doctor", "schema_version": 1,
                           "checks": [attrs.asdict(c) for c in checks]}, sort_keys=True, indent=2) + "\n"
    import textwrap

    width = max(len(c.name) for c in checks)
    indent = " " * (4 + 2 + width + 2)
    lines = []
    for c in checks:  # folded at 100 columns
        lines += textwrap.wrap(f"{c.status.upper():<4}  {c.name:<{width}}  {c.finding}", 100,
                               subsequent_indent=indent, break_on_hyphens=False)
        if c.hint:
            lines += textwrap.wrap(f"{indent}hint: {c.hint}", 100, subsequent_indent=indent + "  ",
                                   break_on_hyphens=False)
    return "\n".join(lines) + "\n"


def add_command(commands) -> None:
    doctor = commands.add_parser("doctor", help="what this machine will do to a plan", description=DESCRIPTION)
    doctor.add_argument("--plan", dest="plan_file", help="a saved JSON plan to check against this machine")
    doctor.add_argument("--format", choices=("table", "json"), default="table")
    doctor.add_argument("--store", help="a node store arena to check (its geometry, pages, torn slots)")


def run(args) -> int:
    plan = load_plan(args.plan_file) if args.plan_file else None
    checks = doctor_checks(plan, store=args.store)
    sys.stdout.write(render_checks(checks, args.format))
    return 1 if any(c.status == "fail" for c in checks) else 0
