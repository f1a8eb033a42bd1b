"""How a background thread of hicache runs: nicer than the process (`lower_priority`) and on
given CPUs (`pin_thread`, the pre-fault's NUMA node: `_numa.fault_share`). Both act on the
calling thread only and are best effort: a thread that cannot be moved still does its work.
And how work handed to threads still gets done when the interpreter is exiting (`run_each`).
Imports the standard library only.
"""

from __future__ import annotations

import os
import sys
import threading
from concurrent.futures import wait


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


def run_each(submit, function, argument_lists) -> None:
    """``function(*arguments)`` for each of ``argument_lists``, handed to threads by ``submit`` (an
    executor's), and wait for every one; the first error is raised once all have ended. Where
    the pool refuses work - the interpreter is exiting: from atexit handlers on, an executor
    schedules nothing and, in the finalizers after them, no thread can start - the calls it
    refused run on the calling thread: a pool destroyed in a shutdown hook must still give its
    memory back, not raise from its destroy()."""
    futures, refused = [], []
    for arguments in argument_lists:
        if refused:
            refused.append(arguments)
            continue
        try:
            futures.append(submit(function, *arguments))
        except RuntimeError:  # "cannot schedule new futures after interpreter shutdown", "can't create new thread"
            refused.append(arguments)
    try:
        for arguments in refused:
            function(*arguments)
        for future in futures:
            future.result()
    except BaseException:
        # an error or Ctrl-C here: every call handed out ends before the caller goes on (they
        # may write into memory it is about to free), then it is raised
        wait(futures)
        raise
