"""`hicache apply`: bring a plan up for real through the one bring-up, hold it, release it.

Owns the command's sequence around `hicache.effects.bring_up` (CUDA check -> plan with this
machine's caps -> bring-up with a progress bar on stderr -> hold -> release) and its report.
Plans made here use `probe_resolved_limits`: the kernel cap of this machine, the HICACHE_*
settings and the flags (a flag wins). Loaded only by `apply`.
"""

from __future__ import annotations

import argparse
import json
import sys
import time

from hicache.cli._common import INFEASIBLE, USAGE, CliError, ascii_number, positive_int, size
from hicache.cli._plan_args import add_plan_arguments, build_plan, limits_from_args
from hicache.cli._progress import BringupProgress, wait_progressive
from hicache.cli._saved import load_plan, pool_plans
from hicache.errors import CudaUnavailableError, ReleaseError
from hicache.plan import CAPACITY_DEFAULTS, DEFAULT_RESERVE_BYTES, HUGEPAGE_MODES, format_bytes

DESCRIPTION = (
    "Allocate, pre-fault and register a plan on this machine, all or nothing, as the pools "
    "would (budget under the host-wide lock, one transaction), hold it, then release it. "
    "Plans with this machine's kernel cap and the HICACHE_* settings unless --plan is given, and reads "
    "the environment as the pools do (HICACHE_HUGEPAGES, HICACHE_PROGRESSIVE, HICACHE_HOST_COPY, "
    "HICACHE_RANKS_PER_HOST, ...: docs/environment.md; a bad value is an error before any memory); "
    "a flag beats its variable. "
    "Example: hicache apply --model llama-3.1-8b --host-gb 4 --hold 30"
)


def add_command(commands) -> None:
    apply = commands.add_parser("apply", help="allocate, pre-fault and register a plan for real", description=DESCRIPTION)
    add_plan_arguments(apply, budget_title="budget (instead of this machine's free memory and rank count)")
    apply.add_argument("--plan", dest="plan_file", help="a saved JSON plan (instead of plan arguments)")
    apply.add_argument("--hold", default="0", help="seconds to hold the registration, or inf: until Ctrl-C (default 0)")
    apply.add_argument("--hugepages", choices=HUGEPAGE_MODES,
                       help="auto: THP for each pre-fault piece the node's free 2 MiB blocks cover, braked off when "
                            "slower than 4 KiB pages (see README); off: 4 KiB pages; thp: transparent huge pages; "
                            "prefer/required: hugetlbfs pages of --hugepage-size (one the kernel offers: "
                            "/sys/kernel/mm/hugepages; prefer falls back to 4 KiB pages). Default: HICACHE_HUGEPAGES, "
                            "else auto")
    apply.add_argument("--threads", help="pre-fault threads (default: cores, at most 16)")
    apply.add_argument("--numa", default="auto",
                       help="bind the pool to a NUMA node: auto (the GPU's, where there are several), off, or N")
    apply.add_argument("--progressive", action=argparse.BooleanOptionalAction,
                       help="register call by call in the background (paced), report the time to the first call "
                            "(default: HICACHE_PROGRESSIVE, else off; --no-progressive overrides it)")
    apply.add_argument("--format", choices=("table", "json"), default="table")
    apply.add_argument("--trace", metavar="FILE",
                       help="write a Chrome trace-event JSON of the bring-up (Perfetto, chrome://tracing): phases, "
                            "pre-fault pieces, register calls and lock waits on the threads that ran them")
    apply.add_argument("--metrics-port", metavar="N",
                       help="serve Prometheus metrics of the bring-up on http://127.0.0.1:N/metrics while apply "
                            "runs (with --hold: while it holds); needs hicache[metrics]")
    apply.add_argument("--fake-cuda", action="store_true",
                       help="dry run on a machine without a GPU: the whole bring-up (memory mapped, pre-faulted, "
                            "budgeted, released) with CUDA stood in for by hicache.testing's fake driver - "
                            "nothing is pinned; same output")


#: the ``pool`` label of `hicache apply`'s bring-up in its metrics
_METRICS_POOL = "apply"


def _metrics_port(args) -> int | None:
    """--metrics-port: a TCP port (1-65535), checked - and hicache[metrics] there - before any memory."""
    if not getattr(args, "metrics_port", None):
        return None
    port = positive_int(args.metrics_port, "--metrics-port")
    from hicache import metrics

    if not metrics.available():
        raise CliError("missing-extra", "--metrics-port needs prometheus_client, which is not installed",
                       'pip install "hicache[metrics]"', USAGE)
    return port


def _serve_metrics(port: int | None):
    """The /metrics server on 127.0.0.1:port (None without --metrics-port); a port in use is an error."""
    if port is None:
        return None
    from hicache import metrics

    try:
        server, _ = metrics.serve(port)
    except OSError as error:
        raise CliError("bad-port", f"--metrics-port {port}: cannot listen on 127.0.0.1:{port} ({error.strerror})",
                       "pick a free port") from None
    print(f"metrics: http://127.0.0.1:{port}/metrics", file=sys.stderr)
    return server


def _metrics_report(pools, node):
    """How the bring-up shows in the metrics (`hicache.effects.Report`, label ``apply``): the first
    KV pool's pages, all ready once every planned byte is registered; and the cell the handle goes
    in once it is up (what ready pages are read from)."""
    from hicache.effects import Report

    page_num = next((p.layout.page_num for p in pools if getattr(p.layout, "page_num", None)), None)
    planned = sum(p.total_bytes for p in pools)
    up: list = []

    def ready_pages() -> int:
        registered = sum(size for _, size in up[0].registered_ranges()) if up else 0
        return page_num if page_num and registered >= planned else 0

    return Report(_METRICS_POOL, page_num=page_num, ready_pages=ready_pages, numa_node=node), up


def _hold_seconds(text: str) -> float:
    try:
        if not ascii_number(text):
            raise ValueError(text)
        hold = float(text)
    except ValueError:
        hold = -1.0
    if not hold >= 0:  # also refuses nan
        raise CliError("bad-number", f"--hold must be seconds >= 0 or inf, got {text!r}", "e.g. --hold 30", USAGE)
    return hold


def _machine_plan(args):
    """The plan to bring up and the source of each cap: a saved plan must fit this machine."""
    from hicache.effects import for_cli, os_page_bytes, probe_resolved_limits
    from hicache.plan import EnvError

    if args.plan_file:
        given = _plan_arguments_given(args)
        if given:
            raise CliError("conflicting-flags", f"--plan and {', '.join(given)} both given: a saved plan is applied as "
                           "it was saved", "drop the plan arguments, or plan here without --plan")
        plan = load_plan(args.plan_file)
        try:
            machine = probe_resolved_limits()
        except EnvError as error:
            raise CliError("bad-limits", str(error), "fix or unset the HICACHE_* variable it names") from None
        largest = max((p.largest_call_bytes for _, p in pool_plans(plan)), default=0)
        if largest > machine.limits.hard_cap_bytes:
            raise CliError(
                "plan-exceeds-machine",
                f"the saved plan's largest call is {format_bytes(largest)}, over this machine's "
                f"{format_bytes(machine.limits.hard_cap_bytes)} cap (kernel cap: "
                f"{machine.sources['kernel_cap']}; driver ceiling: {machine.sources['driver_ceiling']})",
                "re-plan here: hicache apply with plan arguments instead of --plan", INFEASIBLE,
            )
        return plan, {"all": f"saved plan {args.plan_file}"}
    resolved = limits_from_args(args, machine_kernel_release=for_cli.probe_kernel_release(), os_page_bytes=os_page_bytes())
    plan, _, sources = build_plan(args, resolved)
    return plan, sources


#: Plan arguments (flag, attribute, value when not given): with --plan none of them may be given.
_PLAN_ARGUMENTS = (
    ("--model", "model", None), ("--config", "config", None), ("--model-path", "model_path", None),
    ("--tp", "tp", None), ("--page-size", "page_size", None), ("--layout", "layout", None),
    ("--kv-dtype", "kv_dtype", None), ("--mamba-slots", "mamba_slots", str(CAPACITY_DEFAULTS["mamba_slots"])),
    ("--host-gb", "host_gb", None), ("--ratio", "ratio", None), ("--device-tokens", "device_tokens", None),
    ("--chunk-limit", "chunk_limit", None), ("--call-cap", "call_cap", None), ("--kernel-release", "kernel_release", None),
    ("--hugepage-size", "hugepage_size", None),
)


def _plan_arguments_given(args) -> list[str]:
    return [flag for flag, name, unset in _PLAN_ARGUMENTS if getattr(args, name, unset) != unset]


def _budget_overrides(args) -> tuple[int | None, int | None]:
    """``(host memory, ranks per host)`` from --host-memory/--ranks-per-host: what the budget
    check uses instead of this machine's free memory and rank count (None: the machine's)."""
    memory = size(args.host_memory, "--host-memory") if args.host_memory else None
    ranks = positive_int(args.ranks_per_host, "--ranks-per-host") if args.ranks_per_host else None
    return memory, ranks


def _hold_for(seconds: float, total: int) -> None:
    if seconds > 0:
        print(f"holding {format_bytes(total)} registered for {seconds:g} s (Ctrl-C releases)", file=sys.stderr)
        deadline = time.monotonic() + seconds
        while time.monotonic() < deadline:  # --hold inf: until interrupted
            time.sleep(min(deadline - time.monotonic(), 3600))


def _release(handle) -> None:
    """Release; when ranges stay registered, say which (a `ReleaseError`, whatever interrupted)."""
    try:
        handle.release()
    except BaseException as error:
        if not handle.leaked:
            raise
        shown = ", ".join(f"(0x{ptr:x}, {format_bytes(size)})" for ptr, size in handle.leaked[:8])
        more = f" and {len(handle.leaked) - 8} more" if len(handle.leaked) > 8 else ""
        raise ReleaseError(
            f"release left {len(handle.leaked)} range(s), {format_bytes(sum(s for _, s in handle.leaked))}, "
            f"registered: {shown}{more}; their memory stays mapped until this process exits",
            leaked=handle.leaked,
        ) from error


def _settings_from_environment(args) -> None:
    """The environment as the pools read it, checked in full before any memory (a bad value:
    `EnvError`, error[bad-environment]); --hugepages and --progressive default to it."""
    from hicache.effects import for_cli, pool_settings
    from hicache.errors import EnvError

    problems = for_cli.environment_problems(paths=False)  # every row, as the bring-up's readers parse it; a bad
    if problems:                                   # HICACHE_TRACE path is the bring-up's warning, not an error
        raise EnvError(problems[0].reason)
    for_cli.host_copy_info()  # HICACHE_HOST_COPY=native where the helper was not built fails the pools too
    settings = pool_settings()
    if args.hugepages is None:
        args.hugepages = settings.hugepages
    if args.progressive is None:
        args.progressive = settings.progressive


def run(args, *, runtime=None, cuda_binding=None, ledger=None, machine=None, lock=None) -> int:
    """`hicache apply`. ``runtime``/``cuda_binding``/``ledger``/``machine``/``lock`` stand in for
    CUDA and the machine in tests (`hicache.testing.fake_cuda` does the first two for all)."""
    _settings_from_environment(args)
    if getattr(args, "trace", None) is not None:  # before any memory is taken (issue #33)
        from hicache.effects import trace
        from hicache.errors import TraceOutputError

        try:
            args.trace = trace.check_path(args.trace)
        except TraceOutputError as error:
            raise CliError("bad-output", str(error), "pass --trace a new file or a regular file in a writable "
                           "directory") from None
    if getattr(args, "fake_cuda", False) and runtime is None and cuda_binding is None:
        from hicache.testing import fake_cuda

        print("note: --fake-cuda: a dry run - CUDA is hicache.testing's fake driver, nothing is pinned "
              "(memory is really mapped, pre-faulted and budgeted)", file=sys.stderr)
        real_args = argparse.Namespace(**{**vars(args), "fake_cuda": False})
        with fake_cuda() as fake:
            code = run(real_args, ledger=ledger, machine=machine, lock=lock)
            fake.check_valid()  # every call the driver saw was one a real driver accepts
        return code
    from hicache._extras import require

    require("torch", "hicache apply")
    import attrs

    from hicache.effects import HostSetup, HostTensorAllocator, Progressive, bring_up, probe_cuda, resolve_numa_node
    from hicache.errors import PlanError

    hold = _hold_seconds(args.hold)
    metrics_port = _metrics_port(args)
    threads = positive_int(args.threads, "--threads") if args.threads else None
    reserve = size(args.reserve, "--reserve", minimum=0) if args.reserve else DEFAULT_RESERVE_BYTES
    host_memory, ranks = _budget_overrides(args)
    plan, sources = _machine_plan(args)
    cuda = probe_cuda(cuda_binding)
    if not cuda.available:  # before allocating anything
        raise CudaUnavailableError(f"CUDA unavailable: {cuda.error}", op="probe", code=35, name="cudaErrorInsufficientDriver")
    pools = [p for _, p in pool_plans(plan)]
    hugepage = pools[0].limits.hugepage_bytes if pools else None
    try:
        node, note = resolve_numa_node(args.numa)
    except PlanError as error:
        raise CliError("bad-numa", str(error), "--numa auto, off or an online node number") from None
    if note:
        print(f"note: {note}", file=sys.stderr)
    allocator = HostTensorAllocator(prefault_threads=threads, hugepages=args.hugepages, hugepage_bytes=hugepage,
                                    numa_node=node)  # a hugetlbfs size the kernel does not offer: refused here
    if allocator.hugepage_note:
        print(f"note: {allocator.hugepage_note}", file=sys.stderr)
    progress = None if args.progressive else BringupProgress(sum(p.call_count for p in pools))
    if args.progressive:
        import torch  # noqa: F401 - loaded before the clock starts, as in a server
    server = _serve_metrics(metrics_port)
    report, up = _metrics_report(pools, node)
    start = time.perf_counter()
    handle = None
    try:
        if progress is not None:
            progress.start()
        try:
            host = HostSetup(runtime=runtime, machine=machine, lock=lock, ledger=ledger, reserve_bytes=reserve,
                             host_memory_bytes=host_memory, ranks_per_host=ranks, allocator=allocator)
            shown = attrs.evolve(report, progress=progress, prefault_progress=progress,
                                 trace=getattr(args, "trace", None))
            handle = bring_up(pools, mode=Progressive() if args.progressive else None, host=host, report=shown)
            up.append(handle)
        finally:
            if progress is not None:
                progress.close()
        if progress is None:
            print(f"first call registered after {handle.first_call_s:.3f} s; registering the rest", file=sys.stderr)
            wait_progressive(handle, handle.total_bytes)
        total_s = time.perf_counter() - start
        calls = len(handle.calls)
        tiers = {name: tier.as_dict() for name, tier in handle.tiers()}  # as obtained, read from the kernel
        page_rules: dict = {}  # hugepages=auto: which rule decided how many bytes of each buffer
        for name, rule, nbytes in handle.page_rules():
            page_rules.setdefault(name, {})[rule] = nbytes
        brake = handle.thp_brake
        status = handle.registration.status() if handle.registration is not None else None
        _hold_for(hold, handle.total_bytes)
    finally:
        if handle is not None:
            _release(handle)
        if server is not None:
            server.shutdown()
    report = {"bytes": handle.total_bytes, "calls": calls, "hugepages": args.hugepages, "tiers": tiers}
    if args.hugepages == "auto":
        report |= {"page_rules": page_rules, "thp_brake": brake}
    if args.progressive:
        report |= {"first_chunk_s": round(handle.first_call_s, 4), "total_s": round(total_s, 4), "numa_node": node}
        return _write_report(args, report, sources, progressive=True)
    report |= {
        "register_gbps": round(status.register_gbps, 2) if status else 0.0,
        "allocate_s": round(allocator.allocate_s, 4), "prefault_s": round(allocator.prefault_s, 4),
        "register_s": round(handle.timings.get("register_s", 0.0), 4),
        "release_s": round(handle.timings.get("release_s", 0.0), 4),
        "largest_call": max((p.largest_call_bytes for p in pools), default=0),
        "numa_node": node,
    }
    return _write_report(args, report, sources)


def _shown(key: str, value) -> str:
    """A table cell: byte counts as sizes (the exact count beside), an unbound NUMA node said."""
    if key in ("bytes", "largest_call") and isinstance(value, int):
        return f"{format_bytes(value)} ({value:,} B)"
    if key == "tiers" and isinstance(value, dict):
        return "; ".join(f"{name}: {_tiers_cell(counts)}" for name, counts in value.items())
    if key == "page_rules" and isinstance(value, dict):  # hugepages=auto: the rule behind each buffer's pages
        return "; ".join(f"{name}: " + ", ".join(f"{format_bytes(n)} {rule}" for rule, n in rules.items())
                         for name, rules in value.items()) or "none"
    if key == "thp_brake" and value is None:
        return "not engaged"
    if key == "numa_node" and value is None:
        return "not bound (one node, or --numa off)"
    if key.endswith("_s") and isinstance(value, float):
        return f"{value:.4f} s"
    if key == "register_gbps":
        return f"{value} GB/s"
    return str(value)


def _tiers_cell(counts: dict) -> str:
    """One buffer's pages as obtained: "48 MiB 4k", "40 MiB thp, 8 MiB 4k (approx.)"."""
    parts = [f"{format_bytes(n)} {tier}" for tier, n in counts.items() if tier != "exact" and n]
    if not parts:
        return "not resident"
    return ", ".join(parts) + ("" if counts.get("exact", True) else " (approx.)")


def _write_report(args, report: dict, sources: dict, **json_only) -> int:
    if args.format == "json":
        sys.stdout.write(json.dumps({"schema": "hicache.apply", "schema_version": 1, **json_only, **report,
                                     "cap_sources": sources}, sort_keys=True) + "\n")
    else:
        sys.stdout.write("".join(f"{k:<14} {_shown(k, v)}\n" for k, v in report.items()))
        sys.stdout.write("caps from     " + ", ".join(f"{k}: {v}" for k, v in sorted(sources.items())) + "\n")
    return 0
