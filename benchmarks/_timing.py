"""Shared timing helper: best of N wall-clock runs (the machines are shared and noisy)."""

from __future__ import annotations

import time


def best_of(fn, *, repeat: int = 7) -> float:
    """The fastest of ``repeat`` calls of ``fn``, in seconds."""
    best = float("inf")
    for _ in range(repeat):
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
    return best


def line(name: str, value: float, unit: str, baseline_name: str, baseline: float) -> str:
    """One result line: the figure, its baseline, and the ratio."""
    return (
        f"{name}: {value:.3f} {unit} | baseline {baseline_name}: {baseline:.3f} {unit} | "
        f"ratio {value / baseline:.2f}x"
    )
