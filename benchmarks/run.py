"""Run every benchmarks/bench_*.py in its own process; each prints result lines with a baseline
and a ratio. `make bench` calls this; `make bench ARGS=plan` runs only bench_plan.py.

Each script's wall time follows its name, and the whole run's its last line: `make bench` must
fit in BUDGET_S on the 2-core development box (the scripts' defaults are sized for it - larger
sizes through their HICACHE_BENCH_* variables); a run over it says so."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

BUDGET_S = 600


def main(argv: list[str]) -> int:
    here = Path(__file__).parent
    scripts = sorted(here.glob("bench_*.py"))
    if argv:
        scripts = [s for s in scripts if any(name in s.stem for name in argv)]
    failed = 0
    began = time.monotonic()
    for script in scripts:
        print(f"== {script.stem}", flush=True)
        start = time.monotonic()
        failed |= subprocess.run([sys.executable, str(script)]).returncode != 0
        print(f"== {script.stem}: {time.monotonic() - start:.0f} s", flush=True)
    total = time.monotonic() - began
    over = f", over the {BUDGET_S} s a run may take: make a script's defaults smaller" if total > BUDGET_S else ""
    print(f"== {len(scripts)} benchmark(s) in {total:.0f} s{over}", flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
