"""``hugepages="auto"`` in the shell (issue #53 item 2): before each pre-fault piece, read the host
(THP's `enabled`, the free 2 MiB blocks of the pool's node), ask the pure rule
(`hicache.plan._thp.decide_piece`), advise a THP piece's range MADV_HUGEPAGE (the mapping is made
MADV_NOHUGEPAGE whole, so a 4 KiB piece needs no call);
after it, measure how it faulted in (seconds, and the huge pages obtained - from the faulting
thread's own page-fault count) and engage the brake for the rest of the bring-up when THP cost
more than it gave. Keeps, per buffer, the bytes each rule
decided (the report, `tiers` and metrics say which rule decided).

Every reading and the advice itself are injected (tests give snapshots and a recording
madvise); the pre-fault threads call `before`/`after` concurrently, so the state is locked.
"""

from __future__ import annotations

import mmap
import resource
import threading
import time
from typing import NamedTuple

from hicache.effects._host._libc import madvise_function
from hicache.plan.thp import (
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

MADV_HUGEPAGE = 14
MADV_NOHUGEPAGE = 15
THP_ENABLED = "/sys/kernel/mm/transparent_hugepage/enabled"


_READ = object()  # ThpAuto's huge_page_bytes default: read the kernel's (None is "not said")


class PieceToken(NamedTuple):
    """What `ThpAuto.before` hands the faulting thread for `ThpAuto.after`: the decision, the
    clock and the thread's page-fault count just before the piece faulted, and the bytes it
    was decided for (a THP piece's: promised free blocks until it ends)."""

    decision: ThpDecision
    start: float
    faults: int
    nbytes: int


def thread_faults() -> int:
    """The page faults the calling thread has taken (minor and major; 0 where the platform does
    not say). MADV_POPULATE_WRITE's faults count here as the touch fallback's do: Linux counts
    faults taken for get_user_pages on the thread that takes them (mm_account_fault)."""
    try:
        usage = resource.getrusage(resource.RUSAGE_THREAD)
    except (AttributeError, OSError):
        return 0
    return usage.ru_minflt + usage.ru_majflt


def _read_enabled(root: str = "/") -> str | None:
    from hicache.effects._host._probes import _read, _selected

    return _selected(_read(root, THP_ENABLED))


def _madvise_range(ptr: int, length: int, *, huge: bool) -> bool:
    """MADV_HUGEPAGE / MADV_NOHUGEPAGE over the whole pages inside [ptr, ptr + length) (a piece
    may start mid-page where a plan gave up page alignment); False if the kernel refused."""
    import mmap

    page = mmap.PAGESIZE
    start, end = -(-ptr // page) * page, (ptr + length) // page * page
    if end <= start:
        return True
    return madvise_function()(start, end - start, MADV_HUGEPAGE if huge else MADV_NOHUGEPAGE) == 0


class ThpAuto:
    """One bring-up's ``auto`` THP policy. ``node``: the pool's NUMA node (None: all nodes);
    ``enabled()``, ``free_blocks()`` (free 2 MiB blocks), ``madvise(ptr, length, huge=)``,
    ``faults()`` (the calling thread's page faults so far, `thread_faults`): the host, read or
    changed (defaults: the real ones); ``page_bytes``: the base page (default the OS's);
    ``huge_page_bytes``: a transparent huge page's size (default: the kernel's
    ``hpage_pmd_size``); ``clock``: seconds, for each piece's rate (default `time.perf_counter`)."""

    def __init__(self, *, node: int | None = None, enabled=None, free_blocks=None, madvise=None, faults=None,
                 page_bytes: int = mmap.PAGESIZE, huge_page_bytes=_READ, root: str = "/",
                 clock=time.perf_counter) -> None:
        from hicache.effects._host._probes import free_2mib_blocks, thp_page_bytes

        self._clock = clock
        self._enabled = enabled if enabled is not None else (lambda: _read_enabled(root))
        self._free_blocks = free_blocks if free_blocks is not None else (
            lambda: free_2mib_blocks(root=root, node=node, page_bytes=page_bytes))
        self.huge_page_bytes = thp_page_bytes(root=root) if huge_page_bytes is _READ else huge_page_bytes
        self._madvise = madvise if madvise is not None else _madvise_range
        self._faults = faults if faults is not None else thread_faults
        self._page_bytes = page_bytes
        self._lock = threading.Lock()
        self.enabled = self._enabled()  # read once: a bring-up does not outlive a sysfs change we act on
        self.brake: str | None = None  # why THP was turned off for the rest of the bring-up
        self._base: list[PieceFault] = []  # this bring-up's 4 KiB pieces: the rate a THP piece is held to
        self._promised = 0  # bytes of THP pieces in flight: free blocks they will take
        self._reference = False  # a 4 KiB reference piece has been handed out
        self._unjudged: list[PieceFault] = []  # THP pieces that ended before the reference: judged by it
        self._trying = False  # the one THP piece THP is tried with is out, without a verdict yet
        self._proven = False  # a THP piece was judged against the 4 KiB rate and passed
        self.rules: dict[int, dict[str, int]] = {}  # buffer index -> rule -> bytes it decided

    def before(self, index: int, ptr: int, length: int):
        """Decide and advise the piece ``[ptr, ptr + length)`` of buffer ``index`` just before it
        faults, from the thread that will fault it; returns a `PieceToken` to hand to `after`
        once it has."""
        with self._lock:
            brake, promised, reference = self.brake, self._promised, not self._reference
            self._reference = True  # the first piece asked is the reference, whatever threads race here
        free = None
        if brake is None and self.enabled in THP_USABLE and size_taken(self.huge_page_bytes) and not reference:
            blocks = self._free_blocks()  # /proc/buddyinfo, read only where a rule after THP's setting and size needs it
            free = None if blocks is None else max(0, blocks * 2 * 2**20 - promised)
        with self._lock:  # decided under the lock: two threads must not both take the one trial piece
            decision = decide_piece(ThpSnapshot(self.enabled, free, self.huge_page_bytes), length, brake=brake,
                                    reference=reference, trial=self._trying)
            self._trying = self._trying or (decision.huge and not self._proven)  # never once proven
        # only a THP piece is advised: an auto mapping is made MADV_NOHUGEPAGE whole, and each
        # piece faults once - advising a 4 KiB piece again took the mmap lock for writing between
        # the other threads' pre-fault calls for nothing (2 GiB bring-up here: 0.58x -> 0.70x of by hand)
        if decision.huge and not self._madvise(ptr, length, huge=True):  # refused: the range stays 4 KiB
            with self._lock:
                self._trying = False  # nothing was tried: the next piece may be
            decision = decision._replace(huge=False, rule="thp-off", reason="madvise(MADV_HUGEPAGE) refused")
        with self._lock:
            if decision.huge:
                self._promised += length
            counts = self.rules.setdefault(index, {})
            counts[decision.rule] = counts.get(decision.rule, 0) + length
        return PieceToken(decision, self._clock(), self._faults(), length)

    def fault(self, index: int, ptr: int, length: int, populate) -> None:
        """Decide, fault and judge the piece ``[ptr, ptr + length)`` of buffer ``index`` on the
        calling thread; ``populate(offset, nbytes)`` faults that part of it. A THP piece faults
        in steps (`thp_steps`: one huge page, then to each 8 MiB boundary): where its steps so
        far run far slower than 4 KiB pages (`early_brake_reason`), or another piece has
        engaged the brake meanwhile, the brake holds from there - the rest of the piece is
        advised back to 4 KiB pages and counted under the rule ``brake``."""
        token = self.before(index, ptr, length)
        steps = thp_steps(length) if token.decision.huge else [length]
        done = steps[0]
        populate(0, done)
        for step in steps[1:]:
            if self._stops_thp(token, done):
                break
            populate(done, step)
            done += step
        self.after(index, ptr, done, token)
        if done == length:
            return
        self._madvise(ptr + done, length - done, huge=False)  # best effort: refused, the rest faults as advised
        with self._lock:
            self.rules[index][token.decision.rule] -= length - done  # counted again under the brake
        rest = self.before(index, ptr + done, length - done)
        populate(done, length - done)
        self.after(index, ptr + done, length - done, rest)

    def _stops_thp(self, token: PieceToken, done: int) -> bool:
        """Whether a THP piece stops THP after its first ``done`` bytes: the brake is engaged
        (by another piece, or now by the early verdict on these bytes)."""
        seconds = self._clock() - token.start
        with self._lock:
            if self.brake is None:
                self.brake = early_brake_reason(PieceFault(done, seconds, True, None), base_rate(self._base))
            return self.brake is not None

    def after(self, index: int, ptr: int, length: int, token: PieceToken) -> None:
        """Record how the piece faulted in (from the thread that faulted it: its fault count is
        the piece's); a THP piece slower than 4 KiB pages or mostly without huge pages engages
        the brake."""
        faults, seconds = self._faults() - token.faults, self._clock() - token.start
        decision = token.decision
        huge_bytes = huge_bytes_from_faults(length, faults, page_bytes=self._page_bytes) if decision.huge else 0
        fault = PieceFault(length, seconds, decision.huge, huge_bytes)
        with self._lock:
            if decision.huge:
                self._promised -= token.nbytes
            else:
                self._base.append(fault)
            rate = base_rate(self._base)
            if decision.huge and rate is None:  # faulted before the reference: judged once it is
                self._unjudged.append(fault)
            judged = [fault] if rate is None else [*self._unjudged, fault]
            for piece in judged:
                if self.brake is None:
                    self.brake = brake_reason(piece, rate)
            if rate is not None:
                if any(piece.huge for piece in judged):  # a THP piece has its verdict: the trial is over
                    self._trying = False
                    self._proven = self._proven or self.brake is None
                self._unjudged = []

    def summary(self) -> dict:
        """``{buffer index: {rule: bytes}}`` and the brake's reason, for the report."""
        with self._lock:
            return {"rules": {index: dict(counts) for index, counts in self.rules.items()}, "brake": self.brake}
