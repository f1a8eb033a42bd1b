"""Planning cost: 64 TiB at 1 GiB chunks (65,536 ranges) and a 2 TiB layer_first pool.

Target: well under 50 ms each on one core, linear in ranges (not pages). The baseline is the
floor any planner pays: building the same number of bare (offset, size) tuples.
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))

from _timing import best_of, line  # noqa: E402

from hicache.plan import Limits, MHALayout, plan_pool, plan_registration  # noqa: E402

GiB, TiB = 2**30, 2**40


def bare_tuples(total: int, step: int) -> list:
    return [(offset, min(step, total - offset)) for offset in range(0, total, step)]


def main() -> None:
    limits = Limits(chunk_limit_bytes=GiB)
    total = 64 * TiB
    ours = best_of(lambda: plan_registration(total, granularity_bytes=2 * 2**20, limits=limits))
    floor = best_of(lambda: bare_tuples(total, GiB))
    print(line("plan_registration 64 TiB @ 1 GiB (65,536 ranges)", ours * 1e3, "ms", "bare tuples", floor * 1e3))

    # 2 TiB layer_first Llama-3.1-70B (TP=1) pool at 64 GiB chunks.
    per_page = 2 * 80 * 64 * 8 * 128 * 2
    layout = MHALayout(
        "layer_first", layer_num=80, head_num=8, head_dim=128, page_size=64,
        page_num=2 * TiB // per_page, itemsize=2,
    )
    pool_limits = Limits(chunk_limit_bytes=64 * GiB)
    calls = plan_pool(layout, pool_limits).call_count
    ours = best_of(lambda: plan_pool(layout, pool_limits))
    floor = best_of(lambda: bare_tuples(layout.total_bytes, 64 * GiB))
    print(line(f"plan_pool 2 TiB layer_first ({calls} ranges)", ours * 1e3, "ms", "bare tuples", floor * 1e3))

    # Linear in ranges, not pages: 1,024x the pages at the same range count costs the same.
    small = MHALayout("page_first", layer_num=1, head_num=1, head_dim=64, page_size=64, page_num=2**14, itemsize=2)
    large = MHALayout("page_first", layer_num=1, head_num=1, head_dim=64, page_size=64, page_num=2**24, itemsize=2)
    few = best_of(lambda: plan_pool(small, Limits(chunk_limit_bytes=small.total_bytes // 64)))
    many = best_of(lambda: plan_pool(large, Limits(chunk_limit_bytes=large.total_bytes // 64)))
    print(line("plan_pool 1,024x pages, same 64 ranges", many * 1e3, "ms", "1x pages", few * 1e3))


if __name__ == "__main__":
    main()
