"""Which pages back a buffer, as the kernel reports them (`HostPools.tiers()`, `hicache apply`'s
"tiers"): parsed from /proc/self/smaps, checked against a fixed smaps text and against the
kernel's own numbers for a real bring-up on this machine (read here by a separate, simpler
parse of the mapping that starts at the buffer)."""

from __future__ import annotations

import re

import pytest

from hicache.effects import BufferRequest, HostTensorAllocator, bring_up
from hicache.effects._cuda._ledger import HostLedger
from hicache.effects._host._tiers import page_tiers
from hicache.plan import Limits, plan_registration
from hicache.testing import FakeRuntime

torch = pytest.importorskip("torch")

SMAPS = """\
7f0000000000-7f0000400000 rw-p 00000000 00:00 0
Size:               4096 kB
Rss:                4096 kB
AnonHugePages:      2048 kB
Private_Hugetlb:       0 kB
Shared_Hugetlb:        0 kB
7f0000400000-7f0000c00000 rw-s 00000000 00:10 12 /anon_hugepage (deleted)
Size:               8192 kB
Rss:                   0 kB
AnonHugePages:         0 kB
Private_Hugetlb:    8192 kB
Shared_Hugetlb:        0 kB
7f0000c00000-7f0001400000 rw-p 00000000 00:00 0
Size:               8192 kB
Rss:                8192 kB
AnonHugePages:         0 kB
Private_Hugetlb:       0 kB
Shared_Hugetlb:        0 kB
"""
BASE, MiB = 0x7F0000000000, 2**20


def test_tiers_of_a_range_from_an_smaps_text():
    """THP, hugetlb and base pages by mapping; a range that covers half of a mapping counts
    half of it and says it is approximate."""
    assert page_tiers(BASE, 4 * MiB, smaps_text=SMAPS) == (0, 2 * MiB, 2 * MiB, True)
    assert page_tiers(BASE + 4 * MiB, 8 * MiB, smaps_text=SMAPS).tier == "hugetlb"
    half = page_tiers(BASE + 12 * MiB, 4 * MiB, smaps_text=SMAPS)
    assert half == (0, 0, 4 * MiB, False) and half.tier == "4k"
    assert page_tiers(BASE, 20 * MiB, smaps_text=SMAPS) == (8 * MiB, 2 * MiB, 10 * MiB, True)
    assert page_tiers(BASE + 64 * MiB, MiB, smaps_text=SMAPS).tier == "none"


def _kernel_says(ptr: int) -> tuple:
    """The oracle: ``(start, end, fields)`` of the smaps entry holding ``ptr``, by a plain regex."""
    with open("/proc/self/smaps") as handle:
        text = handle.read()
    for block in re.finditer(r"^([0-9a-f]+)-([0-9a-f]+) .*?(?=^[0-9a-f]+-[0-9a-f]+ |\Z)", text, re.S | re.M):
        start, end = int(block[1], 16), int(block[2], 16)
        if start <= ptr < end:
            return start, end, {k: int(v) * 1024 for k, v in re.findall(r"^(\w+):\s+(\d+) kB", block[0], re.M)}
    raise AssertionError("the buffer's mapping is not in smaps")


@pytest.mark.parametrize("hugepages", ["off", "thp"])
def test_a_bring_up_reports_the_pages_the_kernel_shows(hugepages):
    """4 KiB pages: every byte on base pages, no THP (the mapping opts out). THP: the THP bytes
    are what the kernel shows for that mapping - however many it actually gave (a kernel with
    THP off gives none). Where the kernel merged the mapping with a neighbour the report says
    it is approximate."""
    size = 16 * MiB
    plan = plan_registration(size, granularity_bytes=2 * MiB, limits=Limits(chunk_limit_bytes=4 * MiB))
    allocator = HostTensorAllocator(prefault_threads=1, hugepages=hugepages)
    with bring_up([BufferRequest("kv", (size,), None, plan)], runtime=FakeRuntime(), ledger=HostLedger(),
                  budget=False, allocator=allocator) as handle:
        ((name, tiers),) = handle.tiers()
        ptr = handle.tensors[0].data_ptr()
        start, end, kernel = _kernel_says(ptr)
    assert name == "kv" and tiers.hugetlb == 0
    alone = (start, end) == (ptr, ptr + size)
    assert tiers.exact == alone
    if hugepages == "off":
        assert tiers.thp == 0 and kernel.get("AnonHugePages", 0) == 0
        assert tiers.base == size if alone else tiers.base > 0
    elif alone:
        assert tiers.thp == kernel["AnonHugePages"] and tiers.thp + tiers.base == kernel["Rss"] == size
