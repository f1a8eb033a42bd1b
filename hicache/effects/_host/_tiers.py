"""Which pages back a host buffer, as the kernel reports them after pre-fault (issue #21).

Owns reading ``/proc/self/smaps`` for an address range: bytes backed by hugetlbfs pages
(``Private_Hugetlb`` + ``Shared_Hugetlb``), by transparent huge pages (``AnonHugePages``) and by
base pages (the rest of ``Rss``). A hugepage fallback is a 2-5x bring-up cliff (mori PR #679,
pegaflow PR #277): what was *obtained*, not what was asked, is what operators need to see.
Counts are whole pages. A mapping the kernel merged with a neighbour reports its fields for
both: the range's resident bytes then come from ``mincore(2)`` over the range itself, and its
THP share is the mapping's bounded to what can lie inside the range (``exact`` False: the split
is estimated, the total is not). Parsing, the one read and mincore; imports nothing of hicache.
"""

from __future__ import annotations

import ctypes
import mmap
import re
from typing import NamedTuple

SMAPS = "/proc/self/smaps"
_HEADER = re.compile(r"^([0-9a-f]+)-([0-9a-f]+)\s")
_FIELD = re.compile(r"^(\w+):\s+(\d+) kB")
OS_PAGE = mmap.PAGESIZE  # mincore's unit: one entry per base page, 64 KiB on some arm64 kernels
THP_BYTES = 2 * 2**20  # a transparent huge page (the PMD size on x86-64 and 4 KiB-page arm64)
_MINCORE_WINDOW = 2**30  # bytes per mincore call: its vector stays 256 KiB for any range


class PageTiers(NamedTuple):
    """Bytes of one range by the pages backing them (what is resident; a page not yet faulted
    counts nowhere)."""

    hugetlb: int
    thp: int
    base: int
    exact: bool = True

    @property
    def tier(self) -> str:
        """The tier most of the range is on: ``hugetlb``, ``thp``, ``4k`` (or ``none`` yet)."""
        best = max((self.hugetlb, "hugetlb"), (self.thp, "thp"), (self.base, "4k"))
        return best[1] if best[0] else "none"

    def as_dict(self) -> dict:
        return {"hugetlb": self.hugetlb, "thp": self.thp, "4k": self.base, "exact": self.exact}


def _mappings(text: str):
    """``(start, end, {field: bytes})`` per mapping of an smaps text."""
    start = end = None
    fields: dict = {}
    for line in text.splitlines():
        header = _HEADER.match(line)
        if header:
            if start is not None:
                yield start, end, fields
            start, end, fields = int(header[1], 16), int(header[2], 16), {}
            continue
        field = _FIELD.match(line)
        if field and start is not None:
            fields[field[1]] = int(field[2]) * 1024
    if start is not None:
        yield start, end, fields


def read_smaps(path: str = SMAPS) -> str | None:
    """The smaps text (None when it cannot be read)."""
    try:
        with open(path) as handle:
            return handle.read()
    except OSError:
        return None


def mapping_field(ptr: int, field: str, *, smaps_text: str | None = None) -> int | None:
    """``field`` (e.g. ``"Rss"``, bytes) of this process's mapping holding ``ptr``; None when no
    mapping holds it or smaps cannot be read."""
    text = read_smaps() if smaps_text is None else smaps_text
    if text is None:
        return None
    for start, end, fields in _mappings(text):
        if start <= ptr < end:
            return fields.get(field, 0)
    return None


_LOW_BIT = bytes(value & 1 for value in range(256))  # mincore: bit 0 of each entry says resident


def resident_bytes(ptr: int, length: int) -> int | None:
    """Bytes of ``[ptr, ptr + length)`` resident now, in whole OS pages, by ``mincore(2)``; None
    where it cannot say (memory this process has not mapped there, or no mincore)."""
    mincore = getattr(ctypes.CDLL(None, use_errno=True), "mincore", None)  # the process's own libc
    if mincore is None:
        return None
    mincore.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p)
    start, end = ptr - ptr % OS_PAGE, -(-(ptr + length) // OS_PAGE) * OS_PAGE
    pages = 0
    for window in range(start, end, _MINCORE_WINDOW):
        size = min(_MINCORE_WINDOW, end - window)
        vector = (ctypes.c_ubyte * (size // OS_PAGE))()
        if mincore(window, size, vector) != 0:
            return None
        pages += bytes(vector).translate(_LOW_BIT).count(1)  # in C: about 3 ms a GiB
    return pages * OS_PAGE


def _bounded(field: int, overlap: int, outside: int, unit: int) -> int:
    """What of a mapping's ``field`` bytes can lie in the part of it inside the range: its
    proportional share (as if evenly spread), kept within what must lie inside (what does not
    fit ``outside``) and what can (the ``overlap``), in whole ``unit`` pages."""
    low, high = max(0, field - outside), min(overlap, field)
    estimate = min(high, max(low, field * overlap // (overlap + outside)))
    return estimate - estimate % unit


def page_tiers(ptr: int, length: int, *, smaps_text: str | None = None, smaps_path: str = SMAPS,
               resident=resident_bytes) -> PageTiers:
    """How ``[ptr, ptr + length)`` is backed now (``smaps_text``: parse this - one read for many
    ranges, or a test's - instead of reading ``smaps_path``; ``resident(ptr, length)``: the
    resident bytes of a part of a merged mapping, `resident_bytes` by default). An unreadable
    smaps gives zeros with ``exact`` False."""
    if smaps_text is None:
        smaps_text = read_smaps(smaps_path)
    if smaps_text is None:
        return PageTiers(0, 0, 0, exact=False)
    end = ptr + length
    hugetlb = thp = base = 0
    exact = True
    for start, stop, fields in _mappings(smaps_text):
        overlap = min(stop, end) - max(start, ptr)
        if overlap <= 0:
            continue
        huge = fields.get("Private_Hugetlb", 0) + fields.get("Shared_Hugetlb", 0)
        anon_huge = fields.get("AnonHugePages", 0)
        rss = fields.get("Rss", 0)
        outside = (stop - start) - overlap
        if not outside:  # the whole mapping is inside the range: the kernel's own figures
            hugetlb += huge
            thp += anon_huge
            base += max(0, rss - anon_huge) if not huge else 0
            continue
        whole = stop - start
        if huge == whole or (not huge and anon_huge == whole) or (not huge and not anon_huge and rss == whole):
            # every page of the mapping is resident, all in one tier: so is every byte of the
            # range's part. A pool's buffer is a prefix of its own mapping, rounded up to the
            # huge page - 16,384,000 bytes on 8 hugepages read as 7, 1.6 MB on one as none.
            if huge:
                hugetlb += overlap
            elif anon_huge:
                thp += overlap
            else:
                base += overlap
            continue
        exact = False  # merged with a neighbour (or the range cuts it), its pages of several kinds
        if huge:  # hugetlbfs pages: whole pages of the mapping's own size
            hugetlb += _bounded(huge, overlap, outside, fields.get("KernelPageSize", OS_PAGE) or OS_PAGE)
            continue
        inside = resident(max(start, ptr), overlap)
        if inside is None:  # mincore cannot say: the mapping's resident bytes, bounded the same way
            inside = _bounded(rss, overlap, outside, OS_PAGE)
        huge_part = min(inside - inside % THP_BYTES, _bounded(anon_huge, overlap, outside, THP_BYTES))
        thp += huge_part
        base += inside - huge_part
    return PageTiers(hugetlb, thp, base, exact)


def buffer_tiers(buffers, smaps_text: str | None = None) -> list:
    """``(name, PageTiers)`` for each ``(name, ptr, nbytes)`` of ``buffers`` now, from one read
    of smaps (``smaps_text``: one shared by several callers, a scrape of many pools)."""
    smaps = read_smaps() if smaps_text is None else smaps_text
    return [(name, page_tiers(ptr, nbytes, smaps_text=smaps)) for name, ptr, nbytes in buffers]
