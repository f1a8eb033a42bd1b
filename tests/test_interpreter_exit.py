"""Work hicache hands to threads when the interpreter is exiting: from the atexit handlers on, an
executor schedules nothing, so a pool destroyed in a server's shutdown hook, or a mapping whose
last view dies at exit, must do its parallel work on the calling thread - never raise from
destroy() or print a traceback. `run_each` is the one rule; a real interpreter's exit proves it."""

from __future__ import annotations

import subprocess
import sys
import threading
from concurrent.futures import ThreadPoolExecutor

import pytest
from hypothesis import given
from hypothesis import strategies as st

from hicache.effects._host._threads import run_each

pytestmark = pytest.mark.concurrency


def _refusing_after(pool, accepted: int):
    """An executor's submit that takes ``accepted`` calls, then refuses as one does at exit."""
    taken = []

    def submit(function, *arguments):
        if len(taken) >= accepted:
            raise RuntimeError("cannot schedule new futures after interpreter shutdown")
        taken.append(arguments)
        return pool.submit(function, *arguments)

    return submit


@given(calls=st.integers(0, 12), accepted=st.integers(0, 12))
def test_every_call_runs_once_whether_the_pool_takes_it_or_refuses_it(calls, accepted):
    """run_each runs each call exactly once: the ones the pool took on its threads, the ones it
    refused (the interpreter exiting) on the calling thread, and returns once all have ended."""
    done, lock, caller = [], threading.Lock(), threading.get_ident()

    def record(number):
        with lock:
            done.append((number, threading.get_ident() == caller))

    with ThreadPoolExecutor(max_workers=3) as pool:
        run_each(_refusing_after(pool, accepted), record, [(number,) for number in range(calls)])
        assert sorted(number for number, _ in done) == list(range(calls))
    on_caller = {number for number, here in done if here}
    assert on_caller == set(range(min(accepted, calls), calls))


def test_an_error_is_raised_only_after_every_call_handed_out_has_ended():
    """A refused call that fails on the calling thread raises only once the calls the pool took
    have finished (they may write into memory the caller frees next)."""
    release, finished = threading.Event(), []

    def work(number):
        if number == 0:
            release.wait(10)
            finished.append(number)
        else:
            release.set()
            raise ValueError(f"call {number}")

    with ThreadPoolExecutor(max_workers=1) as pool:
        with pytest.raises(ValueError, match="call 1"):
            run_each(_refusing_after(pool, 1), work, [(0,), (1,)])
        assert finished == [0]


EXIT_CHILD = """
import atexit, sys
from hicache.effects._host import _release
from hicache.effects._host._memory import allocate_host

size = _release.RELEASE_PIECE_BYTES + 4096 * 16  # two pieces: given back in parallel
freed = allocate_host(size)
viewed = allocate_host(size)
keep = [viewed.tensor[:8]]  # a view that outlives its buffer, as SGLang's pool keeps its tensor
viewed.free()
threads = []
real = _release.give_back

def give_back(ptr, length, **kw):
    threads.append(real(ptr, length, **kw))
    return threads[-1]

_release.give_back = give_back

@atexit.register
def shutdown():  # registered last, so it runs first: executors refuse work from here on
    freed.free()  # a server's shutdown hook destroying its pool
    keep.clear()  # the last view dies: the release thread gives the mapping back
    assert _release.RELEASER.wait(30), "the release thread did not finish"
    print("given back in", threads, flush=True)
"""


def test_a_pool_freed_or_dropped_at_the_interpreter_s_exit_gives_its_pages_back_without_an_error():
    """A real interpreter's exit: a buffer freed in an atexit handler, and a mapping whose last
    view dies there, are both given back in pieces (on the exiting thread) - the process exits 0,
    nothing raised from free(), no traceback on stderr."""
    result = subprocess.run([sys.executable, "-c", EXIT_CHILD], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert "Traceback" not in result.stderr and "failed" not in result.stderr, result.stderr
    assert result.stdout.strip() == "given back in [2, 2]", (result.stdout, result.stderr)
