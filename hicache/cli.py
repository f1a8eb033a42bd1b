"""`hicache` command line: renders plans for people (table) and tools (JSON).

Owns argument parsing, rendering and exit codes only; the numbers come from hicache.plan. The
plan path imports no torch, cuda or psutil so it starts as fast as a bare script.
"""

from __future__ import annotations

import argparse
import json
import sys

from hicache.plan import Limits, MHALayout, format_bytes, plan_pool, to_jsonable

# Llama-3.1-70B at TP=8 (1 KV head per rank, head dim 128, bf16), 64-token pages, ~100 GB.
DEFAULT_LAYOUT = MHALayout(
    "page_first_direct", layer_num=80, head_num=1, head_dim=128, page_size=64,
    page_num=100 * 10**9 // (2 * 80 * 1 * 128 * 2 * 64), itemsize=2,
)
DEFAULT_LIMITS = Limits(chunk_limit_bytes=64 * 2**30)


def render_table(pool) -> str:
    lines = [
        f"pool: {pool.layout.family} {pool.layout.layout}, {format_bytes(pool.total_bytes)} "
        f"({pool.total_bytes} bytes), {pool.call_count} cudaHostRegister call(s)",
        f"{'buffer':<10} {'shape':<32} {'bytes':>14} {'copy unit':>12} {'step':>12} {'calls':>6}",
    ]
    for b in pool.buffers:
        lines.append(
            f"{b.spec.name:<10} {str(b.spec.shape):<32} {format_bytes(b.spec.nbytes):>14} "
            f"{format_bytes(b.spec.copy_unit_bytes):>12} {format_bytes(b.plan.step_bytes):>12} "
            f"{b.plan.call_count:>6}"
        )
        lines.extend(f"  note: {note}" for note in b.plan.notes)
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="hicache", description=__doc__.splitlines()[0])
    commands = parser.add_subparsers(dest="command", required=True)
    plan = commands.add_parser("plan", help="plan the registration of a host KV pool (offline)")
    plan.add_argument("--format", choices=("table", "json"), default="table")
    args = parser.parse_args(argv)
    pool = plan_pool(DEFAULT_LAYOUT, DEFAULT_LIMITS)
    if args.format == "json":
        print(json.dumps(to_jsonable(pool), sort_keys=True, indent=2))
    else:
        print(render_table(pool))
    return 0
