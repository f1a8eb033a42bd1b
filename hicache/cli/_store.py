"""`hicache store create|status|drop`: the node store's arena for operators (docs/store.md).

create pre-faults an arena before the engines start (e.g. from a node agent), with a progress
line on stderr; status shows its geometry, use, counters, namespaces and backing without
changing it (no reclaim, no write); drop unlinks it (engines still attached keep their mapping
until they close). Data on stdout (a table or JSON), progress and errors on stderr.
"""

from __future__ import annotations

import json
import sys
import time

from hicache.cli._common import USAGE, CliError, emit, positive_decimal, positive_int
from hicache.errors import PlanError
from hicache.plan import format_bytes, format_gb, format_progress
from hicache.plan.store_format import check_label

#: what to change when the store's geometry cannot be planned (the registration plan's hint,
#: --chunk-limit, was given here once)
STORE_PLAN_HINT = ("--slot-bytes: a multiple of 8 that holds the largest page an engine stores; --size-gb: room for "
                   "many slots of it (`hicache plan --store-gb N` sizes both for a model)")

DESCRIPTION = (
    "The node store's arena: one tmpfs (/dev/shm) or hugetlbfs file every SGLang engine on the node "
    "attaches as its L3 (--hicache-storage-backend dynamic, docs/store.md). "
    "Example: hicache store create /dev/shm/hicache-kv --size-gb 64 --slot-bytes 1179648"
)


def add_command(commands) -> None:
    store = commands.add_parser("store", help="create, inspect or drop a node store arena", description=DESCRIPTION)
    actions = store.add_subparsers(dest="action", required=True, parser_class=type(store))
    create = actions.add_parser("create", help="create and pre-fault an arena (before the engines start)")
    create.add_argument("path", help="the arena file, on tmpfs or hugetlbfs (e.g. /dev/shm/hicache-kv)")
    create.add_argument("--size-gb", required=True, help="arena size in GB (10**9 bytes, as --hicache-size)")
    create.add_argument("--slot-bytes", required=True,
                        help="bytes of one slot: the largest page the engines store (hicache plan --store-gb shows it)")
    create.add_argument("--label", help="a name shown by status (at most 64 bytes)")
    create.add_argument("--threads", help="pre-fault threads (default: the CPUs, at most 16)")
    create.add_argument("--format", choices=("table", "json"), default="table")
    status = actions.add_parser("status", help="geometry, pages held, hits/misses, namespaces, backing")
    status.add_argument("path")
    status.add_argument("--format", choices=("table", "json"), default="table")
    drop = actions.add_parser("drop", help="unlink an arena (its pages go when the last engine detaches)")
    drop.add_argument("path")


class _Progress:
    """Pre-fault progress on stderr: a line rewritten on a terminal, one a second otherwise."""

    def __init__(self, stream=None, clock=time.monotonic) -> None:
        self.stream = sys.stderr if stream is None else stream
        self.clock, self.start, self.last = clock, clock(), -1.0

    def __call__(self, done: int, total: int) -> None:
        now = self.clock()
        if now - self.last < 1.0 and done < total:
            return
        self.last = now
        line = format_progress("pre-faulted", done, total, now - self.start)
        if self.stream.isatty():
            print("\r" + line + "\033[K", end="" if done < total else "\n", file=self.stream, flush=True)
        else:
            print(line, file=self.stream, flush=True)


def _status_data(arena) -> dict:
    from hicache.store import SlotIndex

    index = SlotIndex(arena)  # reads only: status reclaims and writes nothing
    census = index.census()
    names = index.namespaces()
    plan = arena.plan
    return {
        "schema": "hicache.store-status", "schema_version": 1, "path": arena.path, "label": arena.label,
        "backing": arena.backing.kind, "page_bytes": plan.unit_bytes, "mount": arena.backing.mount.point,
        "total_bytes": plan.total_bytes, "slot_bytes": plan.slot_bytes, "slots": plan.slots,
        "slots_used": sum(census.by_namespace.values()), "pages": census.pages, "bytes": census.bytes,
        "torn_slots": census.torn, "counters": arena.counters(),
        "namespaces": [{"entry": entry, "description": names.get(entry, "(unregistered)"), "pages": count}
                       for entry, count in sorted(census.by_namespace.items())],
    }


def _table(data: dict) -> str:
    counters = data["counters"]
    lookups = counters["hits"] + counters["misses"]
    rate = f"{100 * counters['hits'] / lookups:.1f} %" if lookups else "-"
    lines = [
        f"arena     {data['path']}  ({data['label'] or 'no label'})",
        f"backing   {data['backing']} on {data['mount']}, {format_bytes(data['page_bytes'])} pages",
        f"size      {format_gb(data['total_bytes'])} ({format_bytes(data['total_bytes'])}): {data['slots']:,} slots of "
        f"{data['slot_bytes']:,} bytes",
        f"held      {data['pages']:,} pages, {format_bytes(data['bytes'])} ({data['slots_used']:,} slots used, "
        f"{data['torn_slots']} torn)",
        f"lookups   {counters['hits']:,} hits, {counters['misses']:,} misses ({rate} hit), {counters['torn']} torn "
        f"reads, {counters['corrupt']} corrupt, {counters['evictions']:,} evictions, {counters['writes']:,} writes",
    ]
    for ns in data["namespaces"]:
        lines.append(f"namespace {ns['entry']:>3}: {ns['pages']:>10,} pages  {ns['description']}")
    return "\n".join(lines) + "\n"


def _render(data: dict, fmt: str) -> str:
    return json.dumps(data, sort_keys=True, indent=2) + "\n" if fmt == "json" else _table(data)


def run(args) -> int:
    from hicache.effects import arena as effects_arena
    from hicache.store import drop_arena, open_store

    if args.action == "drop":
        if not drop_arena(args.path):  # as status words and codes it: one error[arena] line, exit 2
            raise CliError("arena", f"store arena {args.path}: does not exist (nothing to drop)",
                           "hicache store status PATH shows an arena; docs/store.md: where arenas go", USAGE)
        print(f"dropped {args.path}", file=sys.stderr)
        return 0
    if args.action == "status":
        arena = effects_arena.attach_arena(args.path)
        try:
            emit(_render(_status_data(arena), args.format), None)
        finally:
            arena.close()
        return 0
    size_bytes = int(positive_decimal(args.size_gb, "--size-gb") * 10**9)
    slot_bytes = positive_int(args.slot_bytes, "--slot-bytes")
    threads = positive_int(args.threads, "--threads") if args.threads else None
    try:
        check_label(args.label or "", where="--label")
    except PlanError as error:
        raise CliError("bad-value", str(error), "a name of at most 64 bytes of printable text") from None
    try:
        store = open_store(args.path, size_bytes=size_bytes, slot_bytes=slot_bytes, label=args.label or "",
                           threads=threads, progress=_Progress())
    except PlanError as error:
        if type(error) is not PlanError:  # the budget's, the environment's...: their own handlers and hints
            raise
        raise CliError("bad-store-plan", str(error), STORE_PLAN_HINT, USAGE) from None
    try:
        if not store.arena.created:
            print(f"{args.path} exists already: attached it as it is (hicache store drop removes it)", file=sys.stderr)
        else:
            print(f"created {args.path} in {store.arena.attach_s:.1f} s", file=sys.stderr)
        emit(_render(_status_data(store.arena), args.format), None)
    finally:
        store.close()
    return 0
