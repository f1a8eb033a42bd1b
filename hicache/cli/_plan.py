"""`hicache plan`: the offline capacity review. Pure: reads flags and the ``HICACHE_*``
settings, never the machine (no torch, cuda or psutil import)."""

from __future__ import annotations

import sys

from hicache.cli._common import INFEASIBLE, CliError, emit, positive_decimal, positive_int
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
    store = plan.add_argument_group("node store (docs/store.md)")
    store.add_argument("--store-gb", help="also size a node store arena of this many GB (10**9 bytes): slots, index, "
                                          "overhead - what `hicache store create` makes")
    store.add_argument("--store-slot-bytes", help="bytes per slot (default: this plan's KV page on one rank)")


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
    if args.store_slot_bytes is not None and args.store_gb is None:
        raise CliError("missing-flag", "--store-slot-bytes is read only with --store-gb", "e.g. --store-gb 64")
    resolved = None
    if args.this_machine:
        from hicache.cli._plan_args import limits_from_args
        from hicache.effects import for_cli  # asked for: the one machine fact used (the kernel release)

        resolved = limits_from_args(args, machine_kernel_release=for_cli.probe_kernel_release())
    if args.reserve is not None and args.host_memory is None:
        raise CliError("missing-flag", "--reserve is read only with --host-memory (plan never reads the machine)",
                       "e.g. --host-memory 2TB --ranks-per-host 8 --reserve 20GiB")
    plan, defaults, sources = build_plan(args, resolved)
    if defaults and not any(getattr(args, k) for k in ("model", "config", "model_path")):
        print("hicache plan: no model given; planning the default preset on default settings", file=sys.stderr)
    text = render(plan, args.format, defaults=defaults, sources=sources, wide=args.wide)
    if args.store_gb is not None:
        text = _with_store(text, plan, args)
    emit(text, args.out)
    if plan.budget is not None and not plan.budget.ok:
        raise CliError(
            "budget-refused", plan.budget.explain(),
            "lower --host-gb, run fewer --ranks-per-host, or add host memory", INFEASIBLE,
        )
    return 0


def _with_store(text: str, plan, args) -> str:
    """The plan's output with the node store's geometry: a section of the table or markdown, a
    ``store`` key of the JSON (`hicache.plan.plan_store`, pure) and ``store_pages``: what a slot
    holds. A slot takes one pool's page (`CapacityPlan.stored_pages`), so the default slot is the
    largest page - what an engine creating the arena picks - and a page of tokens takes a slot
    in each token pool; a slot given below the largest page is refused, as the engine's attach
    would refuse it."""
    import json

    from hicache.errors import PlanError
    from hicache.plan import format_bytes, format_gb, plan_store

    size_bytes = int(positive_decimal(args.store_gb, "--store-gb") * 10**9)
    pages = plan.stored_pages()
    largest = max(pages, key=lambda page: page.page_bytes)
    need = -(-largest.page_bytes // 8) * 8
    slot = positive_int(args.store_slot_bytes, "--store-slot-bytes") if args.store_slot_bytes else need
    if slot < largest.page_bytes:
        raise CliError("bad-value", f"--store-slot-bytes {slot} is below this plan's largest page: "
                       f"{largest.pool}'s {largest.page_bytes:,} bytes (an engine's attach refuses such an arena)",
                       f"--store-slot-bytes {need}")
    try:
        store = plan_store(size_bytes, slot_bytes=slot)
    except PlanError as error:  # the store's own flags, not the registration caps the generic hint names
        raise CliError("bad-store-plan", str(error), "--store-gb: room for at least 16 slots (the message says how "
                       "much); --store-slot-bytes: this plan's largest page or more, a multiple of 8") from None
    by_tokens = [page.pool for page in pages if not page.per_request]
    token_pages = store.slots // len(by_tokens)
    per_request = [page.pool for page in pages if page.per_request]
    if args.format == "json":
        data = json.loads(text)
        data["store"] = store.to_jsonable()
        data["store_pages"] = {"pools": [{"pool": p.pool, "page_bytes": p.page_bytes, "per_request": p.per_request}
                                         for p in pages],
                               "slots_per_token_page": len(by_tokens), "token_pages": token_pages,
                               "tokens": token_pages * plan.page_size}
        return json.dumps(data, sort_keys=True, indent=2) + "\n"
    lines = [f"node store: {format_gb(store.total_bytes)} holds {store.slots:,} slots of {slot:,} bytes "
             f"({f'the largest page of this plan: {largest.pool}' if not args.store_slot_bytes else 'as given'}),",
             f"  a page of {plan.page_size} tokens in {len(by_tokens)} ({', '.join(by_tokens)}): {token_pages:,} pages, "
             f"{token_pages * plan.page_size:,} tokens"
             + (f", less a slot for each request's {' and '.join(per_request)} state" if per_request else ""),
             f"  index {format_bytes(store.index_bytes)}, overhead {100 * store.overhead_bytes / store.total_bytes:.2f} %:"
             f" hicache store create PATH --size-gb {args.store_gb} --slot-bytes {slot}"]
    if args.format == "markdown":
        return text + "\n- " + " ".join(line.strip() for line in lines) + "\n"
    return text + "\n" + "\n".join(lines) + "\n"
