"""The node store's page checksum and its stated guarantee (docs/store.md, issue #51): every
error confined to one 64-bit word - so every single-bit flip - and every error of at most two
bits changes it, in the C helper and in the fallback alike (bit for bit the same sums, checked
against an oracle written from the definition, word by word in Python integers). End to end, a
flipped bit anywhere in a stored page, a page whose words one sum cannot see changed (two words
swapped, +d on one and -d on another) and a stored checksum with either half changed all read as
a miss, never as a hit with other bytes."""

from __future__ import annotations

import ctypes
import platform
import random
import struct
from array import array

import pytest
from hypothesis import example, given
from hypothesis import strategies as st
from store_support import build_slotops, shm_dir  # noqa: F401 - shm_dir: a fixture

from hicache.effects import arena
from hicache.effects._arena import _slots
from hicache.plan._store import RECORD, SUM1, SUM2
from hicache.store import Namespace, open_store
from hicache.store._keys import slot_keys

torch = pytest.importorskip("torch")

OPS = ["python"] + (["native"] if _slots._native is not None else [])
MASK = 2**64 - 1
PAGE = 64 << 10  # 64 KiB: a 16-token page of a small model
WORDS = PAGE // 8
NS = Namespace(model="m", dtype="torch.bfloat16", page_tokens=16, layout="page_first/segments", pool="kv",
               page_bytes=PAGE, shard=(("tp", 0, 1),))


def oracle(words, seed1: int, seed2: int) -> tuple[int, int]:
    """The checksum from its definition: sum1 = seed1 + sum(w_i); sum2 = seed2 + sum((2N - p) x_p),
    x_p the 32-bit halves of the words, low half first; mod 2**64."""
    halves = [h for w in words for h in (w & 0xFFFFFFFF, w >> 32)]
    sum2 = seed2 + sum((len(halves) - p) * x for p, x in enumerate(halves))
    return (seed1 + sum(words)) & MASK, sum2 & MASK


def _sums(ops: str, buffer, count: int, seeds=(0x1234, 0x5678), stride: int = PAGE) -> list[tuple[int, int]]:
    """The checksums of ``count`` pages laid ``stride`` apart from ``buffer``'s start (direction 2:
    sum only)."""
    implementation = _slots.NativeSlotOps if ops == "native" else _slots.PythonSlotOps
    base = buffer.data_ptr()
    return implementation.copy_pages(2, [base + stride * i for i in range(count)], [0] * count, [PAGE] * count, 1,
                                     list(seeds) * count)


def _page(seed: int = 0):
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(-2**63, 2**63 - 1, (WORDS,), dtype=torch.int64, generator=generator)


@given(words=st.lists(st.integers(0, 2**64 - 1), min_size=1, max_size=70),
       cuts=st.lists(st.integers(1, 69), max_size=4, unique=True), seed1=st.integers(0, 2**64 - 1),
       seed2=st.integers(0, 2**64 - 1))
@example(words=[2**64 - 1] * 67, cuts=[1, 5, 66], seed1=2**64 - 1, seed2=2**64 - 1)  # every sum wraps
def test_both_implementations_compute_the_definitions_sum_for_any_split(words, cuts, seed1, seed2):
    """The fallback and the C helper (where built) give the oracle's sums for any words and seeds,
    however the page's segments cut it (lanes, blocks and tails of the C loop included)."""
    raw = bytearray(struct.pack(f"<{len(words)}Q", *words))
    buffer = (ctypes.c_char * len(raw)).from_buffer(raw)
    base = ctypes.addressof(buffer)
    bounds = [0, *sorted(c for c in cuts if c < len(words)), len(words)]
    lens = [8 * (b - a) for a, b in zip(bounds, bounds[1:])]
    ptrs = [base + 8 * a for a in bounds[:-1]]
    expected = oracle(words, seed1, seed2)
    for ops in OPS:
        implementation = _slots.NativeSlotOps if ops == "native" else _slots.PythonSlotOps
        assert implementation.copy_pages(2, [base], ptrs, lens, len(lens), [seed1, seed2]) == [expected], ops
    del buffer


def test_the_old_fold_would_fail_the_law_the_new_sum_keeps():
    """The flips issue #51 found (bit 7 of byte 15; bits 62 and 63 of word 3; the top bits of
    words 0 and 2, and of 0 and 8) left the old four-lane fold unchanged: here each changes the
    sum, in the oracle and in both implementations."""
    def old_fold(words):  # schema 1's sum: lanes a += w, b += a; (a0 + 2a1 + 3a2 + 4a3, b0 + .. + b3)
        a, b = [0] * 4, [0] * 4
        for i, w in enumerate(words):
            a[i % 4] = (a[i % 4] + w) & MASK
            b[i % 4] = (b[i % 4] + a[i % 4]) & MASK
        return sum((l + 1) * v for l, v in enumerate(a)) & MASK, sum(b) & MASK

    words = [random.Random(5).getrandbits(64) for _ in range(64)]
    flips = [[(1, 63)], [(3, 62)], [(3, 63)], [(0, 63), (2, 63)], [(0, 63), (8, 63)]]
    for flip in flips:
        bad = list(words)
        for word, bit in flip:
            bad[word] ^= 1 << bit
        assert old_fold(bad) == old_fold(words), flip  # what the old arenas served as a hit
        assert oracle(bad, 1, 2) != oracle(words, 1, 2), flip
        buffer = torch.tensor([w - 2**64 if w >= 2**63 else w for w in bad + words], dtype=torch.int64)
        for ops in OPS:
            implementation = _slots.NativeSlotOps if ops == "native" else _slots.PythonSlotOps
            base = buffer.data_ptr()
            new, old = implementation.copy_pages(2, [base, base + 512], [0, 0], [512, 512], 1, [1, 2, 1, 2])
            assert new != old, (ops, flip)


@pytest.mark.parametrize("ops", OPS)
def test_every_bit_of_a_pages_first_and_last_4_kib_and_a_sample_elsewhere_changes_the_sum(ops):
    """Each single-bit flip of every bit in the first and the last 4 KiB of a 64 KiB page, and of
    2,000 bits sampled elsewhere, gives another checksum (the C helper sums them all; the slower
    fallback every bit of the first and last 256 bytes and 500 sampled, its sums being the C
    helper's bit for bit)."""
    edge = 4096 if ops == "native" else 256
    sampled = 2000 if ops == "native" else 500
    rng = random.Random(51)
    bits = [*range(8 * edge), *range(8 * (PAGE - edge), 8 * PAGE),
            *rng.sample(range(8 * edge, 8 * (PAGE - edge)), sampled)]
    page = _page(1)
    (clean,) = _sums(ops, page, 1)
    batch = 256
    for first in range(0, len(bits), batch):
        chosen = bits[first:first + batch]
        pages = page.repeat(len(chosen), 1)
        as_bytes = pages.view(torch.uint8).view(len(chosen), PAGE)
        rows = torch.arange(len(chosen))
        offsets = torch.tensor([b // 8 for b in chosen])
        masks = torch.tensor([1 << (b % 8) for b in chosen], dtype=torch.uint8)
        as_bytes[rows, offsets] ^= masks
        sums = _sums(ops, pages, len(chosen))
        unchanged = [bit for bit, value in zip(chosen, sums) if value == clean]
        assert not unchanged, f"flipping bit(s) {unchanged[:8]} left the checksum unchanged"


@pytest.mark.parametrize("ops", OPS)
def test_every_double_bit_flip_tried_changes_the_sum(ops):
    """Two flipped bits change the checksum: random pairs anywhere in the page, and the pairs a
    sum of words cannot see - one bit position in two words, both directions, every position,
    distances 1 to 4096 words (powers of two: the case a 2-adic weight would miss)."""
    rng = random.Random(52)
    page = _page(2)
    (clean,) = _sums(ops, page, 1)
    pairs = [tuple(rng.sample(range(8 * PAGE), 2)) for _ in range(1500 if ops == "native" else 300)]
    for bit in range(0, 64, 1 if ops == "native" else 7):
        for distance in (1, 2, 4, 64, 1024, 4096):
            for _ in range(2):  # random words: one bit's two flips go the same way or opposite ways
                first = rng.randrange(WORDS - distance)
                pairs.append((64 * first + bit, 64 * (first + distance) + bit))
    batch = 256
    for start in range(0, len(pairs), batch):
        chosen = pairs[start:start + batch]
        pages = page.repeat(len(chosen), 1)
        as_bytes = pages.view(torch.uint8).view(len(chosen), PAGE)
        for row, (a, b) in enumerate(chosen):
            as_bytes[row, a // 8] ^= 1 << (a % 8)
            as_bytes[row, b // 8] ^= 1 << (b % 8)
        sums = _sums(ops, pages, len(chosen))
        unchanged = [pair for pair, value in zip(chosen, sums) if value == clean and pair[0] != pair[1]]
        assert not unchanged, f"flipping bit pairs {unchanged[:8]} left the checksum unchanged"


@pytest.mark.parametrize("ops", OPS)
def test_any_change_inside_one_word_changes_the_sum(ops):
    """An error confined to one 64-bit word - any nonzero xor, at any word - changes the sum (the
    guarantee's second half: sum1 moves by the word's difference)."""
    rng = random.Random(53)
    page = _page(3)
    (clean,) = _sums(ops, page, 1)
    count = 512 if ops == "native" else 64
    pages = page.repeat(count, 1)
    for row in range(count):
        word, xor = rng.randrange(WORDS), rng.getrandbits(64) or 1
        pages[row, word] = int(pages[row, word]) ^ (xor - 2**64 if xor >= 2**63 else xor)
    assert all(value != clean for value in _sums(ops, pages, count))


# -- end to end: a store's read ------------------------------------------------------------------


@pytest.fixture(params=OPS)
def stored(request, shm_dir):
    """A store holding 32 random 64 KiB pages under keys k0..k31, and those pages."""
    store = open_store(str(shm_dir / "arena"), size_bytes=8 << 20, slot_bytes=PAGE,
                       ops=arena.slot_ops(request.param))
    pages = torch.stack([_page(10 + i) for i in range(32)])
    keys = [f"k{i}" for i in range(32)]
    assert store.put(NS, keys, [[(pages[i].data_ptr(), PAGE)] for i in range(32)]) == [True] * 32
    try:
        yield store, pages, keys
    finally:
        store.close()


def _slot(store, key: str) -> int:
    return store.index.find(slot_keys(NS.digest, [key]))[0][0]


def _read_all(store, keys):
    out = torch.zeros(len(keys), WORDS, dtype=torch.int64)
    ok = store.get(NS, keys, [[(out[i].data_ptr(), PAGE)] for i in range(len(keys))])
    return ok, out


SUM_OFFSETS = {SUM1: 8 + 16, SUM2: 8 + 16 + 8}  # byte offsets in a record (hicache.plan._store.RECORD)


def test_the_sum_offsets_are_the_records():
    """The offsets the corruption test writes are where RECORD keeps sum1 and sum2."""
    raw = bytearray(RECORD.pack(0, bytes(16), 0x1111, 0x2222, 0, 0, 0, 0, 0, 0))
    assert [struct.unpack_from("<Q", raw, SUM_OFFSETS[f])[0] for f in (SUM1, SUM2)] == [0x1111, 0x2222]


def _word(store, slot: int, word: int) -> ctypes.c_uint64:
    return ctypes.c_uint64.from_address(store.arena.slot_addr(slot) + 8 * word)


@pytest.mark.parametrize("corrupt", [
    "bit 7 of byte 15", "bit 62 of word 3", "bit 63 of word 3", "top bits of words 0 and 2",
    "top bits of words 0 and 8", "two words of one lane swapped", "+d on one word, -d on another of its lane",
    "the stored sum1", "the stored sum2",
])
def test_a_corrupted_page_or_checksum_reads_as_a_miss_never_as_other_bytes(stored, corrupt):
    """issue #51's reproductions and the corruptions only one half of the checksum sees: the
    page reads as a miss, counts as corrupt (not torn), and every other page is still a hit with
    its own bytes."""
    store, pages, keys = stored
    slot = _slot(store, "k5")
    if corrupt == "bit 7 of byte 15":
        ctypes.c_uint8.from_address(store.arena.slot_addr(slot) + 15).value ^= 0x80
    elif corrupt.startswith("bit 6"):
        _word(store, slot, 3).value ^= 1 << int(corrupt.split()[1])
    elif corrupt.startswith("top bits"):
        for word in (0, int(corrupt.split()[-1])):
            _word(store, slot, word).value ^= 1 << 63
    elif corrupt == "two words of one lane swapped":  # words 4 and 12 differ: the page changes, sum1 does not
        a, b = _word(store, slot, 4), _word(store, slot, 12)
        assert a.value != b.value
        a.value, b.value = b.value, a.value
    elif corrupt.startswith("+d"):
        a, b = _word(store, slot, 4), _word(store, slot, 12)
        a.value, b.value = (a.value + 12345) & MASK, (b.value - 12345) & MASK
    else:  # one half of the record's checksum
        offset = SUM_OFFSETS[SUM1 if corrupt == "the stored sum1" else SUM2]
        ctypes.c_uint64.from_address(store.arena.record_addr(slot) + offset).value ^= 1 << 40
    ok, out = _read_all(store, keys)
    assert ok == [i != 5 for i in range(32)]
    assert torch.equal(out[[i for i in range(32) if i != 5]], pages[[i for i in range(32) if i != 5]])
    assert store.counts.corrupt == 1 and store.counts.torn == 0


def test_one_flipped_bit_in_each_of_many_pages_is_never_a_hit(stored):
    """issue #51's adversary: one random bit flipped in each of the 32 stored pages: 32 misses,
    32 corrupt, no hit."""
    store, pages, keys = stored
    rng = random.Random(54)
    for key in keys:
        bit = rng.randrange(8 * PAGE)
        ctypes.c_uint8.from_address(store.arena.slot_addr(_slot(store, key)) + bit // 8).value ^= 1 << (bit % 8)
    ok, _ = _read_all(store, keys)
    assert ok == [False] * 32 and store.counts.corrupt == 32 and store.counts.hits == 0


CANARY = 0xC0FFEE0DDBA11ADE  # every word a loop must not touch


@pytest.fixture(scope="session")
def sum_loops(tmp_path_factory):
    """The C helper's two copy-and-sum loops, each in a built module: this build's (SSE2 on x86-64)
    and the plain C loop a CPU without SSE2 runs (aarch64: Grace Hopper), built here from the same
    source with -DHICACHE_PORTABLE_SUM - so CI on x86-64 checks the loop it never runs itself."""
    portable = build_slotops(tmp_path_factory.mktemp("portable-sum"), "HICACHE_PORTABLE_SUM")
    assert portable.SSE2_SUM == 0, "the portable build still runs the SSE2 loop"
    if platform.machine() == "x86_64":
        assert _slots._native.SSE2_SUM == 1, "this build does not run the SSE2 loop: one loop would be checked twice"
    return {"built": _slots._native, "portable": portable}


def _words_at(n_words: int, shift: int):
    """A buffer of ``n_words`` canary words whose first word is ``shift`` bytes past a 16-byte
    boundary: (the buffer, its ctypes view, the first word's address, that word's byte offset)."""
    raw = bytearray(8 * n_words + 32)
    view = (ctypes.c_char * len(raw)).from_buffer(raw)
    skip = (-ctypes.addressof(view)) % 16 + shift
    struct.pack_into(f"<{n_words}Q", raw, skip, *[CANARY] * n_words)
    return raw, view, ctypes.addressof(view) + skip, skip


@given(words=st.lists(st.integers(0, 2**64 - 1), min_size=1, max_size=37),
       cuts=st.lists(st.integers(1, 36), max_size=4, unique=True), pages=st.integers(1, 3), threads=st.integers(0, 10),
       direction=st.sampled_from([0, 1, 2]), slot_shift=st.sampled_from([0, 8]), seg_shift=st.sampled_from([0, 8]),
       seeds=st.tuples(st.integers(0, 2**64 - 1), st.integers(0, 2**64 - 1)))
@example(words=list(range(1, 38)), cuts=[3, 4, 13], pages=3, threads=2, direction=0, slot_shift=8, seg_shift=8,
         seeds=(1, 2))  # slots 8 bytes off 16: the SSE2 loop must not stream there
@example(words=list(range(1, 20)), cuts=[3, 13], pages=2, threads=0, direction=2, slot_shift=0, seg_shift=8,
         seeds=(3, 4))  # segments that start mid-lane (a word at a time), a sum that must write nothing
@example(words=list(range(1, 20)), cuts=[5], pages=3, threads=9, direction=1, slot_shift=8, seg_shift=0,
         seeds=(5, 6))  # more threads than the helper starts (8) or than pages
def test_each_sum_loop_copies_exactly_and_sums_as_the_definition(sum_loops, words, cuts, pages, threads, direction,
                                                                 slot_shift, seg_shift, seeds):
    """Both C loops copy each page's words exactly - into its slot (a write), out of it into the
    page's segments (a read) or not at all (a sum) - touch no word beside them, and give the
    definition's sums: for any words, segment cuts, page and thread counts (0 runs on the caller's
    thread), with slots and segments on or 8 bytes off a 16-byte boundary."""
    n = len(words)
    bounds = [0, *sorted(c for c in cuts if c < n), n]
    per_page = len(bounds) - 1
    page_words = [[(w ^ (p * 0x9E3779B97F4A7C15)) & MASK for w in words] for p in range(pages)]
    slot_stride = n + 1  # a canary word after each slot, and the slots' 16-byte alignment alternating
    seg_words = n + per_page  # a canary word after each segment
    for name, module in sum_loops.items():
        slots_raw, slots_view, slots_at, slots_skip = _words_at(pages * slot_stride, slot_shift)
        segs_raw, segs_view, segs_at, segs_skip = _words_at(pages * seg_words, seg_shift)
        ptrs, lens = [], []
        for p in range(pages):
            at = p * seg_words
            for a, b in zip(bounds, bounds[1:]):
                ptrs.append(segs_at + 8 * at)
                lens.append(8 * (b - a))
                if direction == 0:
                    struct.pack_into(f"<{b - a}Q", segs_raw, segs_skip + 8 * at, *page_words[p][a:b])
                at += b - a + 1
            if direction != 0:
                struct.pack_into(f"<{n}Q", slots_raw, slots_skip + 8 * p * slot_stride, *page_words[p])
        slots_before, segs_before = bytes(slots_raw), bytes(segs_raw)
        sums = array("Q", list(seeds) * pages)
        slots = array("Q", [slots_at + 8 * slot_stride * p for p in range(pages)])
        module.copy_pages(direction, pages, per_page, slots, array("Q", ptrs), array("Q", lens), sums, threads)
        assert [tuple(sums[2 * p:2 * p + 2]) for p in range(pages)] == [oracle(w, *seeds) for w in page_words], name
        if direction == 0:  # each slot holds its page, the canary after it untouched; the segments unchanged
            expected = [w for p in range(pages) for w in (*page_words[p], CANARY)]
            assert list(struct.unpack_from(f"<{len(expected)}Q", slots_raw, slots_skip)) == expected, name
            assert bytes(segs_raw) == segs_before, name
        elif direction == 1:  # each segment holds its words, the canaries between them untouched
            expected = [w for p in range(pages) for a, b in zip(bounds, bounds[1:])
                        for w in (*page_words[p][a:b], CANARY)]
            assert list(struct.unpack_from(f"<{len(expected)}Q", segs_raw, segs_skip)) == expected, name
            assert bytes(slots_raw) == slots_before, name
        else:
            assert bytes(slots_raw) == slots_before and bytes(segs_raw) == segs_before, name
        del slots_view, segs_view
