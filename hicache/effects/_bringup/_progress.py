"""Progress of a bring-up while it runs (issue #21 item 4): "still pinning" told apart from "hung".

Owns the pre-fault's progress events (`PrefaultEvent`, counted across the faulting threads by
`PrefaultCounter`) and the library's own log lines about both phases (`ProgressLog`: bytes,
rate, ETA - at most one a second per phase, and the last). Register calls report through the
executor's `ProgressEvent`. Imports attrs and the executor's event only.
"""

from __future__ import annotations

import logging
import threading
import time

import attrs

from hicache.effects._cuda._executor import ProgressEvent
from hicache.plan import format_progress

logger = logging.getLogger(__name__)


@attrs.frozen
class PrefaultEvent:
    """Reported after every pre-fault piece (at most 256 MiB): bytes resident so far."""

    bytes_done: int
    bytes_total: int
    elapsed_s: float


class PrefaultCounter:
    """``on_piece(nbytes)`` for the faulting threads: adds up, then calls ``report`` with a
    `PrefaultEvent` (serialized: events arrive in order of ``bytes_done``)."""

    def __init__(self, total: int, report, clock=time.perf_counter) -> None:
        self.total, self.report, self.clock = total, report, clock
        self.done = 0
        self.start = clock()
        self._lock = threading.Lock()

    def __call__(self, nbytes: int) -> None:
        with self._lock:
            self.done += nbytes
            self.report(PrefaultEvent(self.done, self.total, self.clock() - self.start))


def describe(event) -> str:
    """``pre-faulted|registered X / Y (P %) R GB/s ETA S s`` for either event."""
    verb = "pre-faulted" if isinstance(event, PrefaultEvent) else "registered"
    line = format_progress(verb, event.bytes_done, event.bytes_total, event.elapsed_s)
    if isinstance(event, ProgressEvent):
        line += f" (buffer {event.buffer} call {event.chunk_index}/{event.chunk_count})"
    return line


class ProgressLog:
    """The library's log lines about a bring-up: at most one a second per phase, and the last
    (a server's log then shows a long bring-up moving; INFO, logger ``hicache.effects...``).
    `start_heartbeat` adds a line each second nothing else was logged - a 64 GiB call takes
    seconds, and "still pinning" must not look like "hung"."""

    def __init__(self, log: logging.Logger = logger, *, every_s: float = 1.0, clock=time.monotonic) -> None:
        self.log, self.every_s, self.clock = log, every_s, clock
        self._last: dict[type, float] = {}
        self._events: dict[type, object] = {}
        self._lock = threading.Lock()
        self._logged = clock()
        self._started = self._logged
        self._since_call = self._logged
        self._stop = None

    def enabled(self) -> bool:
        return self.log.isEnabledFor(logging.INFO)

    def __call__(self, event) -> None:
        if not self.enabled():
            return
        now = self.clock()
        with self._lock:
            self._events[type(event)] = event
            if isinstance(event, ProgressEvent):
                self._since_call = now
            last = self._last.get(type(event))
            if last is not None and now - last < self.every_s and event.bytes_done < event.bytes_total:
                return
            self._last[type(event)] = self._logged = now
        self.log.info("hicache bring-up: %s", describe(event))

    def heartbeat(self) -> str:
        """What the heartbeat says now: the last state of each phase and the call's wait."""
        with self._lock:
            now = self.clock()
            parts = [describe(e) for e in self._events.values()]
            waited = now - self._since_call
        state = "; ".join(parts) if parts else "budget, mapping"
        return f"{state}; {waited:.0f} s since the last register call, {now - self._started:.0f} s in"

    def start_heartbeat(self) -> None:
        """Log `heartbeat` each ``every_s`` nothing else was logged, until `stop_heartbeat`
        (a daemon thread; only while INFO is enabled)."""
        if not self.enabled() or self._stop is not None:
            return
        self._stop = stop = threading.Event()

        def beat() -> None:
            while not stop.wait(self.every_s):
                if self.clock() - self._logged >= self.every_s:
                    self._logged = self.clock()
                    self.log.info("hicache bring-up: still working: %s", self.heartbeat())

        threading.Thread(target=beat, name="hicache-progress-log", daemon=True).start()

    def stop_heartbeat(self) -> None:
        if self._stop is not None:
            self._stop.set()


def tee(*reports):
    """One progress callback calling each of ``reports`` that is not None, in order (None
    when every one is)."""
    reports = [r for r in reports if r is not None]
    if len(reports) <= 1:
        return reports[0] if reports else None  # None: nobody listens, no event is made

    def report(event) -> None:
        for each in reports:
            each(event)

    return report
