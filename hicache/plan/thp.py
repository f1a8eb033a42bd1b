"""hicache.plan.thp: the ``hugepages="auto"`` decision per piece over injected snapshots (THP
setting, free blocks, measured rates) and its brake, for the host room that maps and faults;
a face over `_thp`, pure."""

from hicache.plan._thp import (
    THP_STEP_BYTES,
    THP_USABLE,
    PieceFault,
    ThpDecision,
    ThpSnapshot,
    base_rate,
    brake_reason,
    decide_piece,
    early_brake_reason,
    huge_bytes_from_faults,
    size_taken,
    thp_steps,
)

__all__ = ["THP_STEP_BYTES", "THP_USABLE", "PieceFault", "ThpDecision", "ThpSnapshot", "base_rate", "brake_reason",
           "decide_piece", "early_brake_reason", "huge_bytes_from_faults", "size_taken", "thp_steps"]
