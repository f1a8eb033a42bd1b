"""What the SGLang plug-in tells a server's log about a host buffer's bring-up (issue #24).

Owns the wording and the logger. The logger is SGLang's own for the seam hicache replaces
(``sglang.srt.mem_cache.pool_host.common``) whenever SGLang is loaded, so SGLang's handlers, its
``--log-level`` and ``SGLANG_LOGGING_CONFIG_PATH`` decide what shows; elsewhere hicache's. The
lines: the plan before the first call (calls, largest, every cap and where it came from, the
granularity), progress after each call when a buffer takes more than one (at most one line a
second, and the last), and the timings once it is registered (pre-fault and registration,
seconds and rates). Pure formatting apart from the logger lookup.
"""

from __future__ import annotations

import logging
import sys
import time

from hicache.plan import format_bytes

SGLANG_LOGGER = "sglang.srt.mem_cache.pool_host.common"
#: every per-call cap a plan can have (`Limits.caps`), as the line names it: the one that binds is always listed
_CAPS = (("chunk_limit", "chunk"), ("driver_ceiling", "driver ceiling"), ("kernel_cap", "kernel cap"),
         ("call_cap", "call cap"))


def log() -> logging.Logger:
    """SGLang's logger for this seam when SGLang's code is loaded, else hicache's."""
    return logging.getLogger(SGLANG_LOGGER if SGLANG_LOGGER in sys.modules else "hicache.compat.sglang")


def _rate(nbytes: int, seconds: float | None) -> str:
    if not seconds or seconds <= 0:
        return "instant"
    return f"{nbytes / seconds / 1e9:.2f} GB/s"


def plan_line(plan, sources: dict) -> str:
    """One line: what will be registered, in how many calls, under which caps (and why)."""
    limits = plan.limits
    caps = limits.caps()
    parts = []
    for name, label in _CAPS:
        value = caps.get(name)
        shown = format_bytes(value) if value is not None else "none"
        parts.append(f"{label} {shown} ({sources.get(name, 'default')})")
    binding = "/".join(limits.binding_caps())
    granularity = format_bytes(plan.granularity_bytes) if plan.granularity_bytes else "none (one range)"
    line = (
        f"hicache: host buffer of {format_bytes(plan.total_bytes)}: {plan.call_count} cudaHostRegister call(s), "
        f"largest {format_bytes(plan.largest_call_bytes)}; caps: {', '.join(parts)}; binding: {binding}; "
        f"granularity {granularity}"
    )
    if plan.notes:
        line += "; notes: " + "; ".join(plan.notes)
    return line


class CallProgress:
    """``progress`` for the bring-up: a line per registered call when a buffer takes more than
    one, at most one a second (and always the last)."""

    def __init__(self, logger: logging.Logger, *, every_s: float = 1.0, clock=time.monotonic) -> None:
        self._logger, self._every_s, self._clock = logger, every_s, clock
        self._last = None

    def __call__(self, event) -> None:
        if event.chunk_count <= 1:
            return
        now = self._clock()
        last_call = event.chunk_index == event.chunk_count
        if not last_call and self._last is not None and now - self._last < self._every_s:
            return
        self._last = now
        self._logger.info(
            "hicache: registered %d/%d calls, %s of %s in %.1f s (%s)",
            event.chunk_index, event.chunk_count, format_bytes(event.bytes_done), format_bytes(event.bytes_total),
            event.elapsed_s, _rate(event.bytes_done, event.elapsed_s),
        )


def timing_line(total_bytes: int, timings: dict, calls: int) -> str:
    """One line once the buffer is registered: pre-fault and registration, seconds and rates."""
    prefault = timings.get("prefault_s")
    register = timings.get("register_s")
    if prefault is not None:
        faulting = f"pre-faulted in {prefault:.2f} s ({_rate(total_bytes, prefault)}) pipelined with registration"
    else:  # a back end's allocator: its allocate() did whatever faulting it does
        allocate = timings.get("allocate_prefault_s")
        faulting = f"allocated by its allocator in {allocate or 0.0:.2f} s"
    return (
        f"hicache: host buffer of {format_bytes(total_bytes)} ready: {faulting}; "
        f"{calls} call(s) registered in {register or 0.0:.2f} s ({_rate(total_bytes, register)})"
    )
