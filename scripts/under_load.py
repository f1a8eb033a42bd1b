"""Run a command beside busy processes, as a shared CI box runs the suite (issue #31).

    python scripts/under_load.py [--hogs 6] -- COMMAND [ARGS...]

Starts HOGS processes that spin on the CPU (a load of about HOGS + the command's own on a
2-core box), runs COMMAND, stops the hogs however COMMAND ends (its exit, Ctrl-C, SIGTERM) and
exits with COMMAND's status. A hog also stops by itself when this process is gone (it checks
its parent every few milliseconds of work), so a kill -9 of this script leaves no spinner.
"""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys

# A hog: spin, and look up every ~10 ms of work whether the parent that started it still lives.
_HOG = (
    "import os, sys\n"
    "parent = int(sys.argv[1])\n"
    "while os.getppid() == parent:\n"
    "    for _ in range(100000):\n"
    "        pass\n"
)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--hogs", type=int, default=6, help="busy processes beside the command (default 6)")
    parser.add_argument("command", nargs=argparse.REMAINDER, help="the command, after --")
    args = parser.parse_args(argv)
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    if not command:
        parser.error("a command to run is needed after --")
    if not 0 <= args.hogs <= 64:
        parser.error(f"--hogs must be between 0 and 64, got {args.hogs}")
    hogs = [subprocess.Popen([sys.executable, "-c", _HOG, str(os.getpid())], stdin=subprocess.DEVNULL)
            for _ in range(args.hogs)]
    print(f"under load: {len(hogs)} busy processes beside `{' '.join(command)}`", file=sys.stderr, flush=True)

    def terminate(signum, frame):  # SIGTERM: stop as Ctrl-C does, so the finally below runs
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, terminate)
    child = None
    try:
        child = subprocess.Popen(command)
        return child.wait()
    except KeyboardInterrupt:
        if child is not None:
            child.terminate()
            child.wait()
        return 130
    finally:
        for hog in hogs:
            hog.kill()
        for hog in hogs:
            hog.wait()


if __name__ == "__main__":
    sys.exit(main())
