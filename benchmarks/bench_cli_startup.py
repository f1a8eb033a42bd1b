"""`hicache plan` start-up against a bare Python that imports attrs (target: <= 1.5x).

Both run as fresh processes; medians of N interleaved runs each, with the range: wall-clock time
(what a user waits) and the process's CPU time (user + system, from its rusage: what it costs,
less moved by a shared box's scheduling than the wall clock).
"""

from __future__ import annotations

import os
import resource
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))

from _timing import interleaved, median_line  # noqa: E402

# The console script a user runs (as pip writes it): no runpy, unlike `python -m hicache`.
PLAN = [sys.executable, "-c", "import sys; from hicache.cli import main; sys.exit(main(['plan', '--format', 'json']))"]
BARE = [sys.executable, "-c", "import attrs"]


CPU_TIMES: dict = {"plan": [], "bare": []}


def once(cmd, name: str) -> float:
    """Wall seconds of one run of ``cmd``; its CPU seconds go to CPU_TIMES[name]."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    start = time.perf_counter()
    subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    wall = time.perf_counter() - start
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    CPU_TIMES[name].append(after.ru_utime - before.ru_utime + after.ru_stime - before.ru_stime)
    return wall


def main() -> None:
    # pip byte-compiles installed packages; do the same for a fair comparison with attrs.
    subprocess.run([sys.executable, "-m", "compileall", "-q", str(Path(__file__).parents[1] / "hicache")], check=True)
    rounds = int(os.environ.get("HICACHE_BENCH_ROUNDS", "15"))
    times = interleaved({"plan": lambda: once(PLAN, "plan"), "bare": lambda: once(BARE, "bare")},
                        rounds=rounds)  # warm-up: page cache
    print(median_line("hicache plan (default preset, JSON) start-to-exit", [t * 1e3 for t in times["plan"]],
                      "python -c 'import attrs'", [t * 1e3 for t in times["bare"]], "ms"))
    cpu = {name: [t * 1e3 for t in values[-rounds:]] for name, values in CPU_TIMES.items()}  # the warm-up's left out
    print(median_line("  its CPU time (user + system)", cpu["plan"], "python -c 'import attrs'", cpu["bare"], "ms"))


if __name__ == "__main__":
    main()
