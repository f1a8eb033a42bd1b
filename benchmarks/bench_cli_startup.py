"""`hicache plan` start-up against a bare Python that imports attrs (target: <= 1.5x).

Both run as fresh processes; medians of N interleaved wall-clock runs each, with the range.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))

from _timing import interleaved, median_line  # noqa: E402

# The console script a user runs (as pip writes it): no runpy, unlike `python -m hicache`.
PLAN = [sys.executable, "-c", "import sys; from hicache.cli import main; sys.exit(main(['plan', '--format', 'json']))"]
BARE = [sys.executable, "-c", "import attrs"]


def once(cmd) -> float:
    start = time.perf_counter()
    subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    return time.perf_counter() - start


def main() -> None:
    # pip byte-compiles installed packages; do the same for a fair comparison with attrs.
    subprocess.run([sys.executable, "-m", "compileall", "-q", str(Path(__file__).parents[1] / "hicache")], check=True)
    rounds = int(os.environ.get("HICACHE_BENCH_ROUNDS", "15"))
    times = interleaved({"plan": lambda: once(PLAN), "bare": lambda: once(BARE)}, rounds=rounds)  # warm-up: page cache
    print(median_line("hicache plan (default preset, JSON) start-to-exit", [t * 1e3 for t in times["plan"]],
                      "python -c 'import attrs'", [t * 1e3 for t in times["bare"]], "ms"))


if __name__ == "__main__":
    main()
