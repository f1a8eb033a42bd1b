"""Planning cost: 64 TiB at 1 GiB chunks (65,536 ranges), bare and with torch imported (an
SGLang server's heap), and a 2 TiB layer_first pool.

Target: < 50 ms with torch imported, <= 3x the baseline, with and without reading every range
afterwards (a planner tiling makes its Range objects when they are read). The baseline is the floor any planner
pays: a plain loop building the same number of (offset, size) tuples. Medians of interleaved
rounds (HICACHE_BENCH_ROUNDS, 9), with the per-round range. "bare" runs in a child process that
never imports torch.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))

from _timing import interleaved, median_line  # noqa: E402

from hicache.plan import Limits, MHALayout, plan_pool, plan_registration  # noqa: E402

GiB, TiB = 2**30, 2**40


def plain_loop(total: int, step: int) -> list:
    out = []
    for offset in range(0, total, step):
        out.append((offset, step if offset + step <= total else total - offset))
    return out


def bench_64_tib(label: str, rounds: int) -> None:
    limits = Limits(chunk_limit_bytes=GiB)
    total = 64 * TiB
    times = interleaved({
        "ours": lambda: plan_registration(total, granularity_bytes=2 * 2**20, limits=limits),
        "loop": lambda: plain_loop(total, GiB),
    }, rounds=rounds)
    print(median_line(f"plan_registration 64 TiB @ 1 GiB (65,536 ranges), {label}", [t * 1e3 for t in times["ours"]],
                      "a plain loop building the tuples", [t * 1e3 for t in times["loop"]], "ms"))
    # A planner tiling makes its Range objects when read: what a bring-up pays to walk them all.
    times = interleaved({
        "ours": lambda: sum(r.size for r in plan_registration(total, granularity_bytes=2 * 2**20, limits=limits).ranges),
        "loop": lambda: sum(size for _, size in plain_loop(total, GiB)),
    }, rounds=rounds)
    print(median_line(f"plan_registration 64 TiB @ 1 GiB, then every range read, {label}",
                      [t * 1e3 for t in times["ours"]], "a plain loop building and reading the tuples",
                      [t * 1e3 for t in times["loop"]], "ms"))


def main() -> None:
    rounds = int(os.environ.get("HICACHE_BENCH_ROUNDS", "9"))
    if "--bare" in sys.argv:
        bench_64_tib("bare interpreter", rounds)
        return
    subprocess.run([sys.executable, __file__, "--bare"], check=True)
    import torch  # noqa: F401  (a serving process's heap: planning must not slow down in it)

    bench_64_tib("torch imported", rounds)

    # 2 TiB layer_first Llama-3.1-70B (TP=1) pool at 64 GiB chunks.
    per_page = 2 * 80 * 64 * 8 * 128 * 2
    layout = MHALayout(
        "layer_first", layer_num=80, head_num=8, head_dim=128, page_size=64,
        page_num=2 * TiB // per_page, itemsize=2,
    )
    pool_limits = Limits(chunk_limit_bytes=64 * GiB)
    calls = plan_pool(layout, pool_limits).call_count
    times = interleaved({
        "ours": lambda: plan_pool(layout, pool_limits),
        "loop": lambda: plain_loop(layout.total_bytes, 64 * GiB),
    }, rounds=rounds)
    print(median_line(f"plan_pool 2 TiB layer_first ({calls} ranges), torch imported", [t * 1e3 for t in times["ours"]],
                      "a plain loop building the tuples", [t * 1e3 for t in times["loop"]], "ms"))

    # Linear in ranges, not pages: 1,024x the pages at the same range count costs the same.
    small = MHALayout("page_first", layer_num=1, head_num=1, head_dim=64, page_size=64, page_num=2**14, itemsize=2)
    large = MHALayout("page_first", layer_num=1, head_num=1, head_dim=64, page_size=64, page_num=2**24, itemsize=2)
    times = interleaved({
        "many": lambda: plan_pool(large, Limits(chunk_limit_bytes=large.total_bytes // 64)),
        "few": lambda: plan_pool(small, Limits(chunk_limit_bytes=small.total_bytes // 64)),
    }, rounds=rounds)
    print(median_line("plan_pool 1,024x pages, same 64 ranges", [t * 1e3 for t in times["many"]], "1x pages",
                      [t * 1e3 for t in times["few"]], "ms"))


if __name__ == "__main__":
    main()
