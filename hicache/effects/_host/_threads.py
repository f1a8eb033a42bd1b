"""How a background thread of hicache runs: nicer than the process (`lower_priority`) and on
given CPUs (`pin_thread`, the pre-fault's NUMA node: `_numa.fault_share`). Both act on the
calling thread only and are best effort: a thread that cannot be moved still does its work.
Imports the standard library only.
"""

from __future__ import annotations

import os
import sys
import threading


def lower_priority(nice: int) -> None:
    """Make the calling thread ``nice`` steps nicer; best effort, Linux only (where a thread id
    names the thread; elsewhere it could name another process)."""
    if nice and sys.platform.startswith("linux"):
        try:
            os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), os.getpriority(os.PRIO_PROCESS, 0) + nice)
        except (AttributeError, OSError):
            pass


def pin_thread(cpus) -> bool:
    """Run the calling thread on ``cpus`` only (Linux: pid 0 names the calling thread); best
    effort - False where it cannot (no such call, a CPU outside the cpuset)."""
    if not cpus:
        return False
    try:
        os.sched_setaffinity(0, cpus)
    except (AttributeError, OSError, ValueError):
        return False
    return True
