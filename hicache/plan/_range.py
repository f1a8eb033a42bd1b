"""`Range`: one registration call's byte interval, relative to a buffer's base.

Owns only the value type and its own invariants (non-negative offset, positive size, end below
2**63). A tuple underneath - frozen, ordered by (offset, size), and cheap: planners build tens of
thousands of them (a 64 TiB pool at 1 GiB chunks is 65,536 ranges), and an attrs class costs
several times more per instance. Pure: imports hicache.errors only.
"""

from __future__ import annotations

import gc
from functools import wraps
from itertools import chain, repeat
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


class Tiling(tuple):
    """Ranges the planner tiled as offsets ``0, step, 2*step, ...`` (the last one maybe
    shorter), known by construction: a plan checks them by arithmetic on ``step`` and
    ``total`` instead of walking every range. Compares and hashes as the plain tuple."""

    step: int
    total: int


def tiling(total: int, step: int) -> Tiling:
    """``[0, total)`` in ranges of ``step`` bytes (the last one what is left); unchecked input."""
    full = total // step * step
    pieces = zip(range(0, full, step), repeat(step))
    if full < total:
        pieces = chain(pieces, ((full, total - full),))
    result = Tiling(map(tuple.__new__, repeat(Range), pieces))
    result.step, result.total = step, total
    return result


def collector_paused(func):
    """Run ``func`` with Python's cyclic garbage collector paused (then restored as it was).

    A plan builds up to tens of thousands of small tuples in one go; in a process with a large
    heap (torch imported: an SGLang server) those allocations trigger a full collection that
    walks the whole heap - 64 TiB at 1 GiB chunks took 100+ ms instead of ~25 ms. Ranges hold
    no reference cycles, so nothing is lost by not collecting while they are built.
    """

    @wraps(func)
    def paused(*args, **kwargs):
        was_enabled = gc.isenabled()
        gc.disable()
        try:
            return func(*args, **kwargs)
        finally:
            if was_enabled:
                gc.enable()

    return paused
