"""The ranges this process holds registered, so an overlapping request is refused before CUDA
sees it (a double registration otherwise leaves a sticky 712 pending, sglang PR #38832).

Owns one sorted interval set per ledger, guarded by a lock. `PROCESS_LEDGER` mirrors what CUDA
holds for the whole process; tests and fakes pass their own.
"""

from __future__ import annotations

import bisect
import threading


class HostLedger:
    """Disjoint ``[ptr, ptr + size)`` intervals currently registered."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._starts: list[int] = []
        self._sizes: dict[int, int] = {}

    def overlapping(self, ptr: int, size: int) -> tuple[int, int] | None:
        """The held interval that overlaps ``[ptr, ptr + size)``, if any."""
        with self._lock:
            return self._overlap_locked(ptr, size)

    def _overlap_locked(self, ptr: int, size: int):
        index = bisect.bisect_right(self._starts, ptr)
        for neighbour in (index - 1, index):
            if 0 <= neighbour < len(self._starts):
                start = self._starts[neighbour]
                held = self._sizes[start]
                if start < ptr + size and ptr < start + held:
                    return start, held
        return None

    def claim(self, intervals) -> tuple[tuple[int, int], tuple[int, int]] | None:
        """Atomically hold every ``(ptr, size)`` of ``intervals``, or none of them.

        Returns None on success, else ``(requested, held)``: the first requested interval that
        overlaps a held one (or another requested one). Claiming before the CUDA calls makes
        two threads applying overlapping plans refuse each other instead of racing to a 712.
        """
        wanted = sorted(intervals)
        with self._lock:
            for index, (ptr, size) in enumerate(wanted):
                held = self._overlap_locked(ptr, size)
                if held is not None:
                    return (ptr, size), held
                if index and wanted[index - 1][0] + wanted[index - 1][1] > ptr:
                    return (ptr, size), wanted[index - 1]
            for ptr, size in wanted:
                bisect.insort(self._starts, ptr)
                self._sizes[ptr] = size
        return None

    def replace(self, remove_ptrs, add_intervals) -> None:
        """Atomically drop the intervals starting at ``remove_ptrs`` and hold ``add_intervals``
        (sub-ranges of what was dropped: ranges a rollback or release could not undo)."""
        with self._lock:
            for ptr in remove_ptrs:
                self._remove_locked(ptr)
            for ptr, size in add_intervals:
                bisect.insort(self._starts, ptr)
                self._sizes[ptr] = size

    def _remove_locked(self, ptr: int) -> None:
        if self._sizes.pop(ptr, None) is not None:
            del self._starts[bisect.bisect_left(self._starts, ptr)]

    def remove(self, ptr: int) -> None:
        """Drop the interval starting at ``ptr`` (no-op if none)."""
        with self._lock:
            self._remove_locked(ptr)

    def held(self) -> tuple[tuple[int, int], ...]:
        """Every held interval as ``(ptr, size)``, by address."""
        with self._lock:
            return tuple((start, self._sizes[start]) for start in self._starts)


#: What this process holds registered through hicache.
PROCESS_LEDGER = HostLedger()
