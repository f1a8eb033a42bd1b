"""``hugepages="auto"`` (issue #53 item 2): the pure per-piece rule as a table over injected THP
settings, free-block snapshots and measured piece rates; the pre-fault applying it piece by piece
(a fake host: recorded madvise, scripted clock) with the brake switching the remaining pieces
to MADV_NOHUGEPAGE and the report naming why; the default everywhere it is promised."""

from __future__ import annotations

import mmap
import os
from types import SimpleNamespace

import pytest
from hypothesis import given
from hypothesis import strategies as st

from hicache.plan._thp import (
    EARLY_MARGIN,
    PROBE_MARGIN,
    RULES,
    THP_BYTES,
    THP_PROBE_BYTES,
    THP_STEP_BYTES,
    PieceFault,
    ThpSnapshot,
    base_rate,
    brake_reason,
    decide_piece,
    early_brake_reason,
    huge_bytes_from_faults,
    thp_steps,
)
from hicache.effects._host import _thp
from hicache.effects._host._memory import allocate_host, prefault

MiB = 2**20
PIECE = 64 * MiB


@pytest.mark.parametrize("enabled, free, brake, reference, trial, huge, rule", [
    ("madvise", 100 * PIECE, None, False, False, True, "free"),  # free blocks cover it
    ("always", PIECE, None, False, False, True, "free"),  # exactly covered
    ("madvise", PIECE - THP_BYTES, None, False, False, False, "no-free-blocks"),  # fragmented: would compact
    ("madvise", 0, None, False, False, False, "no-free-blocks"),
    ("never", 100 * PIECE, None, False, False, False, "thp-off"),
    (None, 100 * PIECE, None, False, False, False, "thp-off"),  # unreadable setting
    ("madvise", None, None, False, False, False, "unknown-free-blocks"),
    ("madvise", 100 * PIECE, "a THP piece was slow", False, False, False, "brake"),  # engaged mid-way: sticky
    ("never", 100 * PIECE, "a THP piece was slow", False, False, False, "brake"),  # the brake is named first
    ("madvise", 100 * PIECE, None, True, False, False, "reference"),  # the first piece: the 4 KiB yardstick
    ("never", 100 * PIECE, None, True, False, False, "thp-off"),  # no yardstick needed without THP
    ("madvise", 100 * PIECE, None, False, True, False, "trial"),  # one THP piece awaits its verdict
    ("madvise", 0, None, False, True, False, "no-free-blocks"),  # no THP to try: the blocks are named
    ("madvise", 100 * PIECE, None, True, True, False, "reference"),
])
def test_each_rule_decides_its_own_pieces(enabled, free, brake, reference, trial, huge, rule):
    """decide_piece over injected snapshots: THP only where the node's free 2 MiB blocks cover
    the piece, THP is usable and no untried THP piece is out, the brake and the reference before
    everything else, each decision naming a rule of RULES and its figures."""
    decision = decide_piece(ThpSnapshot(enabled, free), PIECE, brake=brake, reference=reference, trial=trial)
    assert (decision.huge, decision.rule) == (huge, rule) and rule in RULES and decision.reason
    if rule == "thp-off":
        assert decision.reason == f"THP enabled: {enabled or 'unreadable'}"


@pytest.mark.parametrize("huge_page, huge, rule", [
    (THP_BYTES, True, "free"),  # x86-64, 4 KiB-page arm64
    (None, True, "free"),  # unreadable: the 2 MiB every x86-64 kernel maps
    (512 * MiB, False, "thp-size"),  # arm64 with 64 KiB base pages (Grace kernels)
    (32 * MiB, False, "thp-size"),  # arm64 with 16 KiB base pages
])
def test_auto_takes_thp_only_where_a_huge_page_is_2_mib(huge_page, huge, rule):
    """Every rule and rate auto holds THP to is 2 MiB's: where the kernel's THP is another size
    (512 MiB under 64 KiB base pages) auto keeps base pages and says the size, whatever the
    free blocks; the brake and a THP that is off are still named first."""
    decision = decide_piece(ThpSnapshot("madvise", 100 * PIECE, huge_page), PIECE)
    assert (decision.huge, decision.rule) == (huge, rule)
    if rule == "thp-size":
        assert f"{huge_page // MiB} MiB" in decision.reason
    assert decide_piece(ThpSnapshot("never", 100 * PIECE, 512 * MiB), PIECE).rule == "thp-off"
    assert decide_piece(ThpSnapshot("madvise", 100 * PIECE, 512 * MiB), PIECE, brake="slow").rule == "brake"


@pytest.mark.parametrize("fault, rate_4k, engaged", [
    (PieceFault(PIECE, 0.01, True, PIECE), 2e9, False),  # 6.7 GB/s, all huge
    (PieceFault(PIECE, 0.1, True, PIECE), 2e9, True),  # 0.67 GB/s: slower than 4 KiB pages
    (PieceFault(PIECE, 0.1, True, PIECE), None, False),  # no 4 KiB piece measured yet: not judged by rate
    (PieceFault(PIECE, 0.01, True, PIECE // 4), 2e9, True),  # mostly 4 KiB pages anyway
    (PieceFault(PIECE, 0.01, True, PIECE // 2), 2e9, False),  # half is enough
    (PieceFault(PIECE, 0.01, True, None), 2e9, False),  # huge pages unread: the rate alone
    (PieceFault(MiB, 0.0001, True, 0), 2e9, False),  # under one 2 MiB page: no huge page possible
    (PieceFault(PIECE, 1.0, False, 0), 2e9, False),  # a 4 KiB piece never engages it
    (PieceFault(PIECE, PIECE / 2**31, True, PIECE), 2.0**31, False),  # exactly the 4 KiB rate: not slower
    (PieceFault(PIECE, 0.0, True, PIECE), 2e9, False),  # no time measured (a coarse clock): no rate, no verdict
    (PieceFault(THP_BYTES, 0.0001, True, 0), 2e9, True),  # one 2 MiB page's worth, none of it huge
])
def test_the_brake_engages_on_a_slow_or_mostly_small_thp_piece(fault, rate_4k, engaged):
    """brake_reason: a THP piece slower than this bring-up's 4 KiB rate, or with under half its
    bytes in huge pages, engages the brake, and the reason gives the figures."""
    reason = brake_reason(fault, rate_4k)
    assert (reason is not None) == engaged
    if engaged:
        assert "GB/s" in reason or "huge pages" in reason


@given(st.sampled_from([(4096, THP_BYTES), (16384, 32 * MiB), (65536, 512 * MiB)]),
       st.integers(min_value=0, max_value=8192), st.integers(min_value=0, max_value=1 << 22))
def test_the_huge_bytes_of_a_piece_follow_from_its_fault_count(sizes, huge, base):
    """huge_bytes_from_faults: a fresh range faulted as ``huge`` huge pages and ``base`` base pages
    (one fault each, in any page sizes a kernel pairs) gives back exactly the huge pages' bytes;
    no fault counted gives None (unknown), never a guess."""
    page, huge_page = sizes
    nbytes = huge * huge_page + base * page
    expected = None if huge + base == 0 else huge * huge_page
    assert huge_bytes_from_faults(nbytes, huge + base, page_bytes=page, huge_page_bytes=huge_page) == expected


@pytest.mark.parametrize("nbytes, faults, expected", [
    (32 * MiB, 0, None),  # the kernel counted nothing: unknown
    (32 * MiB, 8192 + 40, 0),  # a few more faults than pages (the thread's own): all 4 KiB, not negative
    (32 * MiB, 1, 16 * THP_BYTES),  # fewer faults than huge pages (some already resident): at most the range
])
def test_a_fault_count_out_of_its_law_is_clamped_or_unknown(nbytes, faults, expected):
    """huge_bytes_from_faults stays within [0, the range] when the count strays from the law."""
    assert huge_bytes_from_faults(nbytes, faults, page_bytes=4096) == expected


@pytest.mark.parametrize("seconds, rate_4k, engaged", [
    (0.0175, 3.4e9, True),  # this VM's slow huge pages: 0.48 GB/s, 7x under the 4 KiB rate
    (0.0025, 3.4e9, False),  # a healthy THP step
    (0.008, 3.4e9, False),  # 1.05 GB/s: slower than 4 KiB pages, but within the margin - the whole piece decides
    (8 * MiB / (3.4e9 / EARLY_MARGIN) * 1.01, 3.4e9, True),  # just past the margin
    (8 * MiB / (3.4e9 / EARLY_MARGIN) * 0.99, 3.4e9, False),  # just within it
    (0.0175, None, False),  # no 4 KiB piece measured yet: no early verdict
    (8 * MiB * EARLY_MARGIN / 2**33, 2.0**33, False),  # exactly EARLY_MARGIN times slower: within it
    (0.0, 3.4e9, False),  # no time measured (a coarse clock): no rate, no verdict
])
def test_the_early_verdict_brakes_only_a_thp_step_far_slower_than_4k(seconds, rate_4k, engaged):
    """early_brake_reason on a THP piece's first 8 MiB: only more than EARLY_MARGIN times slower
    than the 4 KiB rate brakes mid-piece (a short step is noisy; milder cases wait for the whole
    piece), and the reason gives the figures."""
    reason = early_brake_reason(PieceFault(8 * MiB, seconds, True, None), rate_4k)
    assert (reason is not None) == engaged
    assert reason is None or ("GB/s" in reason and "first 8 MiB" in reason)


def test_the_early_verdict_never_judges_a_4k_piece():
    """early_brake_reason on a 4 KiB piece however slow: None (only THP steps are judged early)."""
    assert early_brake_reason(PieceFault(8 * MiB, 10.0, False, None), 3.4e9) is None


@pytest.mark.parametrize("seconds, engaged", [
    (0.015, True),  # this VM's huge pages on blocks its hypervisor took back: 0.14 GB/s, 24x under
    (0.0006, False),  # a healthy huge page (3.4 GB/s a thread)
    (0.004, False),  # 0.52 GB/s: 6.5x slower, over the 8 MiB margin but within the probe's
    (2 * MiB / (3.4e9 / PROBE_MARGIN) * 1.01, True),  # just past the probe's margin
    (2 * MiB / (3.4e9 / PROBE_MARGIN) * 0.99, False),  # just within it
])
def test_the_probe_step_brakes_only_a_huge_page_far_slower_than_4k(seconds, engaged):
    """early_brake_reason on a THP piece's first huge page alone: the wider PROBE_MARGIN holds
    (a short step is noisier), and the reason names the probe's 2 MiB and its margin."""
    reason = early_brake_reason(PieceFault(THP_PROBE_BYTES, seconds, True, None), 3.4e9)
    assert (reason is not None) == engaged
    assert reason is None or ("first 2 MiB" in reason and f"1/{PROBE_MARGIN:.0f}" in reason)


@given(length=st.integers(1, 96 * MiB))
def test_thp_steps_probe_one_huge_page_then_reach_every_8_mib_boundary(length):
    """thp_steps: the steps cover the piece exactly, the first is one huge page (or the whole of
    a shorter piece), and every verdict after it falls on a THP_STEP_BYTES boundary or the end."""
    steps = thp_steps(length)
    assert sum(steps) == length and all(step > 0 for step in steps)
    assert steps[0] == min(THP_PROBE_BYTES, length)
    ends = [sum(steps[: i + 1]) for i in range(len(steps))]
    assert all(end % THP_STEP_BYTES == 0 or end == length for end in ends[1:])
    assert all(step <= THP_STEP_BYTES for step in steps)


def test_the_4k_rate_is_the_median_of_this_bring_ups_4k_pieces():
    """base_rate: the median of the measured 4 KiB pieces' rates; None before any."""
    assert base_rate([]) is None
    faults = [PieceFault(PIECE, s, False, 0) for s in (0.1, 0.02, 0.05)]
    assert base_rate(faults) == PIECE / 0.05
    five = [PieceFault(PIECE, s, False, 0) for s in (0.5, 0.1, 0.4, 0.2, 0.3)]
    assert base_rate(five) == PIECE / 0.3


def test_the_4k_rate_leaves_out_pieces_without_a_measured_time_or_bytes():
    """base_rate: a piece of no measured time (a coarse clock) or of no bytes has no rate and
    does not count - never a division by zero, never a rate of 0 that would brake every THP piece."""
    assert base_rate([PieceFault(PIECE, 0.0, False, 0)]) is None
    assert base_rate([PieceFault(0, 0.0, False, 0), PieceFault(0, 0.1, False, 0)]) is None
    faults = [PieceFault(PIECE, 0.0, False, 0), PieceFault(0, 0.1, False, 0), PieceFault(PIECE, 0.05, False, 0)]
    assert base_rate(faults) == PIECE / 0.05


class _Host:
    """A fake host for ThpAuto: THP setting, free 2 MiB blocks, a madvise log, a page-fault count
    that a faulted piece advances as the kernel would (``huge_share`` of a THP piece in huge
    pages, one fault each, the rest one fault per 4 KiB), and a clock each piece's scripted
    seconds advance."""

    def __init__(self, *, enabled="madvise", blocks=10**6, seconds=(), huge_share=1.0, huge_page=THP_BYTES):
        self.enabled, self.blocks, self.huge_share, self.huge_page = enabled, blocks, huge_share, huge_page
        self.count = 0  # page faults taken
        self.advice: list = []  # (ptr, length, huge)
        self.now, self.seconds = 0.0, list(seconds)
        self.started: dict = {}

    def madvise(self, ptr, length, *, huge):
        self.advice.append((ptr, length, huge))
        return True

    def clock(self):
        return self.now

    def faults(self):
        return self.count

    def fault(self, length, *, huge):
        """A fresh piece of ``length`` faults in: one fault per huge page it gets, one per 4 KiB page."""
        huge_pages = int(length * self.huge_share) // THP_BYTES if huge else 0
        self.count += huge_pages + (length - huge_pages * THP_BYTES) // 4096

    def policy(self):
        return _thp.ThpAuto(enabled=lambda: self.enabled, free_blocks=lambda: self.blocks, madvise=self.madvise,
                            faults=self.faults, page_bytes=4096, huge_page_bytes=self.huge_page, clock=self.clock)


def _fault(policy, host, pieces):
    """Fault ``pieces`` (one thread, in order) as the Prefaulter does: before, the piece's seconds
    pass on the host's clock, after."""
    for index, (ptr, length) in enumerate(pieces):
        token = policy.before(0, ptr, length)
        host.fault(length, huge=token.decision.huge)
        host.now += host.seconds[index] if index < len(host.seconds) else 0.01
        policy.after(0, ptr, length, token)


def test_a_slow_thp_piece_brakes_every_later_piece_to_4k_and_the_summary_says_why():
    """Piece 0 is the 4 KiB reference (6.7 GB/s), piece 1 gets THP and faults at 0.67 GB/s: the
    brake engages, and pieces 2-5 keep the mapping's MADV_NOHUGEPAGE (only piece 1 is advised
    MADV_HUGEPAGE); the summary counts each rule's bytes and gives the brake's figures."""
    host = _Host(seconds=[0.01, 0.1, 0.01, 0.01, 0.01, 0.01])
    policy = host.policy()
    pieces = [(i * PIECE, PIECE) for i in range(6)]
    _fault(policy, host, pieces)
    assert host.advice == [(PIECE, PIECE, True)]
    summary = policy.summary()
    assert summary["rules"] == {0: {"reference": PIECE, "free": PIECE, "brake": 4 * PIECE}}
    assert "below the 4 KiB rate of 6.71 GB/s" in summary["brake"]


def test_a_healthy_host_gets_thp_for_every_piece_after_the_reference():
    """THP faster than the reference and fully huge: every piece after the first is advised
    MADV_HUGEPAGE (the reference needs no call); no brake."""
    host = _Host(seconds=[0.02] + [0.01] * 5)
    policy = host.policy()
    _fault(policy, host, [(i * PIECE, PIECE) for i in range(6)])
    assert host.advice == [(i * PIECE, PIECE, True) for i in range(1, 6)]
    assert policy.summary() == {"rules": {0: {"reference": PIECE, "free": 5 * PIECE}}, "brake": None}


def test_a_host_whose_huge_pages_are_512_mib_keeps_every_piece_on_base_pages():
    """arm64 with 64 KiB base pages maps 512 MiB transparent huge pages: auto advises no piece
    MADV_HUGEPAGE, however many free blocks there are, and the summary names the size rule
    for every byte - the reference included, since no THP piece will need its rate."""
    host = _Host(huge_page=512 * MiB)
    policy = host.policy()
    _fault(policy, host, [(i * PIECE, PIECE) for i in range(4)])
    assert host.advice == []
    assert policy.summary() == {"rules": {0: {"thp-size": 4 * PIECE}}, "brake": None}


def test_auto_counts_the_free_blocks_by_this_hosts_page_size(tmp_path):
    """ThpAuto reads /proc/buddyinfo with its base page: on 64 KiB pages order 5 is a 2 MiB block
    (order 9 is 32 MiB), so 7 + 3 * 16 + 1 * 32 blocks are free, and the decision says so."""
    (tmp_path / "proc").mkdir()
    orders = [0] * 11
    orders[5], orders[9], orders[10] = 7, 3, 1
    (tmp_path / "proc/buddyinfo").write_text("Node 0, zone   Normal " + " ".join(map(str, orders)) + "\n")
    policy = _thp.ThpAuto(root=str(tmp_path), enabled=lambda: "madvise", madvise=lambda *a, **k: True,
                          faults=lambda: 0, page_bytes=64 * 1024, huge_page_bytes=THP_BYTES)
    policy.before(0, 0, PIECE)  # the reference
    assert policy.before(0, PIECE, PIECE).decision.reason.startswith("87 free 2 MiB blocks")


def test_pieces_in_flight_count_against_the_free_blocks():
    """Free blocks for one piece: two pieces started together do not both get THP (the first
    one's blocks are promised until it has faulted)."""
    host = _Host(blocks=PIECE // THP_BYTES)
    policy = host.policy()
    reference = policy.before(0, 0, PIECE)
    first = policy.before(0, PIECE, PIECE)
    second = policy.before(0, 2 * PIECE, PIECE)
    assert (first[0].rule, second[0].rule) == ("free", "no-free-blocks")
    host.now += 0.01
    policy.after(0, PIECE, PIECE, first)
    host.now += 0.01
    policy.after(0, 0, PIECE, reference)  # slower than the THP piece: THP is proven, no trial left
    assert policy.before(0, 3 * PIECE, PIECE)[0].rule == "free"  # given back once it faulted


def test_a_refused_madvise_falls_back_to_4k_and_says_so():
    """A kernel refusing MADV_HUGEPAGE: the piece is advised 4 KiB instead and counted as such;
    nothing was tried, so the next piece may try THP (it is not held as a trial in flight)."""
    host, refusing = _Host(), [True]
    host.madvise = lambda ptr, length, *, huge: not (huge and refusing[0])
    policy = host.policy()
    policy.before(0, 0, PIECE)
    decision = policy.before(0, PIECE, PIECE).decision
    assert (decision.huge, decision.rule, decision.reason) == (False, "thp-off", "madvise(MADV_HUGEPAGE) refused")
    refusing[0] = False
    assert policy.before(0, 2 * PIECE, PIECE).decision.rule == "free"


@pytest.mark.parametrize("enabled, brake, pieces_before, reads", [
    ("madvise", None, 1, 1),  # a piece after the reference: the blocks decide
    ("madvise", None, 0, 0),  # the reference piece: 4 KiB whatever the blocks
    ("never", None, 1, 0),  # THP off: no rule after it needs the blocks
    ("madvise", "slow", 1, 0),  # the brake holds: likewise
])
def test_the_free_blocks_are_read_only_where_a_rule_needs_them(enabled, brake, pieces_before, reads):
    """ThpAuto.before reads /proc/buddyinfo (the injected free_blocks) only for a piece whose
    decision depends on it - not for the reference piece, under THP never or under the brake:
    a read is a walk of every zone's free lists, on a pre-fault thread."""
    host, calls = _Host(enabled=enabled), []
    policy = _thp.ThpAuto(enabled=lambda: host.enabled, free_blocks=lambda: calls.append(1) or host.blocks,
                          madvise=host.madvise, faults=host.faults, page_bytes=4096, huge_page_bytes=THP_BYTES,
                          clock=host.clock)
    for n in range(pieces_before):
        policy.after(0, n * PIECE, PIECE, policy.before(0, n * PIECE, PIECE))
    calls.clear()
    policy.brake = brake
    policy.before(0, 4 * PIECE, PIECE)
    assert len(calls) == reads


def _mapping_of(addr: int):
    """(low, high, VmFlags) of this process's mapping that holds ``addr`` (/proc/self/smaps)."""
    found = None
    with open("/proc/self/smaps") as smaps:
        for line in smaps:
            head = line.split()[0]
            if "-" in head and not head.endswith(":"):
                low, high = (int(x, 16) for x in head.split("-"))
                found = (low, high) if low <= addr < high else None
            elif found and line.startswith("VmFlags:"):
                return (*found, line.split()[1:])
    raise AssertionError(f"no mapping holds {addr:#x}")


@pytest.mark.skipif(not os.path.exists(_thp.THP_ENABLED), reason="this kernel has no THP: MADV_HUGEPAGE is refused")
def test_the_advice_marks_exactly_the_whole_pages_inside_its_range(monkeypatch):
    """_madvise_range on this kernel: MADV_HUGEPAGE marks exactly the whole pages inside the
    range (VmFlags "hg"; the mapping splits at their ends), MADV_NOHUGEPAGE marks them "nh" again;
    a range holding no whole page makes no call and succeeds."""
    page = mmap.PAGESIZE
    buffer = allocate_host(8 * MiB, hugepages="auto")  # "nh" whole
    try:
        start = buffer.ptr + 2 * MiB
        assert _thp._madvise_range(start + 100, 2 * MiB, huge=True)  # whole pages: [start + page, start + 2 MiB)
        low, high, flags = _mapping_of(start + page)
        assert (low, high) == (start + page, start + 2 * MiB) and "hg" in flags and "nh" not in flags
        assert "nh" in _mapping_of(start)[2] and "nh" in _mapping_of(start + 2 * MiB)[2]
        assert _thp._madvise_range(start + page, 2 * MiB - page, huge=False)
        assert "nh" in _mapping_of(start + page)[2] and "hg" not in _mapping_of(start + page)[2]
        calls = []
        monkeypatch.setattr(_thp, "madvise_function", lambda: lambda *args: calls.append(args) or 0)
        assert _thp._madvise_range(buffer.ptr + 10, page - 10, huge=True) and calls == []  # no whole page
        assert _thp._madvise_range(buffer.ptr, page, huge=True) and calls == [(buffer.ptr, page, _thp.MADV_HUGEPAGE)]
    finally:
        buffer.free()


def test_a_threads_fault_count_is_its_minor_and_major_faults(monkeypatch):
    """thread_faults: getrusage(RUSAGE_THREAD)'s minor plus major faults; 0 where the platform
    cannot say (no RUSAGE_THREAD, or refused) - never a guess that would read as huge pages."""
    monkeypatch.setattr("resource.getrusage", lambda who: SimpleNamespace(ru_minflt=5, ru_majflt=2))
    assert _thp.thread_faults() == 7

    def refused(who):
        raise OSError("no")

    monkeypatch.setattr("resource.getrusage", refused)
    assert _thp.thread_faults() == 0


@pytest.mark.concurrency
def test_the_prefault_advises_each_piece_before_faulting_it_and_the_brake_reaches_the_report(monkeypatch):
    """A real pipelined bring-up with hugepages="auto" (fake driver; the host's THP readings,
    madvise and clock injected through ThpAuto's defaults): each piece is advised just before
    it is faulted (a THP piece only: the mapping is MADV_NOHUGEPAGE whole), a slow THP piece
    brakes the rest to 4 KiB pages, and the handle's
    page_rules and thp_brake (what apply, tiers and the metrics show) name it; every byte of
    the buffer is counted under exactly one rule."""
    from machine import ROOMY

    from hicache.effects import BufferRequest, HostTensorAllocator, bring_up
    from hicache.effects import HostSetup
    from hicache.effects._bringup import _faulting
    from hicache.effects import HostLedger
    from hicache.testing import FakeRuntime

    events: list = []
    host = _Host(seconds=[0.01, 0.1] + [0.01] * 100)
    real_prefault = _faulting.prefault

    def recording_prefault(buffer, **kw):
        events.append(("fault", buffer.ptr + kw["start"]))
        result = real_prefault(buffer, **kw)
        host.now += host.seconds.pop(0)
        return result

    def madvise(ptr, length, *, huge):
        events.append(("advise", ptr, huge))
        return True

    class Injected(_thp.ThpAuto):
        def __init__(self, **kw):
            super().__init__(enabled=lambda: "madvise", free_blocks=lambda: 10**6, madvise=madvise,
                             clock=host.clock)

    monkeypatch.setattr(_thp, "ThpAuto", Injected)
    monkeypatch.setattr(_faulting, "prefault", recording_prefault)
    monkeypatch.setattr(_faulting, "PIECE_BYTES", 256 * 1024)
    from hicache.effects._bringup import _steps

    monkeypatch.setattr(_steps, "_fault_options", lambda run: {"threads": 1})  # pieces in order: a scripted clock
    from hicache.plan import Limits, plan_registration

    plan = plan_registration(2 * MiB, granularity_bytes=64 * 1024, limits=Limits(chunk_limit_bytes=MiB))
    request = BufferRequest("kv", (2 * MiB,), None, plan)
    handle = bring_up([request], mode="pipelined",
                      host=HostSetup(runtime=FakeRuntime(), machine=ROOMY, ledger=HostLedger(),
                                     allocator=HostTensorAllocator(prefault_threads=1)), budget=False)
    try:
        advised = [e for e in events if e[0] == "advise"]
        faulted = [e for e in events if e[0] == "fault"]
        assert len(faulted) == 8 and len(advised) == 1 and advised[0][2] is True
        position = events.index(advised[0])  # the THP piece faults right after its advice
        assert events[position + 1] == ("fault", advised[0][1]) and faulted[1] == events[position + 1]
        rules = {rule: nbytes for _, rule, nbytes in handle.page_rules()}
        assert rules == {"reference": 256 * 1024, "free": 256 * 1024, "brake": 6 * 256 * 1024}
        assert sum(rules.values()) == 2 * MiB and "below the 4 KiB rate" in handle.thp_brake
        assert handle.record(tiers=False).page_rules == handle.page_rules()
    finally:
        handle.release()


def test_every_thp_piece_is_judged_by_the_huge_pages_its_faults_show():
    """Every THP piece's share of huge pages comes from its own fault count (not only the first
    piece's, as when it took an smaps read): THP proven on a healthy piece, a later piece that
    faults fast but mostly as 4 KiB pages (the kernel could not assemble huge ones) engages the
    brake and the reason gives the share."""
    host = _Host(seconds=[0.02, 0.01])
    policy = host.policy()
    _fault(policy, host, [(0, PIECE), (PIECE, PIECE)])  # the reference, then a healthy THP piece
    assert policy.summary()["brake"] is None
    host.huge_share, host.seconds = 0.25, [0.01, 0.01]  # twice the 4 KiB rate, a quarter huge
    _fault(policy, host, [(2 * PIECE, PIECE), (3 * PIECE, PIECE)])
    summary = policy.summary()
    assert "got 16 MiB of huge pages (under 50%)" in summary["brake"]
    assert summary["rules"] == {0: {"reference": PIECE, "free": 2 * PIECE, "brake": PIECE}}


def test_the_fault_count_reads_the_huge_pages_the_kernel_gave_as_smaps_does():
    """On this kernel: a piece pre-faulted with MADV_HUGEPAGE and one with 4 KiB pages, each on
    the calling thread; the huge bytes its thread's fault count gives equal the AnonHugePages
    /proc/self/smaps reports for it (the independent oracle), whatever THP the host grants."""
    import mmap

    from hicache.effects._host._tiers import page_tiers

    buffer = allocate_host(16 * MiB, hugepages="auto")
    try:
        seen = []
        for offset, huge in ((0, False), (8 * MiB, True)):
            ptr = buffer.ptr + offset
            if huge:  # refused (a kernel built without THP): 4 KiB pages, and both sides say 0
                _thp._madvise_range(ptr, 8 * MiB, huge=True)
            before = _thp.thread_faults()
            prefault(buffer, threads=1, start=offset, length=8 * MiB)
            faults = _thp.thread_faults() - before  # every Linux counts them: populate's since 5.9, the touch's always
            assert faults >= 8 * MiB // THP_BYTES
            seen.append((huge_bytes_from_faults(8 * MiB, faults, page_bytes=mmap.PAGESIZE),
                         page_tiers(ptr, 8 * MiB).thp))
        assert seen[0] == (0, 0) and seen[1][0] == seen[1][1]
    finally:
        buffer.free()


def _stepped(host, seconds_per_byte, huge_below=0):
    """A populate for ThpAuto.fault on the fake host: records each call and advances the clock
    (``seconds_per_byte(offset)``) and the fault count as that part faulting in would - in huge
    pages where it starts below ``huge_below``, else 4 KiB ones."""
    calls: list = []

    def populate(offset, nbytes):
        calls.append((offset, nbytes))
        host.now += nbytes * seconds_per_byte(offset)
        host.count += nbytes // THP_BYTES if offset < huge_below else nbytes // 4096

    return calls, populate


def test_a_thp_piece_that_starts_far_slower_than_4k_stops_thp_after_its_first_step():
    """A 32 MiB THP piece whose huge pages fault 7x slower than this bring-up's 4 KiB pages
    (within the probe's margin, past the 8 MiB one): it faults its probe huge page and the rest
    of its first 8 MiB with THP, the brake engages there, the other 24 MiB are advised back to
    4 KiB pages and faulted in one call, and every byte is counted once - 8 MiB under "free",
    24 MiB under "brake" - with the early verdict named."""
    host = _Host(seconds=[0.01])
    policy = host.policy()
    _fault(policy, host, [(0, PIECE)])  # the 4 KiB reference: 6.7 GB/s
    calls, populate = _stepped(host, lambda offset: 7 / 6.7e9 if offset < THP_STEP_BYTES else 1 / 6.7e9,
                               huge_below=THP_STEP_BYTES)
    policy.fault(0, PIECE, 32 * MiB, populate)
    assert calls == [(0, THP_PROBE_BYTES), (THP_PROBE_BYTES, THP_STEP_BYTES - THP_PROBE_BYTES),
                     (THP_STEP_BYTES, 32 * MiB - THP_STEP_BYTES)]
    assert host.advice == [(PIECE, 32 * MiB, True), (PIECE + THP_STEP_BYTES, 32 * MiB - THP_STEP_BYTES, False)]
    summary = policy.summary()
    assert summary["rules"] == {0: {"reference": PIECE, "free": THP_STEP_BYTES, "brake": 32 * MiB - THP_STEP_BYTES}}
    assert "first 8 MiB" in summary["brake"]
    assert policy.before(0, 2 * PIECE, PIECE).decision.rule == "brake"


def test_a_thp_piece_whose_first_huge_page_is_far_slower_stops_thp_after_it():
    """A 32 MiB THP piece whose first huge page faults 24x slower than 4 KiB pages (this VM's
    huge pages on blocks its hypervisor took back): THP stops after that one huge page - the
    other 30 MiB advised back to 4 KiB pages in one call, 2 MiB counted under "free" - so a
    host where THP is slow pays for 2 MiB of it, not 8."""
    host = _Host(seconds=[0.01])
    policy = host.policy()
    _fault(policy, host, [(0, PIECE)])  # the 4 KiB reference: 6.7 GB/s
    calls, populate = _stepped(host, lambda offset: 24 / 6.7e9 if offset < THP_PROBE_BYTES else 1 / 6.7e9,
                               huge_below=THP_PROBE_BYTES)
    policy.fault(0, PIECE, 32 * MiB, populate)
    assert calls == [(0, THP_PROBE_BYTES), (THP_PROBE_BYTES, 32 * MiB - THP_PROBE_BYTES)]
    assert host.advice == [(PIECE, 32 * MiB, True), (PIECE + THP_PROBE_BYTES, 32 * MiB - THP_PROBE_BYTES, False)]
    summary = policy.summary()
    assert summary["rules"] == {0: {"reference": PIECE, "free": THP_PROBE_BYTES, "brake": 32 * MiB - THP_PROBE_BYTES}}
    assert "first 2 MiB" in summary["brake"]


def test_a_healthy_thp_piece_faults_in_steps_and_keeps_thp():
    """A THP piece faster than 4 KiB pages faults in five steps (its probe huge page, then to
    each 8 MiB boundary), none re-advised; the piece is judged whole (THP proven) and the next
    pieces get THP."""
    host = _Host(seconds=[0.01])
    policy = host.policy()
    _fault(policy, host, [(0, PIECE)])
    calls, populate = _stepped(host, lambda offset: 1 / 13e9, huge_below=32 * MiB)
    policy.fault(0, PIECE, 32 * MiB, populate)
    assert calls == [(0, THP_PROBE_BYTES), (THP_PROBE_BYTES, THP_STEP_BYTES - THP_PROBE_BYTES),
                     *[(i * THP_STEP_BYTES, THP_STEP_BYTES) for i in range(1, 4)]]
    assert host.advice == [(PIECE, 32 * MiB, True)] and policy.summary()["brake"] is None
    assert [policy.before(0, (2 + i) * PIECE, PIECE).decision.rule for i in range(2)] == ["free", "free"]


def test_a_thp_piece_stops_thp_at_its_next_step_once_another_piece_braked():
    """Another thread's piece engages the brake while a THP piece is mid-way: the THP piece
    stops THP at its next step boundary (the brake holds for the rest of the bring-up, pieces
    in flight included), though its own steps are fast."""
    host = _Host(seconds=[0.01])
    policy = host.policy()
    _fault(policy, host, [(0, PIECE)])

    def populate(offset, nbytes):
        calls.append((offset, nbytes))
        host.now += nbytes / 13e9
        if offset == 0:
            policy.brake = "another piece braked"

    calls: list = []
    policy.fault(0, PIECE, 32 * MiB, populate)
    assert calls == [(0, THP_PROBE_BYTES), (THP_PROBE_BYTES, 32 * MiB - THP_PROBE_BYTES)]
    assert policy.summary()["rules"][0]["brake"] == 32 * MiB - THP_PROBE_BYTES


def test_a_4k_piece_faults_in_one_call():
    """A piece decided 4 KiB pages (here the reference) faults in one populate call, unadvised."""
    host = _Host()
    policy = host.policy()
    calls, populate = _stepped(host, lambda offset: 1 / 6.7e9)
    policy.fault(0, 0, 32 * MiB, populate)
    assert calls == [(0, 32 * MiB)] and host.advice == []


def test_auto_is_the_default_of_the_pools_apply_and_the_seam_mode(monkeypatch):
    """HICACHE_HUGEPAGES unset: the pools' settings, apply's --hugepages and SGLang's own pools'
    allocator (the plug-in's seam) all use "auto"; the variable still picks another mode."""
    from hicache.compat import sglang as compat
    from hicache.effects import HostTensorAllocator, pool_settings
    from hicache.plan._env import BY_NAME

    monkeypatch.delenv("HICACHE_HUGEPAGES", raising=False)
    assert pool_settings().hugepages == "auto" and BY_NAME["HICACHE_HUGEPAGES"].default == "auto"
    assert HostTensorAllocator().hugepages == "auto"

    class SGLangDefault:  # SGLang's own default allocator, as the seam sees it
        pass

    SGLangDefault.__name__, SGLangDefault.__module__ = "HostTensorAllocator", "sglang.srt.mem_cache.pool_host.common"
    monkeypatch.setattr(compat, "resolve_numa_node", lambda _: (None, None))
    assert compat._bring_up_allocator(SGLangDefault(), "cpu").hugepages == "auto"
    monkeypatch.setenv("HICACHE_HUGEPAGES", "off")
    assert compat._bring_up_allocator(SGLangDefault(), "cpu").hugepages == "off"
    assert pool_settings().hugepages == "off"


def test_thp_pieces_that_end_before_the_reference_are_judged_once_it_has():
    """A THP piece faulting beside the reference and ending first is judged when the reference
    ends: a slow one brakes every piece started after."""
    host = _Host()
    policy = host.policy()
    reference = policy.before(0, 0, PIECE)
    early = policy.before(0, PIECE, PIECE)  # started beside the reference (another thread)
    host.now += 0.1
    policy.after(0, PIECE, PIECE, early)  # 0.67 GB/s, no reference yet: not judged
    assert policy.summary()["brake"] is None
    host.now += 0.0
    policy.after(0, 0, PIECE, reference._replace(start=host.now - 0.01))  # the reference: 6.7 GB/s
    assert "below the 4 KiB rate" in policy.summary()["brake"]
    assert policy.before(0, 2 * PIECE, PIECE)[0].rule == "brake"


def test_an_auto_mapping_starts_as_4k_pages_whole():
    """allocate_host(hugepages="auto") maps with MADV_NOHUGEPAGE over the whole buffer (VmFlags
    "nh"): a 4 KiB piece then needs no call of its own, and only THP pieces are advised."""
    buffer = allocate_host(8 * MiB, hugepages="auto")
    try:
        assert "nh" in _mapping_of(buffer.ptr)[2]
    finally:
        buffer.free()


def test_until_one_thp_piece_is_judged_no_second_one_is_handed_out():
    """THP on trial: while the first THP piece has no verdict (it is faulting, or it ended
    before the 4 KiB reference), pieces started beside it get 4 KiB pages (rule "trial");
    once it is judged healthy THP is proven and pieces started side by side all get it."""
    host = _Host()
    policy = host.policy()
    reference = policy.before(0, 0, PIECE)
    first = policy.before(0, PIECE, PIECE)
    beside = policy.before(0, 2 * PIECE, PIECE)
    assert (reference[0].rule, first[0].rule, beside[0].rule) == ("reference", "free", "trial")
    host.now += 0.01
    policy.after(0, PIECE, PIECE, first)  # ended before the reference: no verdict yet
    assert policy.before(0, 3 * PIECE, PIECE)[0].rule == "trial"
    host.now += 0.01
    policy.after(0, 0, PIECE, reference)  # the 4 KiB rate: the THP piece beat it - proven
    later = [policy.before(0, (4 + i) * PIECE, PIECE)[0].rule for i in range(3)]
    assert later == ["free"] * 3 and policy.summary()["brake"] is None
    assert host.advice == [(PIECE, PIECE, True)] + [((4 + i) * PIECE, PIECE, True) for i in range(3)]


def test_a_host_where_thp_is_slow_pays_for_one_thp_piece_only():
    """Pieces started four at a time (four threads) on a host whose THP pieces fault 10x slower
    than its 4 KiB ones: one piece is tried with THP, every other piece started before its
    verdict gets 4 KiB pages, and the brake takes every piece after it."""
    host = _Host()
    policy = host.policy()
    out = [policy.before(0, i * PIECE, PIECE) for i in range(4)]
    assert [token[0].rule for token in out] == ["reference", "free", "trial", "trial"]
    host.now += 0.01
    for i in (0, 2, 3):  # the 4 KiB pieces end first
        policy.after(0, i * PIECE, PIECE, out[i])
    out += [policy.before(0, i * PIECE, PIECE) for i in range(4, 7)]  # threads take the next pieces
    host.now += 0.09
    policy.after(0, PIECE, PIECE, out[1])  # the THP piece: 10x slower
    rest = [policy.before(0, i * PIECE, PIECE)[0].rule for i in range(7, 12)]
    assert [token[0].rule for token in out[4:]] == ["trial"] * 3 and rest == ["brake"] * 5
    assert [advice for advice in host.advice if advice[2]] == [(PIECE, PIECE, True)]
