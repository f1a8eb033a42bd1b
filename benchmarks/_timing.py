"""Shared timing helpers: interleaved rounds and their medians (the machines are shared and
noisy), and how long another thread's mmap waits while a job runs."""

from __future__ import annotations

import time


def interleaved(fns: dict, *, rounds: int = 7, warmup: int = 1) -> dict:
    """Seconds of every call of each function in ``fns`` (name -> fn), called in turn for
    ``rounds`` rounds so that machine noise hits them alike, in an order that moves each round
    (`round_order`: every function takes every place, and runs just after every other, equally
    often over ``2 * len(fns)`` rounds - none always runs first into caches, allocator state or
    files the previous one left, and with three none always sits in the middle); ``warmup`` rounds first,
    not counted (first touches of buffers, caches, lazily built state). A function may return a
    teardown (a callable): it runs after the clock stops, before the next call - freeing what the
    timed part built without timing the free."""
    for _ in range(warmup):
        for fn in fns.values():
            _teardown(fn())
    times = {name: [] for name in fns}
    for round_number in range(rounds):
        for name, fn in round_order(list(fns.items()), round_number):
            start = time.perf_counter()
            result = fn()
            times[name].append(time.perf_counter() - start)
            _teardown(result)
            del result
    return times


def round_order(items: list, round_number: int) -> list:
    """``items`` in round ``round_number``'s order: a Williams design (a Latin square balanced for
    what runs just before) - over every ``2 * len(items)`` rounds each item takes each place, and
    directly follows each other item, equally often. Row ``r`` is the base sequence 0, 1, n-1, 2,
    n-2, ... shifted by ``r``; an odd count also takes each row reversed."""
    count = len(items)
    if count < 2:
        return list(items)
    base, low, high = [0], 1, count - 1
    while len(base) < count:
        base.append(low)
        low += 1
        if len(base) < count:
            base.append(high)
            high -= 1
    cycle = round_number % (count if count % 2 == 0 else 2 * count)
    order = [items[(index + cycle) % count] for index in base]
    return order[::-1] if cycle >= count else order


def _teardown(result) -> None:
    if callable(result):
        result()


def median_line(name: str, ours: list, baseline_name: str, baseline: list, unit: str = "s") -> str:
    """Medians of interleaved rounds, the ratio baseline/ours (> 1: we are faster) of the
    medians, and the min-max of the per-round ratios."""
    import statistics

    ours_median, base_median = statistics.median(ours), statistics.median(baseline)
    ratios = [b / o for o, b in zip(ours, baseline)]
    return (
        f"{name}: median {ours_median:.3f} {unit} | baseline {baseline_name}: median "
        f"{base_median:.3f} {unit} | speed {base_median / ours_median:.2f}x of baseline "
        f"(per round {min(ratios):.2f}-{max(ratios):.2f}x, {len(ours)} interleaved rounds)"
    )


def longest_mmap_wait(job):
    """Run ``job()``; return its result and the longest a 1 MiB mmap + munmap in another thread
    waited meanwhile (seconds). Pre-fault calls and cudaHostRegister hold the process's mmap
    lock over their whole range (open driver: os_lock_user_pages), so a serving engine's
    allocations wait for the call in flight."""
    import mmap
    import threading

    waits, done = [0.0], threading.Event()

    def probe() -> None:
        while not done.is_set():
            start = time.perf_counter()
            mmap.mmap(-1, 2**20).close()
            waits.append(time.perf_counter() - start)
            time.sleep(0.002)

    thread = threading.Thread(target=probe, daemon=True)
    thread.start()
    try:
        result = job()
    finally:
        done.set()
        thread.join()
    return result, max(waits)
