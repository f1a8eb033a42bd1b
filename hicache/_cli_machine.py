"""`hicache doctor` and `hicache apply`: the CLI commands that touch the machine.

Owns the doctor's checks (each pass / warn / fail with a hint) and apply's bring-up sequence
(CUDA check -> budget under the host lock -> allocate -> pre-fault -> register -> hold ->
release), with a progress bar on stderr. Loaded only by those commands; the plan path never
imports it.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import attrs

from hicache.cli import CliError, USAGE
from hicache.errors import CudaUnavailableError, PlanError
from hicache.plan import (
    CapacityPlan,
    PoolPlan,
    assess_budget,
    check_budget,
    format_bytes,
    format_gb,
    from_jsonable,
)


@attrs.frozen
class Check:
    """One doctor finding."""

    name: str
    status: str  # pass | warn | fail
    finding: str
    hint: str = ""


def _load_plan(path: str):
    try:
        data = json.loads(Path(path).read_text())
    except OSError as error:
        raise CliError("bad-plan", f"cannot read {path}: {error.strerror}", "pass a file written by `hicache plan --format json --out FILE`") from None
    except ValueError as error:
        raise CliError("bad-plan", f"{path} is not valid JSON: {error}", "pass a file written by `hicache plan --format json`") from None
    try:
        plan = from_jsonable(data)
    except PlanError as error:
        raise CliError("bad-plan", f"{path}: {error}", "regenerate it with `hicache plan --format json`") from None
    if not isinstance(plan, (CapacityPlan, PoolPlan)):
        raise CliError("bad-plan", f"{path} holds a single-buffer plan, not a pool or capacity plan", "use `hicache plan --format json`")
    return plan


def _pool_plans(plan) -> list[tuple[str, PoolPlan]]:
    if isinstance(plan, PoolPlan):
        return [("pool", plan)]
    return [(p.name, p.plan) for p in plan.pools]


def doctor_checks(plan=None, *, root: str = "/", env=None, cuda_binding=None) -> list[Check]:
    """Every check of `hicache doctor`, against ``plan`` when one is given."""
    from hicache.effects import probe_cuda, probe_machine

    facts = probe_machine(root=root, env=env)
    checks: list[Check] = []
    total = calls = largest = 0
    limits = None
    if plan is not None:
        pools = _pool_plans(plan)
        total = sum(p.total_bytes for _, p in pools)
        calls = sum(p.call_count for _, p in pools)
        largest = max((p.largest_call_bytes for _, p in pools), default=0)
        limits = pools[0][1].limits if pools else None
    ranks = facts.ranks_per_host
    if isinstance(plan, CapacityPlan) and plan.ranks_per_host:
        ranks = plan.ranks_per_host

    cap = facts.kernel_pin_cap_bytes
    if cap is None:
        checks.append(Check("kernel", "pass", f"Linux {facts.kernel_release}: no per-pin cap"))
    elif plan is not None and largest > cap:
        checks.append(Check(
            "kernel", "fail",
            f"Linux {facts.kernel_release} pins at most {format_bytes(cap)} per call; the plan's largest call is {format_bytes(largest)}",
            f"re-plan with --kernel-release {facts.kernel_release} (or HICACHE_KERNEL_PIN_CAP)",
        ))
    else:
        checks.append(Check("kernel", "warn", f"Linux {facts.kernel_release} pins at most {format_bytes(cap)} per call", "plan with --kernel-release so calls stay under it"))

    thp = facts.thp_enabled
    if thp == "always":
        checks.append(Check("thp", "warn", "transparent huge pages: always (defrag: %s)" % facts.thp_defrag,
                            "compaction can stall pre-fault; hicache's mappings opt out unless asked"))
    else:
        checks.append(Check("thp", "pass", f"transparent huge pages: {thp or 'unknown'}"))

    pools_text = ", ".join(f"{format_bytes(p.size_bytes)}: {p.free}/{p.total} free" for p in facts.hugepages) or "none"
    hugepage = limits.hugepage_bytes if limits is not None else None
    if hugepage:
        pool = next((p for p in facts.hugepages if p.size_bytes == hugepage), None)
        needed = -(-total // hugepage) * ranks
        if pool is None or pool.free < needed:
            free = pool.free if pool else 0
            checks.append(Check("hugepages", "fail", f"the plan needs {needed} pages of {format_bytes(hugepage)} for {ranks} rank(s), {free} free ({pools_text})",
                                f"reserve them: echo {needed} > /sys/kernel/mm/hugepages/hugepages-{hugepage // 1024}kB/nr_hugepages"))
        else:
            checks.append(Check("hugepages", "pass", f"{pool.free} free pages of {format_bytes(hugepage)} cover {needed} needed"))
    else:
        checks.append(Check("hugepages", "pass", f"reserved hugepages: {pools_text}"))

    memlock = facts.memlock_soft
    text = "unlimited" if memlock is None else format_bytes(memlock)
    if memlock is not None and plan is not None and memlock < total:
        checks.append(Check("memlock", "warn", f"RLIMIT_MEMLOCK {text} is below the plan's {format_bytes(total)}",
                            "cudaHostRegister pins through the driver, but RDMA registration of the same memory (Mooncake, NIXL) counts against it: ulimit -l unlimited"))
    else:
        checks.append(Check("memlock", "pass", f"RLIMIT_MEMLOCK {text}"))

    if facts.max_map_count is not None and plan is not None:
        need = 2 * calls * ranks  # a registration can split a mapping; be generous
        status = "fail" if need > facts.max_map_count else "pass"
        checks.append(Check("max_map_count", status, f"vm.max_map_count {facts.max_map_count:,}; the plan needs about {need:,} mappings for {ranks} rank(s)",
                            "" if status == "pass" else "raise vm.max_map_count or --chunk-limit"))
    else:
        checks.append(Check("max_map_count", "pass", f"vm.max_map_count {facts.max_map_count}"))

    memory_text = f"{format_gb(facts.available_bytes)} available of {format_gb(facts.total_bytes)}"
    if facts.cgroup_limit_bytes is not None:
        memory_text += f"; cgroup limit {format_gb(facts.cgroup_limit_bytes)}"
    if plan is not None:
        verdict = assess_budget(total, available_bytes=facts.available_bytes, ranks_per_host=ranks,
                                cgroup_limit_bytes=facts.cgroup_limit_bytes, cgroup_usage_bytes=facts.cgroup_usage_bytes or 0)
        checks.append(Check("memory", "pass" if verdict.ok else "fail", f"{memory_text}; {verdict.explain()}",
                            "" if verdict.ok else "lower --host-gb or the ranks per host"))
    else:
        checks.append(Check("memory", "pass", memory_text))

    numa = facts.numa_nodes
    checks.append(Check("numa", "pass" if numa == 1 else "warn", f"{numa} NUMA node(s)",
                        "" if numa == 1 else "bind each rank's pool to its GPU's node (numactl --membind / --cpunodebind)"))

    checks.append(_host_copy_check(env))
    cuda = probe_cuda(cuda_binding)
    if cuda.available:
        checks.append(Check("cuda", "pass", f"driver {cuda.driver_version}, runtime {cuda.runtime_version}, {cuda.device_count} device(s)"))
    else:
        checks.append(Check("cuda", "fail", f"CUDA unavailable: {cuda.error}", "install the NVIDIA driver or run on a GPU node"))
    return checks


def _host_copy_check(env) -> Check:
    """Whether host<->host page copies run through the native helper (see effects/_host_copy)."""
    from hicache.effects import _host_copy
    from hicache.effects._probes import EnvError

    try:
        mode = _host_copy.host_copy_mode(env)
    except EnvError as error:
        return Check("host_copy", "fail", str(error), f"unset {_host_copy.ENV_VAR} or set it to auto")
    threads = _host_copy.copy_threads()
    if mode == "native":
        return Check("host_copy", "pass", f"native batched host copies, up to {threads} thread(s)")
    if _host_copy._native is None:
        return Check("host_copy", "warn", "native copy helper not built: CPU page copies use ctypes memmove (slower)",
                     "reinstall hicache where a C compiler (gcc/cc) is available")
    return Check("host_copy", "pass", f"ctypes memmove copies, as {_host_copy.ENV_VAR} asks")


def render_checks(checks: list[Check], fmt: str) -> str:
    if fmt == "json":
        return json.dumps({"schema": "hicache.doctor", "schema_version": 1,
                           "checks": [attrs.asdict(c) for c in checks]}, sort_keys=True, indent=2) + "\n"
    width = max(len(c.name) for c in checks)
    lines = []
    for c in checks:
        lines.append(f"{c.status.upper():<4}  {c.name:<{width}}  {c.finding}")
        if c.hint:
            lines.append(f"{'':<4}  {'':<{width}}  hint: {c.hint}")
    return "\n".join(lines) + "\n"


def run_doctor(args) -> int:
    plan = _load_plan(args.plan_file) if args.plan_file else None
    checks = doctor_checks(plan)
    sys.stdout.write(render_checks(checks, args.format))
    return 1 if any(c.status == "fail" for c in checks) else 0


class _Progress:
    """A one-line progress bar on stderr (a line per buffer when stderr is not a terminal)."""

    def __init__(self, total_calls: int) -> None:
        self.total_calls = total_calls
        self.calls = 0
        self.tty = sys.stderr.isatty()

    def __call__(self, event) -> None:
        self.calls += 1
        rate = event.bytes_done / event.elapsed_s / 1e9 if event.elapsed_s > 0 else 0.0
        line = (f"registering {format_bytes(event.bytes_done)} / {format_bytes(event.bytes_total)}  "
                f"calls {self.calls}/{self.total_calls}  {rate:.1f} GB/s")
        if self.tty:
            print("\r" + line, end="", file=sys.stderr, flush=True)
        elif event.chunk_index == event.chunk_count:
            print(f"{line}  ({event.buffer} done)", file=sys.stderr)

    def close(self) -> None:
        if self.tty:
            print(file=sys.stderr)


def _tear_down(registration, buffers, ledger) -> None:
    """Release, then free every buffer nothing still pins; a buffer CUDA may still pin (a
    failed release or rollback) is quarantined, never unmapped."""
    from hicache.effects import quarantine
    from hicache.errors import RegistrationStateError, ReleaseError

    try:
        if registration is not None:
            registration.release()
    except ReleaseError:
        quarantine(*buffers)
        raise
    for buffer in buffers:
        try:
            buffer.free(ledger=ledger)
        except RegistrationStateError:  # a rollback left part of it registered
            quarantine(buffer)


def run_apply(args, build_plan, *, runtime=None, cuda_binding=None, ledger=None) -> int:
    """`hicache apply`. ``runtime``/``cuda_binding``/``ledger`` stand in for CUDA in tests."""
    from hicache.effects import (
        CudaPythonRuntime,
        allocate_host,
        apply_pool_plans,
        budget_lock,
        prefault,
        probe_cuda,
        probe_machine,
    )

    plan = _load_plan(args.plan_file) if args.plan_file else build_plan(args)[0]
    try:
        hold = float(args.hold)
    except ValueError:
        hold = -1.0
    if not hold >= 0:  # also refuses nan
        raise CliError("bad-number", f"--hold must be seconds >= 0 or inf, got {args.hold!r}", "e.g. --hold 30", USAGE)
    threads = int(args.threads) if args.threads else None
    cuda = probe_cuda(cuda_binding)
    if not cuda.available:  # before allocating anything
        raise CudaUnavailableError(f"CUDA unavailable: {cuda.error}", op="probe", code=35, name="cudaErrorInsufficientDriver")
    pools = _pool_plans(plan)
    total = sum(p.total_bytes for _, p in pools)
    buffers, registration, timings = [], None, {}
    try:
        start = time.perf_counter()
        with budget_lock() as lock:
            facts = probe_machine()
            check_budget(total, available_bytes=facts.available_bytes, ranks_per_host=facts.ranks_per_host,
                         ranks_already_allocated=min(len(lock.peers()), facts.ranks_per_host - 1),
                         cgroup_limit_bytes=facts.cgroup_limit_bytes, cgroup_usage_bytes=facts.cgroup_usage_bytes or 0)
            for _, pool in pools:
                for b in pool.buffers:
                    buffers.append(allocate_host(b.spec.nbytes, hugepages=args.hugepages,
                                                 hugepage_bytes=pool.limits.hugepage_bytes or 2 * 2**20))
            lock.record(total)
        timings["allocate_s"] = time.perf_counter() - start
        start = time.perf_counter()
        for buffer in buffers:
            prefault(buffer, threads=threads)
        timings["prefault_s"] = time.perf_counter() - start
        pointers, cursor = [], iter(buffers)
        for _, pool in pools:
            pointers.append((pool, [next(cursor).ptr for _ in pool.buffers]))
        progress = _Progress(sum(p.call_count for _, p in pools))
        try:
            registration = apply_pool_plans(
                pointers, runtime=runtime if runtime is not None else CudaPythonRuntime(),
                progress=progress, ledger=ledger,
            )
        finally:
            progress.close()
        status = registration.status()
        timings["register_s"] = status.register_seconds
        if hold > 0:
            print(f"holding {format_bytes(total)} registered for {hold:g} s (Ctrl-C releases)", file=sys.stderr)
            deadline = time.monotonic() + hold
            while time.monotonic() < deadline:  # --hold inf: until interrupted
                time.sleep(min(deadline - time.monotonic(), 3600))
    finally:
        start = time.perf_counter()
        _tear_down(registration, buffers, ledger)
        if buffers:
            with budget_lock() as lock:
                lock.forget(total)
        timings["release_s"] = time.perf_counter() - start
    report = {"bytes": total, "calls": status.call_count, "register_gbps": round(status.register_gbps, 2),
              **{k: round(v, 4) for k, v in timings.items()}}
    if args.format == "json":
        sys.stdout.write(json.dumps(report, sort_keys=True) + "\n")
    else:
        sys.stdout.write("".join(f"{k:<14} {v}\n" for k, v in report.items()))
    return 0
