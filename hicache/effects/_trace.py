"""A trace of the bring-up as Chrome trace-event JSON (opens in Perfetto and chrome://tracing).

Owns the process-wide recorder (issue #21): `span(name, cat, **args)` times a piece of work on
the thread that ran it - a phase of the bring-up, a pre-fault piece, a register call, a wait
for the host-wide lock - and `tracing(path)` (or HICACHE_TRACE=FILE for every bring-up) records
them and writes the file. Off, `span` is one global read and a shared no-op context. Imports
nothing of hicache.
"""

from __future__ import annotations

import contextlib
import json
import os
import threading
import time

TRACE_ENV = "HICACHE_TRACE"
_NULL = contextlib.nullcontext()


class _Recorder:
    def __init__(self, path: str) -> None:
        self.path = path
        self.events: list[dict] = []
        self.threads: dict[int, str] = {}
        self.lock = threading.Lock()
        self.origin = time.perf_counter()

    def add(self, name: str, cat: str, start: float, end: float, args: dict) -> None:
        thread = threading.current_thread()
        event = {"name": name, "cat": cat, "ph": "X", "ts": round((start - self.origin) * 1e6, 3),
                 "dur": round((end - start) * 1e6, 3), "pid": os.getpid(), "tid": thread.ident, "args": args}
        with self.lock:
            self.events.append(event)
            self.threads.setdefault(thread.ident, thread.name)

    def write(self) -> None:
        with self.lock:
            names = [{"name": "thread_name", "ph": "M", "pid": os.getpid(), "tid": tid, "args": {"name": name}}
                     for tid, name in self.threads.items()]
            data = {"traceEvents": names + list(self.events), "displayTimeUnit": "ms"}
        temporary = f"{self.path}.{os.getpid()}.tmp"
        with open(temporary, "w") as handle:
            json.dump(data, handle)
        os.replace(temporary, self.path)  # a reader never sees half a file


_ACTIVE: _Recorder | None = None


class _Span:
    __slots__ = ("recorder", "name", "cat", "args", "start")

    def __init__(self, recorder, name, cat, args) -> None:
        self.recorder, self.name, self.cat, self.args = recorder, name, cat, args

    def __enter__(self):
        self.start = time.perf_counter()
        return self.args  # the caller may add arguments known only at the end (a rate)

    def __exit__(self, kind, error, tb) -> None:
        end = time.perf_counter()
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
    _ACTIVE = recorder = _Recorder(str(path))
    try:
        yield
    finally:
        _ACTIVE = None
        recorder.write()


def start(path: str | None) -> None:
    """Record for the rest of the process into ``path`` (None: nothing; already recording: that
    recording goes on). The file is rewritten after each bring-up, each release and at exit, so
    background calls land in it too."""
    global _ACTIVE
    if not path or _ACTIVE is not None:
        return
    import atexit

    _ACTIVE = recorder = _Recorder(str(path))
    atexit.register(recorder.write)


def from_env(env=None) -> None:
    """`start` with HICACHE_TRACE=FILE, when it is set."""
    start((os.environ if env is None else env).get(TRACE_ENV, "").strip() or None)


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
