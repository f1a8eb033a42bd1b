"""`hicache plan`: the offline capacity review. Pure: reads flags and the ``HICACHE_*``
settings, never the machine (no torch, cuda or psutil import)."""

from __future__ import annotations

import sys

from hicache.cli._common import INFEASIBLE, CliError, emit
from hicache.cli._plan_args import add_plan_arguments, build_plan
from hicache.plan import CAPACITY_DEFAULTS, PRESETS

DESCRIPTION = (
    "Plan every host pool a model needs on one rank: buffer shapes, page-copy units and the "
    "cudaHostRegister calls each buffer is split into, with the cap that decided the split. "
    "Never touches the machine. SGLang's server-argument names work too (--tp-size, "
    "--hicache-size, --hicache-ratio, --hicache-mem-layout, --kv-cache-dtype, --model-path). "
    "Example: hicache plan --model deepseek-v3.2 --tp-size 8 --hicache-size 300 --format json --out plan.json"
)


def add_command(commands) -> None:
    plan = commands.add_parser("plan", help="capacity plan of a model's host pools (offline, pure)", description=DESCRIPTION)
    add_plan_arguments(plan)
    plan.add_argument("--this-machine", action="store_true",
                      help="also apply this machine's kernel pin cap (reads its kernel release; nothing else)")
    plan.add_argument("--list-models", action="store_true", help="list the embedded presets")
    plan.add_argument("--format", choices=("table", "json", "markdown"), default="table")
    plan.add_argument("--out", help="write the output to FILE instead of stdout")
    plan.add_argument("--wide", action="store_true", help="table: every column (family, shape), no folding at 100")


def _list_models() -> str:
    lines = [f"{'preset':<20} {'family':<14} source"]
    for name, spec in PRESETS.items():
        mark = "  (default)" if name == CAPACITY_DEFAULTS["model"] else ""
        lines.append(f"{name:<20} {spec.kind:<14} {spec.source}{mark}")
    return "\n".join(lines) + "\n"


def run(args) -> int:
    from hicache.cli._render import render

    if args.list_models:
        emit(_list_models(), args.out)
        return 0
    resolved = None
    if args.this_machine:
        from hicache.cli._plan_args import limits_from_args
        from hicache.effects import probe_kernel_release  # asked for: the one machine fact used

        resolved = limits_from_args(args, machine_kernel_release=probe_kernel_release())
    if args.reserve is not None and args.host_memory is None:
        raise CliError("missing-flag", "--reserve is read only with --host-memory (plan never reads the machine)",
                       "e.g. --host-memory 2TB --ranks-per-host 8 --reserve 20GiB")
    plan, defaults, sources = build_plan(args, resolved)
    if defaults and not any(getattr(args, k) for k in ("model", "config", "model_path")):
        print("hicache plan: no model given; planning the default preset on default settings", file=sys.stderr)
    emit(render(plan, args.format, defaults=defaults, sources=sources, wide=args.wide), args.out)
    if plan.budget is not None and not plan.budget.ok:
        raise CliError(
            "budget-refused", plan.budget.explain(),
            "lower --host-gb, run fewer --ranks-per-host, or add host memory", INFEASIBLE,
        )
    return 0
