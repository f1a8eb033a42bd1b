"""`Range`: one registration call's byte interval, relative to a buffer's base.

Owns only the value type and its own invariants (non-negative offset, positive size, end below
2**63). A tuple underneath - frozen, ordered by (offset, size), and cheap: planners build tens of
thousands of them (a 64 TiB pool at 1 GiB chunks is 65,536 ranges), and an attrs class costs
several times more per instance. Pure: imports hicache.errors only.
"""

from __future__ import annotations

from itertools import repeat
from typing import NamedTuple

from hicache.errors import PlanError
from hicache.plan._checks import MAX_BYTES, check_int


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


def trusted_ranges(offsets_and_sizes) -> tuple[Range, ...]:
    """Build ranges the caller has already proven valid (the planner's tiling), unchecked."""
    return tuple(map(tuple.__new__, repeat(Range), offsets_and_sizes))
