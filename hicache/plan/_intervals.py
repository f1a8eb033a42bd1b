"""`IntervalSet`: disjoint ``[start, start + size)`` byte intervals, sorted, searched by bisection.

One type for what is registered where: the process ledger keeps each registration as its own
interval (removed by its start), page readiness merges registered chunks and asks whether a
page lies inside them. Pure data: no locks (the ledger holds its own), no I/O.
"""

from __future__ import annotations

import bisect


class IntervalSet:
    """Disjoint intervals ``(start, size)``; empty intervals are never stored."""

    __slots__ = ("_starts", "_sizes")

    def __init__(self, intervals=()) -> None:
        self._starts: list[int] = []
        self._sizes: dict[int, int] = {}
        for start, size in intervals:
            self.add(start, size)

    def __len__(self) -> int:
        return len(self._starts)

    def items(self) -> tuple[tuple[int, int], ...]:
        """Every interval as ``(start, size)``, by start."""
        return tuple((start, self._sizes[start]) for start in self._starts)

    def overlapping(self, start: int, size: int) -> tuple[int, int] | None:
        """The held interval that overlaps ``[start, start + size)``, if any (the lowest)."""
        index = bisect.bisect_right(self._starts, start)
        for neighbour in (index - 1, index):
            if 0 <= neighbour < len(self._starts):
                held = self._starts[neighbour]
                length = self._sizes[held]
                if held < start + size and start < held + length:
                    return held, length
        return None

    def covers(self, start: int, size: int) -> bool:
        """True when ``[start, start + size)`` lies inside one held interval."""
        index = bisect.bisect_right(self._starts, start) - 1
        if index < 0:
            return False
        held = self._starts[index]
        return start + size <= held + self._sizes[held]

    def add(self, start: int, size: int, *, merge: bool = False) -> None:
        """Hold ``[start, start + size)``. ``merge``: join it with every interval it overlaps or
        touches; otherwise it must overlap none (ValueError naming both)."""
        if size <= 0:
            return
        if not merge:
            held = self.overlapping(start, size)
            if held is not None:
                raise ValueError(f"interval (0x{start:x}, {size}) overlaps held (0x{held[0]:x}, {held[1]})")
            bisect.insort(self._starts, start)
            self._sizes[start] = size
            return
        end = start + size
        index = bisect.bisect_left(self._starts, start)
        if index > 0:
            before = self._starts[index - 1]
            if before + self._sizes[before] >= start:  # overlaps or touches from below
                index -= 1
                start = before
                end = max(end, before + self._sizes[before])
        last = index
        while last < len(self._starts) and self._starts[last] <= end:
            held = self._starts[last]
            end = max(end, held + self._sizes.pop(held))
            last += 1
        self._sizes.pop(start, None)
        self._starts[index:last] = [start]
        self._sizes[start] = end - start

    def remove(self, start: int) -> None:
        """Drop the interval starting at ``start`` (no-op if none)."""
        if self._sizes.pop(start, None) is not None:
            del self._starts[bisect.bisect_left(self._starts, start)]
