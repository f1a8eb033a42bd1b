"""`Range`: one registration call's byte interval, relative to a buffer's base.

Owns only the value type and its own invariants (non-negative offset, positive size, end below
2**63). A tuple underneath - frozen, ordered by (offset, size), and cheap: planners build tens of
thousands of them (a 64 TiB pool at 1 GiB chunks is 65,536 ranges), and an attrs class costs
several times more per instance. Pure: imports hicache.errors only.
"""

from __future__ import annotations

import operator
from collections.abc import Sequence
from itertools import chain, repeat
from typing import NamedTuple

from hicache.errors import PlanError
from hicache.plan.checks import MAX_BYTES, check_int


class _RangeFields(NamedTuple):
    offset: int
    size: int


class Range(_RangeFields):
    """``[offset, offset + size)`` bytes from a buffer's base; frozen, ordered by offset."""

    __slots__ = ()

    def __new__(cls, offset: int, size: int) -> "Range":
        if not (type(offset) is int and type(size) is int and offset >= 0 and size > 0):
            offset = check_int(PlanError, "Range", "offset", offset, minimum=0)
            size = check_int(PlanError, "Range", "size", size)
        if offset + size > MAX_BYTES:
            raise PlanError(f"Range ends past 2**63 - 1: offset={offset} size={size}")
        return tuple.__new__(cls, (offset, size))

    @property
    def end(self) -> int:
        """One past the last byte: ``offset + size``."""
        return self[0] + self[1]

    def _replace(self, **changes) -> "Range":
        return Range(changes.get("offset", self[0]), changes.get("size", self[1]))

    def __str__(self) -> str:
        return f"[{self[0]}, {self[0] + self[1]})"


class Tiling(Sequence):
    """Ranges the planner tiled as offsets ``0, step, 2*step, ...`` (the last one maybe
    shorter), known by construction: a plan checks them by arithmetic on ``step`` and
    ``total`` instead of walking every range, and holds no Range objects - each is made when
    read (a 64 TiB plan at 1 GiB chunks is 65,536 of them; kept alive, tuple subclasses are never
    untracked by the garbage collector and cost a full collection of a server's heap, ~100 ms
    with torch imported). Compares, hashes and concatenates as the plain tuple."""

    __slots__ = ("step", "total", "_count")

    def __init__(self, total: int, step: int) -> None:
        self.step, self.total = step, total
        self._count = -(-total // step) if total > 0 else 0

    def __len__(self) -> int:
        return self._count

    def _at(self, index: int) -> Range:
        offset = index * self.step
        return tuple.__new__(Range, (offset, min(self.step, self.total - offset)))

    def __getitem__(self, index):
        if isinstance(index, slice):
            return tuple(self._at(i) for i in range(*index.indices(self._count)))
        index = operator.index(index)
        if index < 0:
            index += self._count
        if not 0 <= index < self._count:
            raise IndexError("Tiling index out of range")
        return self._at(index)

    def __iter__(self):
        whole = min(self.total // self.step, self._count)  # ranges of a full step
        pieces = zip(range(0, whole * self.step, self.step), repeat(self.step))
        if whole < self._count:
            last = whole * self.step
            pieces = chain(pieces, ((last, self.total - last),))
        return map(tuple.__new__, repeat(Range), pieces)

    def __reversed__(self):
        return (self._at(i) for i in range(self._count - 1, -1, -1))

    def __eq__(self, other) -> bool:
        if isinstance(other, Tiling):
            return (self._count, self.total) == (other._count, other.total) and (
                self._count <= 1 or self.step == other.step)
        if isinstance(other, tuple):
            return len(other) == self._count and tuple(self) == other
        return NotImplemented

    def __hash__(self) -> int:
        return hash(tuple(self))

    def __add__(self, other) -> tuple:
        return tuple(self) + tuple(other)

    def __radd__(self, other) -> tuple:
        return tuple(other) + tuple(self)

    def __repr__(self) -> str:
        return f"Tiling(total={self.total}, step={self.step}, {self._count} ranges)"


def tiling(total: int, step: int) -> Tiling:
    """``[0, total)`` in ranges of ``step`` bytes (the last one what is left); unchecked input."""
    return Tiling(total, step)
