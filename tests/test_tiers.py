"""Which pages back a buffer, as the kernel reports them (`HostPools.tiers()`, `hicache apply`'s
"tiers"): parsed from /proc/self/smaps, checked against a fixed smaps text and against the
kernel's own numbers for a real bring-up on this machine (read here by a separate, simpler
parse of the mapping that starts at the buffer)."""

from __future__ import annotations

import re

import pytest

from hicache.effects import BufferRequest, HostTensorAllocator, bring_up
from hicache.effects import HostSetup
from hicache.effects import HostLedger
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


def _unknown(ptr, length):
    return None  # mincore cannot say (the fixed text's addresses are not this process's)


def test_tiers_of_a_range_from_an_smaps_text():
    """THP, hugetlb and base pages by mapping; a range that covers half of a mapping whose
    every page is resident in one tier counts that half, exactly; half of a mapping of two
    tiers is an approximate split."""
    tiers = lambda ptr, n: page_tiers(ptr, n, smaps_text=SMAPS, resident=_unknown)  # noqa: E731
    assert tiers(BASE, 4 * MiB) == (0, 2 * MiB, 2 * MiB, True)
    assert tiers(BASE + 4 * MiB, 8 * MiB).tier == "hugetlb"
    half = tiers(BASE + 12 * MiB, 4 * MiB)
    assert half == (0, 0, 4 * MiB, True) and half.tier == "4k"
    assert not tiers(BASE, 2 * MiB).exact  # THP and base pages in one mapping: a share of each
    assert tiers(BASE, 20 * MiB) == (8 * MiB, 2 * MiB, 10 * MiB, True)
    assert tiers(BASE + 64 * MiB, MiB).tier == "none"


def test_a_buffer_that_is_a_prefix_of_its_own_resident_mapping_counts_every_byte():
    """A pool's buffer is a prefix of its own mapping, rounded up to the huge page: on fully
    resident hugepages (or THP, or base pages) every byte of it is that tier, exactly - not a
    count of whole pages inside it (1.6 MB on one 2 MiB hugepage read as 0 hugetlb bytes)."""
    text = """\
7f0000000000-7f0000200000 rw-s 00000000 00:10 12 /anon_hugepage (deleted)
Size:               2048 kB
KernelPageSize:     2048 kB
Rss:                   0 kB
Private_Hugetlb:    2048 kB
7f0001000000-7f0001400000 rw-p 00000000 00:00 0
Size:               4096 kB
Rss:                4096 kB
AnonHugePages:      4096 kB
"""
    assert page_tiers(BASE, 1_638_400, smaps_text=text, resident=_unknown) == (1_638_400, 0, 0, True)
    assert page_tiers(BASE + 16 * MiB, 3 * MiB + 5, smaps_text=text, resident=_unknown) == (0, 3 * MiB + 5, 0, True)


MERGED = """\
7f0000000000-7f0000800000 rw-p 00000000 00:00 0
Size:               8192 kB
KernelPageSize:        4 kB
Rss:                5000 kB
AnonHugePages:      2048 kB
Private_Hugetlb:       0 kB
7f0000800000-7f0001000000 rw-s 00000000 00:10 12 /hugepages/pool (deleted)
Size:               8192 kB
KernelPageSize:     2048 kB
Rss:                   0 kB
Private_Hugetlb:    6144 kB
Shared_Hugetlb:        0 kB
"""


@pytest.mark.parametrize("offset, length", [(0, 4 * MiB), (4 * MiB, 4 * MiB), (MiB, 3 * MiB + 8192), (12 * 1024, 4096)])
def test_a_range_inside_a_merged_mapping_counts_whole_pages_and_all_it_holds(offset, length):
    """Inside a mapping the kernel merged with a neighbour: the range's resident bytes (what
    mincore says of the range itself) are all counted, split into whole THP and base pages -
    never a prorated share that loses bytes of a fully resident buffer (130,997 of 131,072);
    hugetlbfs bytes are bounded by what the mapping holds and counted in whole hugepages."""
    asked = []

    def resident(ptr, n):
        asked.append((ptr, n))
        return n - n % 4096  # the range is fully resident

    got = page_tiers(BASE + offset, length, smaps_text=MERGED, resident=resident)
    assert asked == [(BASE + offset, length)] and not got.exact
    assert got.thp + got.base == length - length % 4096 and got.hugetlb == 0
    assert got.thp % (2 * MiB) == 0 and got.base % 4096 == 0 and got.thp <= 2 * MiB
    huge = page_tiers(BASE + 8 * MiB + offset, length, smaps_text=MERGED, resident=resident)
    # 6 MiB of the 8 MiB mapping are hugepages: at least what cannot lie outside the range
    assert huge.hugetlb % (2 * MiB) == 0 and max(0, 6 * MiB - (8 * MiB - length)) <= huge.hugetlb + 2 * MiB
    assert huge.hugetlb <= min(length, 6 * MiB) and huge.thp == huge.base == 0


def test_mincore_counts_the_resident_half_of_a_real_mapping():
    """The kernel's own answer for a mapping of this process: of 8 MiB anonymous memory whose
    first half was touched, the first half is resident in whole pages and the second not."""
    import ctypes
    import mmap

    from hicache.effects._host._tiers import resident_bytes

    size, page = 8 * MiB, mmap.PAGESIZE
    region = mmap.mmap(-1, size, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    region.madvise(mmap.MADV_NOHUGEPAGE)  # base pages: a THP would fault beyond the half
    for offset in range(0, size // 2, page):
        region[offset] = 1
    first = ctypes.c_char.from_buffer(region)
    ptr = ctypes.addressof(first)
    try:
        assert resident_bytes(ptr, size // 2) == size // 2
        assert resident_bytes(ptr + size // 2, size // 2) == 0
        assert resident_bytes(ptr + page + 10, 100) == page  # part of a page: the whole page
    finally:
        del first  # the exported view first, then the mapping can close
        region.close()


def test_mincore_counts_in_this_hosts_base_pages():
    """mincore answers one entry per base page, 64 KiB on some arm64 kernels: the unit the count
    multiplies by and aligns to is the OS's page size, read when the module loads (a process
    told its pages are 64 KiB counts in 64 KiB)."""
    import subprocess
    import sys

    code = ("import mmap; mmap.PAGESIZE = 65536\n"
            "from hicache.effects._host import _tiers\n"
            "print(_tiers.OS_PAGE)")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert result.stdout.split() == ["65536"]


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
    it is approximate - unless all of that mapping is resident in one tier."""
    size = 16 * MiB
    plan = plan_registration(size, granularity_bytes=2 * MiB, limits=Limits(chunk_limit_bytes=4 * MiB))
    allocator = HostTensorAllocator(prefault_threads=1, hugepages=hugepages)
    with bring_up([BufferRequest("kv", (size,), None, plan)], host=HostSetup(runtime=FakeRuntime(),
                                                                             ledger=HostLedger(), allocator=allocator),
                  budget=False) as handle:
        ((name, tiers),) = handle.tiers()
        ptr = handle.tensors[0].data_ptr()
        start, end, kernel = _kernel_says(ptr)
    assert name == "kv" and tiers.hugetlb == 0
    alone = (start, end) == (ptr, ptr + size)
    whole = end - start  # merged with a neighbour, the figures are still exact where all of it is one tier
    uniform = kernel.get("AnonHugePages", 0) == whole or (kernel.get("Rss", 0) == whole
                                                           and kernel.get("AnonHugePages", 0) == 0)
    assert tiers.exact == (alone or uniform)
    if hugepages == "off":
        assert tiers.thp == 0 and kernel.get("AnonHugePages", 0) == 0
        assert tiers.base == size if alone else tiers.base > 0
    elif alone:
        assert tiers.thp == kernel["AnonHugePages"] and tiers.thp + tiers.base == kernel["Rss"] == size
