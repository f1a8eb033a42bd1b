"""Which pages back a host buffer, as the kernel reports them after pre-fault (issue #21).

Owns reading ``/proc/self/smaps`` for an address range: bytes backed by hugetlbfs pages
(``Private_Hugetlb`` + ``Shared_Hugetlb``), by transparent huge pages (``AnonHugePages``) and by
base pages (the rest of ``Rss``). A hugepage fallback is a 2-5x bring-up cliff (mori PR #679,
pegaflow PR #277): what was *obtained*, not what was asked, is what operators need to see. A
mapping the kernel merged with a neighbour is counted in proportion to the part inside the
range (``exact`` False then). Pure parsing apart from the one read; imports nothing of hicache.
"""

from __future__ import annotations

import re
from typing import NamedTuple

SMAPS = "/proc/self/smaps"
_HEADER = re.compile(r"^([0-9a-f]+)-([0-9a-f]+)\s")
_FIELD = re.compile(r"^(\w+):\s+(\d+) kB")


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


def page_tiers(ptr: int, length: int, *, smaps_text: str | None = None, smaps_path: str = SMAPS) -> PageTiers:
    """How ``[ptr, ptr + length)`` is backed now (``smaps_text``: parse this - one read for many
    ranges, or a test's - instead of reading ``smaps_path``). An unreadable smaps gives zeros
    with ``exact`` False."""
    if smaps_text is None:
        smaps_text = read_smaps(smaps_path)
    if smaps_text is None:
        return PageTiers(0, 0, 0, exact=False)
    end = ptr + length
    hugetlb = thp = base = 0.0
    exact = True
    for start, stop, fields in _mappings(smaps_text):
        overlap = min(stop, end) - max(start, ptr)
        if overlap <= 0:
            continue
        share = overlap / (stop - start)
        if share < 1.0:
            exact = False  # merged with a neighbour (or the range cuts it): counted in proportion
        huge = fields.get("Private_Hugetlb", 0) + fields.get("Shared_Hugetlb", 0)
        anon_huge = fields.get("AnonHugePages", 0)
        rss = fields.get("Rss", 0)
        hugetlb += huge * share
        thp += anon_huge * share
        base += max(0, rss - anon_huge) * share if not huge else 0.0
    return PageTiers(int(hugetlb), int(thp), int(base), exact)
