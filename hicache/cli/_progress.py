"""`hicache apply`'s progress on stderr (issue #21 item 4): "still pinning" told apart from hung.

Owns the display of a bring-up while it runs: pre-fault and registration bytes, rates and
ETAs, and the seconds the register call in flight has taken, redrawn at least every second
by a ticker thread (a 64 GiB call takes seconds; the bar must not freeze meanwhile) - one line
rewritten on a terminal, a line a second otherwise (and one at each buffer's end). Events come
from `bring_up`'s ``progress`` (register calls) and ``prefault_progress`` (pre-fault pieces),
on the threads that made them. Formatting only; the clock and the stream are parameters.
"""

from __future__ import annotations

import sys
import threading
import time

from hicache.plan import format_progress as _phase


class BringupProgress:
    """Call with events (``chunk_index``: a register call's; else a pre-fault piece's); `start`
    the ticker, `close` it. `line()` is what is shown now."""

    def __init__(self, total_calls: int, *, stream=None, every_s: float = 1.0, clock=time.monotonic) -> None:
        self.total_calls = total_calls
        self.stream = sys.stderr if stream is None else stream
        self.tty = self.stream.isatty()
        self.every_s, self.clock = every_s, clock
        self.calls = 0
        self.prefault = None  # the last pre-fault event
        self.register = None  # the last register event
        self.start_s = clock()
        self.call_since = self.start_s  # when the call now in flight (or the first) began waiting
        self._lock = threading.Lock()
        self._shown = False
        self._last = None  # the plain line last shown with a buffer's end (not shown again)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._tick, name="hicache-apply-progress", daemon=True)

    def __call__(self, event) -> None:
        with self._lock:
            if hasattr(event, "chunk_index"):
                self.calls += 1
                self.register = event
                self.call_since = self.clock()
                buffer_done = event.chunk_index == event.chunk_count
            else:
                self.prefault = event
                buffer_done = False
        if buffer_done and not self.tty:
            line = self.line()
            self._show(f"{line}  ({event.buffer} done)")
            self._last = line

    def line(self) -> str:
        with self._lock:
            parts = []
            if self.prefault is not None:
                p = self.prefault
                parts.append(_phase("pre-faulted", p.bytes_done, p.bytes_total, p.elapsed_s))
            r = self.register
            if r is not None:
                parts.append(_phase("registered", r.bytes_done, r.bytes_total, r.elapsed_s)
                             + f" calls {self.calls}/{self.total_calls}")
            if r is None and self.prefault is None:
                parts.append("preparing: budget lock, mapping (and the first import of torch)")
            elif self.calls < self.total_calls:
                parts.append("call 1 waits for its pre-fault" if r is None
                             else f"call {self.calls + 1} in flight {self.clock() - self.call_since:.0f} s")
            parts.append(f"{self.clock() - self.start_s:.0f} s elapsed")
        return " | ".join(parts)

    def _show(self, line: str) -> None:
        self._shown = True
        if self.tty:
            print("\r" + line + "\033[K", end="", file=self.stream, flush=True)
        else:
            print(line, file=self.stream, flush=True)

    def _tick(self) -> None:
        while not self._stop.wait(self.every_s):
            self._show(self.line())

    def start(self) -> "BringupProgress":
        self._thread.start()
        return self

    def close(self) -> None:
        """Stop the ticker; the final state is shown once more if anything happened (a
        bring-up that failed before its first piece leaves its error the first line)."""
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join()
        line = self.line()
        if (self.register is not None or self.prefault is not None) and line != self._last:
            self._show(line)
        if self.tty and self._shown:
            print(file=self.stream)


def wait_progressive(handle, total_bytes: int, *, stream=None, every_s: float = 1.0, clock=time.monotonic) -> None:
    """Wait for a progressive bring-up's background calls, a progress line at least every
    ``every_s`` (registered bytes, rate, ETA, calls)."""
    stream = sys.stderr if stream is None else stream
    start = clock()
    while not handle.wait(every_s):
        done = sum(size for _, size in handle.registered_ranges())
        print(_phase("registered", done, total_bytes, clock() - start) + f" calls {len(handle.calls)}",
              file=stream, flush=True)
