"""`hicache doctor`: what this machine will do to a plan, as a table of rules.

Each rule (`_doctor_host`: the machine; `_doctor_services`: the environment, SGLang, the node
store) reads one `Context` (the plan, if any, the machine's facts, the caps this machine
resolves with their sources, CUDA) and returns one `Check` (pass / warn / fail, a hint) or
several. Loaded only by `doctor`; it imports hicache.effects when it runs.
"""

from __future__ import annotations

import json
import sys

import attrs

from hicache.cli._saved import load_plan, pool_plans
from hicache.plan import CapacityPlan
from hicache.cli._doctor_context import Check, Context
from hicache.cli._doctor_host import (  # noqa: F401 - host_copy_check, _buddyinfo, _numa: tests read them
    _binding, _buddyinfo, _cuda, _gpus, _host_copy, _hugepages, _kernel, _limits, _max_map_count, _memlock, _memory,
    _numa, _page_allocator, _pools, _thp, _transfer, _versions, host_copy_check, transfer_check,
)
from hicache.cli._doctor_services import _environment, _host_scope, _sglang, _store, _store_room

DESCRIPTION = (
    "Check this machine against a saved plan (or in general): kernel pin cap, the caps this "
    "machine plans with and where each comes from, hugepages, what host pools will do "
    "(HICACHE_PROGRESSIVE, HICACHE_HUGEPAGES), memlock, mappings, memory budget, "
    "NUMA, the host copy path and page allocator, CUDA, the SGLang plug-in and room for a node store (--store: an arena). "
    "Exit 1 when a check fails. "
    "Example: hicache doctor --plan plan.json"
)

RULES = (_versions, _environment, _host_scope, _kernel, _limits, _thp, _hugepages, _pools, _buddyinfo, _memlock, _max_map_count, _memory, _numa, _host_copy, _page_allocator, _transfer,
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
