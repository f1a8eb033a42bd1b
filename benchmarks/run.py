"""Run every benchmarks/bench_*.py in its own process; each prints result lines with a baseline
and a ratio. `make bench` calls this; `make bench ARGS=plan` runs only bench_plan.py."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path


def main(argv: list[str]) -> int:
    here = Path(__file__).parent
    scripts = sorted(here.glob("bench_*.py"))
    if argv:
        scripts = [s for s in scripts if any(name in s.stem for name in argv)]
    failed = 0
    for script in scripts:
        print(f"== {script.stem}", flush=True)
        failed |= subprocess.run([sys.executable, str(script)]).returncode != 0
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
