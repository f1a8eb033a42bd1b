"""The ranges this process holds registered, so an overlapping request is refused before CUDA
sees it (a double registration otherwise leaves a sticky 712 pending, sglang PR #38832).

Owns one `hicache.plan.IntervalSet` per ledger, guarded by a lock. `PROCESS_LEDGER` mirrors
what CUDA holds for the whole process; tests and fakes pass their own.
"""

from __future__ import annotations

import threading

from hicache.plan import IntervalSet


class HostLedger:
    """Disjoint ``[ptr, ptr + size)`` intervals currently registered."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._held = IntervalSet()

    def overlapping(self, ptr: int, size: int) -> tuple[int, int] | None:
        """The held interval that overlaps ``[ptr, ptr + size)``, if any."""
        with self._lock:
            return self._held.overlapping(ptr, size)

    def claim(self, intervals) -> tuple[tuple[int, int], tuple[int, int]] | None:
        """Atomically hold every ``(ptr, size)`` of ``intervals``, or none of them.

        Returns None on success, else ``(requested, held)``: the first requested interval that
        overlaps a held one (or another requested one). Claiming before the CUDA calls makes
        two threads applying overlapping plans refuse each other instead of racing to a 712.
        """
        wanted = sorted(intervals)
        with self._lock:
            for index, (ptr, size) in enumerate(wanted):
                held = self._held.overlapping(ptr, size)
                if held is not None:
                    return (ptr, size), held
                if index and wanted[index - 1][0] + wanted[index - 1][1] > ptr:
                    return (ptr, size), wanted[index - 1]
            for ptr, size in wanted:
                self._held.add(ptr, size)
        return None

    def replace(self, remove_ptrs, add_intervals) -> None:
        """Atomically drop the intervals starting at ``remove_ptrs`` and hold ``add_intervals``
        (sub-ranges of what was dropped: ranges a rollback or release could not undo)."""
        with self._lock:
            for ptr in remove_ptrs:
                self._held.remove(ptr)
            for ptr, size in add_intervals:
                self._held.add(ptr, size)

    def forget(self, ranges) -> None:
        """Stop holding the bytes of ``ranges`` (unregistered outside a `Registration`, e.g. from
        the records on an SGLang tensor): every held interval they cut keeps only what lies
        outside them."""
        with self._lock:
            for ptr, size in sorted(ranges):
                end = ptr + size
                while (held := self._held.overlapping(ptr, size)) is not None:
                    start, length = held
                    self._held.remove(start)
                    if start < ptr:
                        self._held.add(start, ptr - start)
                    if start + length > end:
                        self._held.add(end, start + length - end)

    def held(self) -> tuple[tuple[int, int], ...]:
        """Every held interval as ``(ptr, size)``, by address."""
        with self._lock:
            return self._held.items()


#: What this process holds registered through hicache.
PROCESS_LEDGER = HostLedger()
