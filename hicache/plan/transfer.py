"""hicache.plan.transfer: which engine moves a batch of pieces (the measured table, ``HICACHE_TRANSFER``'s
modes, the device engine's default program count), for the copy engine and ``hicache doctor``;
a face over `_transfer`, pure."""

from hicache.plan._transfer import DEFAULT_PROGRAMS, GATHER_RUNNERS, MAX_PROGRAMS, TRANSFER_MODES, choose_engine

__all__ = ["DEFAULT_PROGRAMS", "GATHER_RUNNERS", "MAX_PROGRAMS", "TRANSFER_MODES", "choose_engine"]
