"""A trace of the bring-up as Chrome trace-event JSON (opens in Perfetto and chrome://tracing).

Owns the process-wide recorder (issue #21): `span(name, cat, **args)` times a piece of work on
the thread that ran it - a phase of the bring-up, a pre-fault piece, a register call, a wait
for the host-wide lock - and `tracing(path)` (or HICACHE_TRACE=FILE for every bring-up) records
them and writes the file. Off, `span` is one global read and a shared no-op context.

The output is as safe as the CLI's `--out` (issue #33): `check_path` refuses - before anything is
recorded - what is not a regular file or a new file in a writable directory (a device, FIFO,
directory, symlink); each write goes to a private temp file in the same directory, replaces only
a regular file (checked again just before), and leaves no temp file on any failure; a trace that
cannot be written is a logged warning, never a failed bring-up. Times are the host's
CLOCK_MONOTONIC (one clock for every process of the host) with the wall-clock time of its
origin recorded, so the traces of all ranks merge into one timeline (`merge`, `hicache trace
merge`). Imports hicache.errors and the output-file leaf only.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import socket
import threading
import time

from hicache._output_file import check_output, replace_file
from hicache.errors import TraceOutputError
from hicache.plan.settings import env_value

TRACE_ENV = "HICACHE_TRACE"
CLOCK = "CLOCK_MONOTONIC"  # time.monotonic: one clock for every process of a host
_NULL = contextlib.nullcontext()
logger = logging.getLogger("hicache.trace")

def check_path(path) -> str:
    """``path`` as an absolute path a trace may be written to: an existing regular file this
    user may write (it is replaced), or a new file in an existing writable directory. Anything
    else - a symlink, a device, a FIFO, a directory, a missing or read-only directory - is a
    `TraceOutputError` saying which, before anything is recorded (`hicache._output_file`)."""
    return check_output(path, what="trace file", error=TraceOutputError)


def write_json(path: str, data) -> bool:
    """Write ``data`` to ``path`` as `hicache._output_file.replace_file` writes (a private temp
    file, then a rename onto a regular file only); True when written. A failure is a logged
    warning and leaves no temp file; an interrupt still propagates (after the cleanup)."""
    try:
        replace_file(path, lambda handle: json.dump(data, handle), what="trace file", error=TraceOutputError)
        return True
    except (TraceOutputError, ValueError, TypeError) as error:
        logger.warning("hicache: the trace %s was not written: %s", path, error)
        return False


class _Recorder:
    def __init__(self, path: str) -> None:
        self.path = path
        self.events: list[dict] = []
        self.threads: dict[int, str] = {}
        self.lock = threading.Lock()
        self.origin = time.monotonic()  # the host's clock: every process's spans line up
        self.wall = time.time()  # what that moment was on the wall clock

    def add(self, name: str, cat: str, start: float, end: float, args: dict) -> None:
        thread = threading.current_thread()
        event = {"name": name, "cat": cat, "ph": "X", "ts": round(start * 1e6, 3),
                 "dur": round((end - start) * 1e6, 3), "pid": os.getpid(), "tid": thread.ident, "args": args}
        with self.lock:
            self.events.append(event)
            self.threads.setdefault(thread.ident, thread.name)

    def write(self) -> None:
        with self.lock:
            names = [{"name": "thread_name", "ph": "M", "pid": os.getpid(), "tid": tid, "args": {"name": name}}
                     for tid, name in self.threads.items()]
            data = {"traceEvents": names + list(self.events), "displayTimeUnit": "ms",
                    "otherData": {"clock": CLOCK, "host": socket.gethostname(), "pid": os.getpid(),
                                  "origin_monotonic_s": self.origin, "origin_wall_s": self.wall}}
        write_json(self.path, data)


_ACTIVE: _Recorder | None = None


class _Span:
    __slots__ = ("recorder", "name", "cat", "args", "start")

    def __init__(self, recorder, name, cat, args) -> None:
        self.recorder, self.name, self.cat, self.args = recorder, name, cat, args

    def __enter__(self):
        self.start = time.monotonic()
        return self.args  # the caller may add arguments known only at the end (a rate)

    def __exit__(self, kind, error, tb) -> None:
        end = time.monotonic()
        if kind is not None:
            self.args["error"] = kind.__name__
        size = self.args.get("size")
        if isinstance(size, int) and end > self.start:
            self.args["GB/s"] = round(size / (end - self.start) / 1e9, 3)  # the call's (or piece's) rate
        self.recorder.add(self.name, self.cat, self.start, end, self.args)


def span(name: str, cat: str, **args):
    """Time the block as one trace event on this thread (a no-op while nothing traces)."""
    recorder = _ACTIVE
    if recorder is None:
        return _NULL
    return _Span(recorder, name, cat, args)


def active() -> bool:
    return _ACTIVE is not None


@contextlib.contextmanager
def tracing(path: str | None):
    """Record every span until the block ends, then write ``path`` (None: no trace). Nested
    blocks share the outer recording."""
    global _ACTIVE
    if not path or _ACTIVE is not None:
        yield
        return
    checked = _checked_or_warn(path)
    if checked is None:
        yield
        return
    _ACTIVE = recorder = _Recorder(checked)
    try:
        yield
    finally:
        _ACTIVE = None
        recorder.write()


def _checked_or_warn(path) -> str | None:
    """The checked path, or None after a warning: a trace never fails the work it observes."""
    try:
        return check_path(path)
    except TraceOutputError as error:
        logger.warning("hicache: not tracing: %s", error)
        return None


def start(path: str | None) -> None:
    """Record for the rest of the process into ``path`` (None: nothing; already recording: that
    recording goes on). The file is rewritten after each bring-up, each release and at exit, so
    background calls land in it too."""
    global _ACTIVE
    if not path or _ACTIVE is not None:
        return
    checked = _checked_or_warn(path)
    if checked is None:
        return
    import atexit

    _ACTIVE = recorder = _Recorder(checked)
    atexit.register(recorder.write)


def from_env(env=None) -> None:
    """`start` with HICACHE_TRACE=FILE, when it is set."""
    start(env_value(os.environ if env is None else env, TRACE_ENV))


def stop() -> None:
    """Write the recording and end it (tests; a process that wants no more)."""
    global _ACTIVE
    recorder, _ACTIVE = _ACTIVE, None
    if recorder is not None:
        recorder.write()


def flush() -> None:
    """Rewrite the active trace with everything so far (background work keeps adding)."""
    if _ACTIVE is not None:
        _ACTIVE.write()


def merge(paths) -> dict:
    """One trace of the traces at ``paths`` (each rank's, one host): their events on the host's
    clock they share, each process under its own pid. `TraceOutputError` for a file that is no
    hicache trace, or traces of another clock or host (their times do not line up)."""
    loaded = []
    for path in paths:
        try:
            with open(path) as handle:
                loaded.append((path, json.load(handle)))
        except (OSError, ValueError) as error:
            raise TraceOutputError(f"trace {path}: cannot read it ({error})") from None
    return merge_loaded(loaded)


def merge_loaded(loaded) -> dict:
    """`merge` of traces already read: ``(path, parsed JSON)`` pairs (`hicache trace merge`
    reads them as it reads every input file: regular files only, bounded)."""
    events, sources = [], []
    for path, data in loaded:
        other = data.get("otherData", {}) if isinstance(data, dict) else {}
        if other.get("clock") != CLOCK or not isinstance(data.get("traceEvents"), list):
            raise TraceOutputError(f"trace {path}: not a hicache trace on {CLOCK} (written by an older hicache?)")
        sources.append({"path": str(path), **other})
        events += data["traceEvents"]
    hosts = {source["host"] for source in sources}
    if len(hosts) > 1:
        raise TraceOutputError(f"traces of {len(hosts)} hosts ({', '.join(sorted(hosts))}): their monotonic clocks "
                               "do not line up - merge each host's traces apart")
    events.sort(key=lambda e: (e.get("ph") != "M", e.get("ts", 0)))
    return {"traceEvents": events, "displayTimeUnit": "ms",
            "otherData": {"clock": CLOCK, "host": next(iter(hosts), ""), "merged": sources}}
