"""``hugepages="auto"`` (issue #53 item 2): transparent huge pages for a pre-fault piece only where
they are free, and a brake that turns them off for the rest of a bring-up once they cost more
than they give. Pure: snapshots of the host and each piece's measured outcome come in, one
`ThpDecision` per piece goes out, naming its rule.

Why a rule per piece (../shared/reference/h200-measured.md): on an H200 host THP took one register
call from 19 to 39 GB/s and the pre-fault from 34 to 54 GB/s (37.5 GiB usable in 1.0-1.1 s
against 2.3-2.4 s with 4 KiB pages). But on a fragmented, long-running host each 2 MiB fault
can enter direct compaction and fall "from GB/s to GB/min" (TensorRT-LLM #15430). THP is asked
for a piece only when the buddy allocator already holds enough free 2 MiB-and-larger blocks on
the pool's node to back it (no compaction needed); the brake catches what a snapshot cannot
see - a piece that faulted in slower than 4 KiB pages do, or got mostly 4 KiB pages anyway.
"Slower than 4 KiB pages" is measured on the same host in the same bring-up: its first piece
is faulted with 4 KiB pages as the reference (a stated rate would brake a merely slow machine:
a small VM faults 4 KiB pages at 0.7 GB/s a thread, where the H200 did 2.1), and a healthy THP
piece is faster than 4 KiB pages on the same host (54 against 34 GB/s there).
"""

from __future__ import annotations

from typing import NamedTuple

THP_BYTES = 2 * 2**20
#: THP `enabled` settings under which MADV_HUGEPAGE gives a range huge pages
THP_USABLE = ("always", "madvise")
#: A THP piece that got less than this share of its bytes as huge pages engages the brake.
MOSTLY_HUGE = 0.5
#: A THP piece faults in steps of this many bytes, each followed by an early verdict
#: (`early_brake_reason`): on this VM a THP piece that met slow huge pages took 70 ms where a
#: 4 KiB one took 9, and the brake could only engage once all 32 MiB had faulted.
THP_STEP_BYTES = 8 * 2**20
#: How much slower than the 4 KiB rate a THP piece's first steps must run for the early verdict
#: to brake mid-piece. A margin, because a step is short: a healthy THP step on the H200's host
#: (54 GB/s THP, 34 GB/s 4 KiB pages on 16 threads) takes 2.5 ms, so only a 13 ms stall of its
#: thread could make it look 4x slower than 4 KiB pages, against 6 ms for the whole piece's
#: verdict (1x over 32 MiB); the slow huge pages here ran 7x slower.
EARLY_MARGIN = 4.0
#: A THP piece's first step is one huge page, judged at once with a wider margin: on a VM whose
#: freed 2 MiB blocks go back to its hypervisor (free page reporting) a huge page faulted onto one
#: ran at 0.15-0.3 GB/s against 3.3 GB/s for 4 KiB pages - 8-24x slower - and a first step of
#: 8 MiB cost 18-60 ms before the verdict could stop it, 2 MiB costs a quarter of that. The
#: margin is wider because the step is shorter: a healthy huge page on the H200's host faults in
#: about 0.6 ms a thread (54 GB/s on 16 threads), so only a 7 ms stall of its thread could make it
#: look 8x slower than 4 KiB pages there (2.1 GB/s a thread).
THP_PROBE_BYTES = THP_BYTES
PROBE_MARGIN = 8.0


class ThpSnapshot(NamedTuple):
    """What the host says before a piece: THP's `enabled` setting (None: unreadable), the
    bytes of free 2 MiB-and-larger blocks on the pool's node not yet promised to a piece in
    flight (None: unreadable) and the size of a transparent huge page there (the kernel's PMD
    size, ``hpage_pmd_size``; None: unreadable - an older kernel has no file saying it - taken as
    2 MiB, x86-64's)."""

    enabled: str | None
    free_huge_bytes: int | None
    huge_page_bytes: int | None = THP_BYTES


class PieceFault(NamedTuple):
    """How one piece faulted in: its bytes, seconds (on one thread), whether THP was asked for,
    and the bytes the kernel backed with huge pages (None: not read)."""

    nbytes: int
    seconds: float
    huge: bool
    huge_bytes: int | None


class ThpDecision(NamedTuple):
    """``huge``: advise MADV_HUGEPAGE for the piece (else MADV_NOHUGEPAGE); ``rule``: which rule
    decided (a key of `RULES`); ``reason``: the figures behind it, for the report."""

    huge: bool
    rule: str
    reason: str


#: Every rule `decide_piece` applies, first match wins, and what it means.
RULES = {
    "brake": "THP off for the rest of this bring-up: a THP piece faulted slower than 4 KiB pages or mostly without "
             "huge pages, or its first steps far slower",
    "thp-off": "THP's enabled setting is never (or unreadable): 4 KiB pages",
    "thp-size": "THP pages here are not 2 MiB (512 MiB where arm64 runs 64 KiB base pages): every rule and rate "
                "auto holds THP to is 2 MiB's, so base pages (hugepages='thp' asks for them anyway)",
    "reference": "the bring-up's first piece, faulted with 4 KiB pages: the rate THP pieces are held to",
    "no-free-blocks": "the free 2 MiB blocks on the pool's node do not cover the piece: THP would compact; 4 KiB pages",
    "unknown-free-blocks": "/proc/buddyinfo is unreadable: 4 KiB pages",
    "trial": "THP on trial: a THP piece awaits its verdict against the 4 KiB rate; 4 KiB pages until it has one",
    "free": "THP: free 2 MiB blocks cover the piece",
}


def size_taken(huge_page_bytes: int | None) -> bool:
    """Whether ``auto`` takes transparent huge pages of this size: 2 MiB, or a size the kernel
    does not say (rule `thp-size` otherwise)."""
    return huge_page_bytes in (None, THP_BYTES)


def decide_piece(snapshot: ThpSnapshot, piece_bytes: int, *, brake: str | None = None,
                 reference: bool = False, trial: bool = False) -> ThpDecision:
    """The page size for the next piece of ``piece_bytes`` (``brake``: why THP was turned off
    for this bring-up, or None while it is not; ``reference``: no 4 KiB piece has been faulted
    or started yet, so this one is; ``trial``: no THP piece of this bring-up has been judged yet
    and one is out - it alone pays if THP is slow here, the others keep 4 KiB pages until its
    verdict: on a VM whose THP faulted 6x slower than 4 KiB pages, one THP piece per thread
    before the brake cost a 2 GiB bring-up 10%)."""
    if brake is not None:
        return ThpDecision(False, "brake", brake)
    if snapshot.enabled not in THP_USABLE:
        return ThpDecision(False, "thp-off", f"THP enabled: {snapshot.enabled or 'unreadable'}")
    if not size_taken(snapshot.huge_page_bytes):
        # a 512 MiB huge page needs a 512 MiB free block per fault and zeroes it on one thread:
        # nothing measured here says it pays, and the free-block rule counts 2 MiB blocks
        return ThpDecision(False, "thp-size", f"THP pages here are {snapshot.huge_page_bytes // 2**20} MiB, "
                                              "not 2 MiB: base pages")
    if reference:
        return ThpDecision(False, "reference", "the first piece: 4 KiB pages, the rate THP pieces are held to")
    if snapshot.free_huge_bytes is None:
        return ThpDecision(False, "unknown-free-blocks", "/proc/buddyinfo unreadable")
    if snapshot.free_huge_bytes < piece_bytes:
        return ThpDecision(False, "no-free-blocks", f"{snapshot.free_huge_bytes // THP_BYTES} free 2 MiB blocks, "
                                                    f"the piece needs {-(-piece_bytes // THP_BYTES)}")
    if trial:
        return ThpDecision(False, "trial", "a THP piece awaits its verdict against the 4 KiB rate")
    return ThpDecision(True, "free", f"{snapshot.free_huge_bytes // THP_BYTES} free 2 MiB blocks cover "
                                     f"{-(-piece_bytes // THP_BYTES)}")


def huge_bytes_from_faults(nbytes: int, faults: int, *, page_bytes: int, huge_page_bytes: int = THP_BYTES) -> int | None:
    """The bytes of a freshly faulted range of ``nbytes`` that the kernel backed with huge pages,
    from the number of page faults it took (None: no fault was counted - the kernel did not
    count them for this thread, or the range was already resident). Each fault maps one huge
    page or one base page: nbytes = h * huge + (faults - h) * base, so h = (nbytes / base -
    faults) / (huge / base - 1). Why not /proc/self/smaps: it walks every page table of the
    process - 35-70 ms per read in a benchmark process with SGLang loaded, on one of the
    pre-fault threads - where the thread's own fault count costs one getrusage call."""
    if faults <= 0 or nbytes <= 0:
        return None
    huge = (nbytes // page_bytes - faults) // (huge_page_bytes // page_bytes - 1)
    return max(0, min(huge, nbytes // huge_page_bytes)) * huge_page_bytes


def thp_steps(length: int) -> list[int]:
    """The steps a THP piece of ``length`` bytes faults in, each followed by an early verdict:
    one huge page (`THP_PROBE_BYTES`), the rest of its first `THP_STEP_BYTES`, then steps of
    `THP_STEP_BYTES` - so the verdicts fall after 2 MiB and on every 8 MiB boundary."""
    steps, done = [], 0
    while done < length:
        target = THP_PROBE_BYTES if not done else (done // THP_STEP_BYTES + 1) * THP_STEP_BYTES
        steps.append(min(target, length) - done)
        done += steps[-1]
    return steps


def early_brake_reason(fault: PieceFault, rate_4k: float | None) -> str | None:
    """Why a THP piece's first ``fault.nbytes`` (its steps so far) stop THP before the piece
    has finished (None: they do not): they ran more than `EARLY_MARGIN` times slower than
    ``rate_4k`` - `PROBE_MARGIN` times while they are shorter than one `THP_STEP_BYTES` - (not
    judged before a 4 KiB piece was measured). Anything milder waits for the whole piece's
    verdict (`brake_reason`)."""
    if not fault.huge or not fault.nbytes or rate_4k is None or fault.seconds <= 0:
        return None
    rate = fault.nbytes / fault.seconds
    margin = PROBE_MARGIN if fault.nbytes < THP_STEP_BYTES else EARLY_MARGIN
    if rate * margin >= rate_4k:
        return None
    return (f"a THP piece's first {fault.nbytes / 2**20:.0f} MiB faulted at {rate / 1e9:.2f} GB/s, under "
            f"1/{margin:.0f} of the 4 KiB rate of {rate_4k / 1e9:.2f} GB/s: the rest of the piece and "
            "of the bring-up with 4 KiB pages")


def base_rate(base_faults) -> float | None:
    """The 4 KiB rate a THP piece is held to: the median bytes per second of this bring-up's
    4 KiB pieces (None before it has one)."""
    rates = sorted(f.nbytes / f.seconds for f in base_faults if f.seconds > 0 and f.nbytes)
    return rates[len(rates) // 2] if rates else None


def brake_reason(fault: PieceFault, rate_4k: float | None) -> str | None:
    """Why a THP piece engages the brake (None: it does not): slower than ``rate_4k`` (not
    judged before a 4 KiB piece was measured), or less than half of it backed by huge pages.
    Only whole 2 MiB pages can be huge: a piece smaller than one is judged by its rate alone."""
    if not fault.huge or not fault.nbytes:
        return None
    if rate_4k is not None and fault.seconds > 0 and fault.nbytes / fault.seconds < rate_4k:
        return (f"a THP piece of {fault.nbytes / 2**20:.0f} MiB faulted at {fault.nbytes / fault.seconds / 1e9:.2f} GB/s, "
                f"below the 4 KiB rate of {rate_4k / 1e9:.2f} GB/s")
    if fault.huge_bytes is not None and fault.nbytes >= THP_BYTES and fault.huge_bytes < MOSTLY_HUGE * fault.nbytes:
        return (f"a THP piece of {fault.nbytes / 2**20:.0f} MiB got {fault.huge_bytes / 2**20:.0f} MiB of huge pages "
                f"(under {MOSTLY_HUGE:.0%})")
    return None
