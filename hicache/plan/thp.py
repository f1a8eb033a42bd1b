"""hicache.plan.thp: the ``hugepages="auto"`` decision per piece over injected snapshots (THP
setting, free blocks, measured rates) and its brake, for the host room that maps and faults;
a face over `_thp`, pure."""

from hicache.plan._thp import (
    PieceFault,
    ThpDecision,
    ThpSnapshot,
    base_rate,
    brake_reason,
    decide_piece,
    huge_bytes_from_faults,
)

__all__ = ["PieceFault", "ThpDecision", "ThpSnapshot", "base_rate", "brake_reason", "decide_piece",
           "huge_bytes_from_faults"]
