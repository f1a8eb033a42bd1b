"""The node store's slot protocol, on a real tmpfs arena, with the C helper and with the fallback
(either reads what the other wrote): pages come back byte-exact; a key of another namespace, a
slot being written, one rewritten while it is copied, one with a flipped byte or another key's
bytes all read as a miss - never as those bytes, never as a wait; a dead writer's torn slot is
invisible and reclaimed by the next attach; a full window gives up its unreferenced tail pages
first. A hypothesis state machine checks no read ever returns bytes a key was not given."""

from __future__ import annotations

import ctypes
import os
import threading
from array import array

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule
from store_support import MovedOnAfterLookup, arena_of, leave_torn, shm_dir  # noqa: F401 - shm_dir: a fixture

from hicache.effects import arena
from hicache.effects._arena import _slots
from hicache.errors import ArenaGeometryError, TransferError
from hicache.plan import plan_store
from hicache.plan.store_format import RECORD_BYTES
from hicache.store import Namespace, NodeStore, open_store
from hicache.store._keys import slot_keys
from hicache.store._pages import PageSegments

torch = pytest.importorskip("torch")

OPS = ["python"] + (["native"] if _slots._native is not None else [])
SEGMENT, SEGMENTS = 1024, 4
PAGE = SEGMENT * SEGMENTS
NS = Namespace(model="m", dtype="torch.bfloat16", page_tokens=16, layout="page_first/segments", pool="kv",
               page_bytes=PAGE, shard=(("tp", 0, 2),))
#: an arena of exactly one window of slots: every key competes for the same 16 slots
ONE_WINDOW = arena_of(16, PAGE)


class Pages:
    """``count`` pages of random bytes as a pool would hold them, and their segment lists."""

    def __init__(self, count: int, seed: int = 0) -> None:
        generator = torch.Generator().manual_seed(seed)
        self.data = torch.randint(0, 256, (count, PAGE), dtype=torch.uint8, generator=generator)

    def segments(self, rows=None) -> list:
        rows = range(self.data.shape[0]) if rows is None else rows
        return [[(self.data[r].data_ptr() + s * SEGMENT, SEGMENT) for s in range(SEGMENTS)] for r in rows]


def _open(directory, ops: str, *, total: int = 8 << 20, **kwargs) -> NodeStore:
    return open_store(str(directory / "arena"), size_bytes=total, slot_bytes=PAGE, ops=arena.slot_ops(ops), **kwargs)


def _attach(directory, ops: str) -> NodeStore:
    """Another attach of the arena `_open` made there (as the next engine's, or a restart's)."""
    return open_store(str(directory / "arena"), size_bytes=None, slot_bytes=PAGE, ops=arena.slot_ops(ops))


def _slot_of(store: NodeStore, key: str) -> int:
    """The slot ``key`` of NS is held in (`arena.NOT_FOUND` when none)."""
    return store.index.find(slot_keys(NS.digest, [key]))[0][0]


@pytest.fixture(params=OPS)
def ops(request):
    return request.param


def test_pages_round_trip_byte_exact_and_the_other_implementation_reads_them(shm_dir, ops):
    """Written with one implementation, read by the other after a re-attach: the same bytes."""
    store, src = _open(shm_dir, ops), Pages(10, seed=1)
    keys = [f"k{i}" for i in range(10)]
    assert store.put(NS, keys, src.segments()) == [True] * 10
    store.close()
    other = "native" if ops == "python" and "native" in OPS else "python"
    again = open_store(
        str(shm_dir / "arena"), size_bytes=None, slot_bytes=PAGE, ops=arena.slot_ops(other))
    dst = Pages(10, seed=2)
    try:
        assert again.get(NS, keys, dst.segments()) == [True] * 10
        assert torch.equal(src.data, dst.data)
        assert again.counts.hits == 10 and again.arena.counters()["writes"] == 10
    finally:
        again.close()


def test_exists_counts_the_leading_run_and_a_miss_stops_it(shm_dir, ops):
    """exists counts the leading run of stored keys (a miss stops it), present answers per key."""
    store, src = _open(shm_dir, ops), Pages(4)
    try:
        store.put(NS, ["a", "b", "d"], src.segments([0, 1, 3]))
        assert store.exists(NS, ["a", "b", "c", "d"]) == 2
        assert store.exists(NS, ["c", "a"]) == 0
        assert store.present(NS, ["a", "c", "d"]) == [True, False, True]
    finally:
        store.close()


@pytest.mark.parametrize("other", [
    Namespace(model="m2", dtype="torch.bfloat16", page_tokens=16, layout="page_first/segments", pool="kv",
              page_bytes=PAGE, shard=(("tp", 0, 2),)),
    Namespace(model="m", dtype="torch.bfloat16", page_tokens=16, layout="page_first/segments", pool="kv",
              page_bytes=PAGE, shard=(("tp", 1, 2),)),
    Namespace(model="m", dtype="torch.float8_e4m3fn", page_tokens=16, layout="page_first/segments", pool="kv",
              page_bytes=PAGE, shard=(("tp", 0, 2),)),
    Namespace(model="m", dtype="torch.bfloat16", page_tokens=16, layout="layer_first/segments", pool="kv",
              page_bytes=PAGE, shard=(("tp", 0, 2),)),
], ids=["model", "tp-rank", "dtype", "layout"])
def test_another_namespace_misses_the_same_key(shm_dir, ops, other):
    """Another model, TP rank, dtype or layout under SGLang's same page key: a miss."""
    store, src, dst = _open(shm_dir, ops), Pages(1), Pages(1, seed=9)
    try:
        store.put(NS, ["k"], src.segments())
        assert store.exists(other, ["k"]) == 0
        assert store.get(other, ["k"], dst.segments()) == [False]
        assert not torch.equal(src.data, dst.data)
    finally:
        store.close()


@pytest.mark.concurrency
def test_a_slot_being_written_reads_as_a_miss_without_waiting(shm_dir, ops):
    """A writer stopped after claiming its slot (an Event it waits on) - the reader's get of
    that key returns False while the writer is still stopped, and other keys still hit."""
    claimed, release = threading.Event(), threading.Event()

    def hook(stage, page):
        if stage == "claimed":
            claimed.set()
            assert release.wait(60), "hang guard"

    writer_store, reader_store = _open(shm_dir, ops, fault_hook=hook), _open(shm_dir, ops)
    src, dst = Pages(2), Pages(2, seed=5)
    try:
        reader_store.put(NS, ["held"], src.segments([0]))
        writer = threading.Thread(target=writer_store.put, args=(NS, ["new"], src.segments([1])))
        writer.start()
        assert claimed.wait(60), "hang guard"
        assert reader_store.get(NS, ["new", "held"], dst.segments()) == [False, True]
        assert writer.is_alive() and not release.is_set()  # the read did not wait for the writer
        release.set()
        writer.join(60)
        assert reader_store.get(NS, ["new"], dst.segments([0])) == [True]
        assert torch.equal(dst.data[0], src.data[1])
    finally:
        release.set()
        writer_store.close()
        reader_store.close()


def test_a_page_rewritten_while_it_is_copied_is_torn_not_returned(shm_dir, ops):
    """A writer that republishes the slot after the reader's lookup (its generation moved on by
    two, its length the same, so the copy runs): the read is a miss, counted torn, and the slot
    is left alone - the next read, over the slot as it stands, is a hit."""
    store, src, dst = _open(shm_dir, ops), Pages(1), Pages(1, seed=3)
    store.put(NS, ["k"], src.segments())
    real = store.index.ops
    store.index.ops = MovedOnAfterLookup(real, lambda found, gens: [gens[0] - 2])
    try:
        assert store.get(NS, ["k"], dst.segments()) == [False]
        assert (store.counts.torn, store.counts.corrupt) == (1, 0)
        store.index.ops = real
        assert store.get(NS, ["k"], dst.segments()) == [True] and dst.data[0].equal(src.data[0])
    finally:
        store.close()


def test_a_flipped_byte_in_a_stored_page_is_a_miss_and_the_slot_is_reclaimed(shm_dir, ops):
    """A flipped byte in a stored page reads as a miss, counts as corrupt, and the slot is
    reclaimed."""
    store, src, dst = _open(shm_dir, ops), Pages(1), Pages(1, seed=4)
    try:
        store.put(NS, ["k"], src.segments())
        slot = _slot_of(store, "k")
        ctypes.c_uint8.from_address(store.arena.slot_addr(slot) + 777).value ^= 0x10
        assert store.get(NS, ["k"], dst.segments()) == [False]
        assert store.counts.corrupt == 1 and store.exists(NS, ["k"]) == 0
    finally:
        store.close()


def test_a_corrupt_page_in_a_batch_reclaims_only_its_own_slot(shm_dir, ops):
    """One flipped page in a batch read: that key misses and its slot is reclaimed; the batch's
    good pages are delivered and stay held (a reclaim reaching past the corrupt one would wipe them)."""
    store, src, dst = _open(shm_dir, ops), Pages(3), Pages(3, seed=4)
    try:
        store.put(NS, ["a", "b", "c"], src.segments())
        slot = _slot_of(store, "b")
        ctypes.c_uint8.from_address(store.arena.slot_addr(slot) + 9).value ^= 0x01
        assert store.get(NS, ["a", "b", "c"], dst.segments()) == [True, False, True]
        assert store.counts.corrupt == 1 and store.present(NS, ["a", "b", "c"]) == [True, False, True]
        assert store.get(NS, ["a", "c"], Pages(2, seed=5).segments()) == [True, True]
    finally:
        store.close()


def test_a_corrupt_slot_a_writer_rewrote_since_it_was_read_is_not_reclaimed(shm_dir, ops):
    """A reader that found a slot corrupt reclaims it only as it saw it: a writer that published
    the slot anew meanwhile (its generation moved on) keeps its page."""
    store, src, dst = _open(shm_dir, ops), Pages(1), Pages(1, seed=4)
    try:
        store.put(NS, ["k"], src.segments())
        slot = _slot_of(store, "k")
        record = store.arena.record_addr(slot)
        real = store.index.ops
        ctypes.c_uint8.from_address(store.arena.slot_addr(slot) + 9).value ^= 0x01

        class RewrittenAfterTheRead:
            """The arena's ops; right after the read, a writer puts the page back and publishes it."""

            def __getattr__(self, name):
                return getattr(real, name)

            def read_pages(self, *args, **kwargs):
                result = real.read_pages(*args, **kwargs)
                ctypes.c_uint8.from_address(store.arena.slot_addr(slot) + 9).value ^= 0x01
                real.store(record, real.load(record) + 2)  # odd, then even again: a new publication
                return result

        store.index.ops = RewrittenAfterTheRead()
        assert store.get(NS, ["k"], dst.segments()) == [False] and store.counts.corrupt == 1
        store.index.ops = real
        assert store.get(NS, ["k"], dst.segments()) == [True] and dst.data[0].equal(src.data[0])
    finally:
        store.close()


def test_a_torn_slot_published_since_the_scan_is_not_reclaimed(shm_dir, ops):
    """reclaim_torn scans for odd generations, then reclaims each: one a writer published in
    between (even now) keeps its page."""
    store, src, dst = _open(shm_dir, ops), Pages(1), Pages(1, seed=4)
    try:
        store.put(NS, ["k"], src.segments())
        slot = _slot_of(store, "k")
        scanned = store.index._columns().clone()
        scanned[slot, 0] += 1  # the scan saw it claimed (odd); it is published (even) by the reclaim
        store.index._columns = lambda: scanned
        assert store.index.reclaim_torn() == 0
        assert store.get(NS, ["k"], dst.segments()) == [True] and dst.data[0].equal(src.data[0])
    finally:
        store.close()


def test_another_keys_bytes_and_checksum_in_a_slot_read_as_a_miss(shm_dir, ops):
    """A forged slot - key B's record given key A's bytes and A's checksum - misses: the
    checksum is seeded by the key."""
    store, src, dst = _open(shm_dir, ops), Pages(2), Pages(1, seed=6)
    try:
        store.put(NS, ["a", "b"], src.segments())
        slot_a, slot_b = store.index.find(slot_keys(NS.digest, ["a", "b"]))[0]
        ctypes.memmove(store.arena.slot_addr(slot_b), store.arena.slot_addr(slot_a), PAGE)
        ctypes.memmove(store.arena.record_addr(slot_b) + 24, store.arena.record_addr(slot_a) + 24, 16)  # sums
        assert store.get(NS, ["b"], dst.segments()) == [False]  # a miss: SGLang uses no byte of it
        assert store.counts.corrupt == 1
    finally:
        store.close()


def test_a_dead_writers_torn_slot_is_invisible_and_reclaimed_by_the_next_attach(shm_dir, ops):
    """An odd generation with its lock free (its writer is gone): exists and get miss; the next
    attach reclaims it and the key can be stored again."""
    store, src, dst = _open(shm_dir, ops), Pages(1), Pages(1, seed=7)
    store.put(NS, ["k"], src.segments())
    slot = _slot_of(store, "k")
    addr = store.arena.record_addr(slot)
    store.arena.ops.store(addr, store.arena.ops.load(addr) + 1)  # as a writer killed after claiming
    assert store.exists(NS, ["k"]) == 0 and store.get(NS, ["k"], dst.segments()) == [False]
    assert store.census().torn == 1
    store.close()
    again = _attach(shm_dir, ops)
    try:
        assert again.reclaimed == 1 and again.census().torn == 0
        assert again.put(NS, ["k"], src.segments()) == [True] and again.get(NS, ["k"], dst.segments()) == [True]
    finally:
        again.close()


def _counting_ops(ops: str):
    """The slot-ops class ``ops`` names, but logging each clear_slots call's slots; and that log."""
    base, calls = arena.slot_ops(ops), []

    class Counting(base):
        @staticmethod
        def clear_slots(*args):
            calls.append(list(args[4]))
            return base.clear_slots(*args)

    return Counting, calls


def test_a_dead_writers_whole_batch_of_torn_slots_is_reclaimed_a_batch_per_call(shm_dir, ops, monkeypatch):
    """A writer killed mid-batch leaves many torn slots: the next attach reclaims every one in
    ascending batches of CLEAR_BATCH slots, one call of the slot ops each (not one a slot), and
    leaves the published pages around them byte-exact."""
    monkeypatch.setattr("hicache.store._index.CLEAR_BATCH", 128)
    store, src = _open(shm_dir, ops), Pages(400, seed=9)
    keys = [f"k{i}" for i in range(400)]
    assert store.put(NS, keys, src.segments()) == [True] * 400
    slots = store.index.find(slot_keys(NS.digest, keys))[0]
    torn = sorted(slots[:300])
    for slot in torn:
        leave_torn(store, slot)
    assert store.census().torn == 300
    store.close()
    counting, cleared = _counting_ops(ops)
    again = open_store(str(shm_dir / "arena"), size_bytes=None, slot_bytes=PAGE, ops=counting)
    try:
        assert again.reclaimed == 300 and again.census().torn == 0
        assert cleared == [torn[:128], torn[128:256], torn[256:]]
        dst = Pages(100, seed=10)
        assert again.get(NS, keys[300:], dst.segments()) == [True] * 100 and dst.data.equal(src.data[300:])
        assert again.exists(NS, keys[:300]) == 0
    finally:
        again.close()


def test_a_live_writers_torn_slot_is_left_to_it_by_the_next_attach(shm_dir, ops):
    """An odd generation whose slot lock another open file still holds (its writer is alive, mid-
    write): the next attach leaves it torn - reclaiming it would wipe the writer's record under
    it - and the attach after the writer let go reclaims it."""
    store, src = _open(shm_dir, ops), Pages(1)
    store.put(NS, ["k"], src.segments())
    slot = _slot_of(store, "k")
    addr = store.arena.record_addr(slot)
    store.arena.ops.store(addr, store.arena.ops.load(addr) + 1)  # as a writer that claimed the slot
    offset = store.arena.plan.record_offset(slot)
    store.close()
    writer = os.open(shm_dir / "arena", os.O_RDWR)
    try:
        assert arena.try_lock(writer, offset, RECORD_BYTES)  # the writer's own open file holds it
        again = _attach(shm_dir, ops)
        try:
            assert again.reclaimed == 0 and again.census().torn == 1
        finally:
            again.close()
    finally:
        os.close(writer)  # the writer is gone: its lock with it
    after = _attach(shm_dir, ops)
    try:
        assert after.reclaimed == 1 and after.census().torn == 0
    finally:
        after.close()


def test_a_window_whose_every_slot_another_writer_holds_stores_nothing_and_says_so(shm_dir, ops):
    """Every slot of the key's window locked by other writers (their open files): the page is not
    stored, `put` says False for it without waiting, and the keys already held still say True."""
    store, src = _open(shm_dir, ops, total=ONE_WINDOW), Pages(2)
    try:
        assert store.arena.plan.slots == 16
        assert store.put(NS, ["held"], Pages(1, seed=9).segments()) == [True]
        others = os.open(shm_dir / "arena", os.O_RDWR)
        try:
            for slot in range(16):
                assert arena.try_lock(others, store.arena.plan.record_offset(slot), RECORD_BYTES)
            assert store.put(NS, ["held", "new"], src.segments()) == [True, False]
            assert store.present(NS, ["held", "new"]) == [True, False] and store.counts.writes == 1
        finally:
            os.close(others)
        assert store.put(NS, ["new"], Pages(1).segments()) == [True]  # the writers are gone: it goes in
    finally:
        store.close()


def test_a_full_window_evicts_unreferenced_tail_pages_first(shm_dir, ops):
    """Sixteen slots hold one 16-page chain; its first 8 pages are read (referenced). Eight new
    pages evict pages 15..8 - the chain's leading 8 still answer, all new pages are held."""
    store = _open(shm_dir, ops, total=ONE_WINDOW)
    assert store.arena.plan.slots == 16
    chain, fresh = Pages(16), Pages(8, seed=8)
    keys = [f"c{i}" for i in range(16)]
    try:
        assert store.put(NS, keys, chain.segments(), first_depth=0) == [True] * 16
        assert store.get(NS, keys[:8], Pages(8, seed=0).segments()) == [True] * 8
        for i in range(8):
            assert store.put(NS, [f"n{i}"], fresh.segments([i]), first_depth=0) == [True]
            assert store.present(NS, keys) == [True] * (15 - i) + [False] * (i + 1)
        assert store.exists(NS, keys) == 8 and store.counts.evictions == 8
        assert store.exists(NS, [f"n{i}" for i in range(8)]) == 8
    finally:
        store.close()


def test_a_page_read_gets_its_second_chance_before_eviction(shm_dir, ops):
    """CLOCK's referenced bit, set by a hit: the deep half of a 16-page chain is read, so eight
    new pages evict the unreferenced shallow half instead (deepest first) - the pages read stay."""
    store = _open(shm_dir, ops, total=ONE_WINDOW)
    chain, fresh = Pages(16), Pages(8, seed=8)
    keys = [f"c{i}" for i in range(16)]
    try:
        assert store.put(NS, keys, chain.segments(), first_depth=0) == [True] * 16
        assert store.get(NS, keys[8:], Pages(8, seed=0).segments()) == [True] * 8
        for i in range(8):
            assert store.put(NS, [f"n{i}"], fresh.segments([i]), first_depth=0) == [True]
            assert store.present(NS, keys) == [True] * (7 - i) + [False] * (i + 1) + [True] * 8
    finally:
        store.close()


def test_a_slot_given_past_the_index_or_being_written_reads_as_a_miss(shm_dir, ops):
    """read_pages over a caller's own lookup (the seam the tests move slots on through) takes a
    slot number at or past the index's end, or a slot given with an odd generation (a writer's,
    mid-write), as not held: no record past the index is read, no byte copied."""
    store, src, dst = _open(shm_dir, ops), Pages(1), Pages(1, seed=4)
    try:
        store.put(NS, ["k"], src.segments())
        plan, base, batch = store.arena.plan, store.arena.base, PageSegments.of(dst.segments())
        held = _slot_of(store, "k")
        for slot, gen in ((plan.slots, 2), (plan.slots + 1, 2), (2**63, 2), (held, 1), (held, 3)):
            status, _, _ = store.index.ops.read_pages(
                base + plan.index_offset, base + plan.data_offset, plan.slots, plan.window, plan.slot_stride, PAGE,
                slot_keys(NS.digest, ["k"]), batch.ptrs, batch.sizes, SEGMENTS, found=[slot], gens=[gen])
            assert list(status) == [_slots.MISS], (slot, gen)
        assert not dst.data[0].equal(src.data[0])
    finally:
        store.close()


def test_slot_ops_gives_the_implementation_asked_for(monkeypatch):
    """``python`` is the fallback, ``native`` the C helper (an ImportError naming the build where
    it is absent), ``auto`` the C helper where built; anything else is refused by name - so the
    suite's two ``ops`` runs really are the two implementations."""
    assert arena.slot_ops("python") is arena.PythonSlotOps
    if _slots._native is not None:
        assert arena.slot_ops("native") is arena.NativeSlotOps and arena.slot_ops("auto") is arena.NativeSlotOps
    with pytest.raises(ValueError, match="slot ops must be auto, native or python, got 'c'"):
        arena.slot_ops("c")
    monkeypatch.setattr(_slots, "_native", None)
    assert arena.slot_ops("auto") is arena.PythonSlotOps
    with pytest.raises(ImportError, match="_slotops was not built"):
        arena.slot_ops("native")


_BAD_READS = {  # name: plan -> (segment sizes, the page bytes the call claims)
    "short": lambda plan: ([PAGE - 8], PAGE),
    "long": lambda plan: ([PAGE + 8], PAGE),
    "not words": lambda plan: ([PAGE - 4, 4], PAGE),
    "empty": lambda plan: ([0, PAGE], PAGE),
    "a page past its slot": lambda plan: ([plan.slot_stride + 8], plan.slot_stride + 8),
    "a page not whole words": lambda plan: ([PAGE - 4], PAGE - 4),
}


@pytest.mark.parametrize("case", sorted(_BAD_READS))
def test_read_pages_itself_refuses_segments_that_are_not_one_page_of_words(shm_dir, ops, case):
    """The ops' own guard under NodeStore's (a caller that skipped it): segments short of a
    page, past it, not whole 8-byte words or empty - or a page that is itself not whole words
    or larger than a slot (its copy would read the next slot, or past the arena) - are a
    ValueError before any byte moves."""
    store, src = _open(shm_dir, ops), Pages(1)
    store.put(NS, ["k"], src.segments())
    plan, base = store.arena.plan, store.arena.base
    sizes, page_bytes = _BAD_READS[case](plan)
    out = torch.zeros(sum(sizes) + 8, dtype=torch.uint8)
    ptrs = array("Q", [out.data_ptr() + sum(sizes[:i]) for i in range(len(sizes))])
    try:
        with pytest.raises(ValueError, match="read_pages"):
            store.index.ops.read_pages(base + plan.index_offset, base + plan.data_offset, plan.slots, plan.window,
                                       plan.slot_stride, page_bytes, slot_keys(NS.digest, ["k"]), ptrs,
                                       array("Q", sizes), len(sizes))
        assert not out.any()
    finally:
        store.close()


def test_the_c_helper_reads_records_laid_out_as_the_plan_says():
    """The built helper's record offsets are hicache.plan's RECORD. A stale build of another
    layout is never used (the fallback reads records then) - and where one is built for this
    interpreter it must not be stale, or the suite's two ``ops`` runs would both be the fallback."""
    import importlib.machinery
    import pathlib

    built = [path for suffix in importlib.machinery.EXTENSION_SUFFIXES
             for path in pathlib.Path(_slots.__file__).parent.glob("_slotops" + suffix)]
    if not built:
        pytest.skip("the C helper is not built here (no compiler): the fallback reads the plan's layout")
    assert _slots._native is not None, f"{built[0]} is a stale build of another record layout: rebuild it (make)"
    import struct

    from hicache.plan._store import RECORD, RECORD_BYTES, REF_OFFSET

    assert RECORD.format == "<Q16sQQIIHBxIQ"  # gen, key, sum1, sum2, length, ...: the offsets below
    plan_layout = {"RECORD_BYTES": RECORD_BYTES, "OFF_SUM1": struct.calcsize("<Q16s"),
                   "OFF_SUM2": struct.calcsize("<Q16sQ"), "OFF_LENGTH": struct.calcsize("<Q16sQQ"),
                   "OFF_DEPTH": struct.calcsize("<Q16sQQI"), "OFF_REF": REF_OFFSET,
                   "OFF_NS": struct.calcsize("<Q16sQQII"), "OFF_WRITER": struct.calcsize("<Q16sQQIIHBx"),
                   "OFF_STAMP": struct.calcsize("<Q16sQQIIHBxI")}
    assert _slots._RECORD_LAYOUT == plan_layout
    assert {name: getattr(_slots._native, name) for name in plan_layout} == plan_layout


def _q(*values) -> array:
    return array("Q", values)


#: read_pages' and write_pages' arguments in a call the helper takes: one page of one 16-byte
#: segment, 4 slots of 64 bytes, a window of one (u64 arrays as tuples, the status by its length)
_READ = dict(index_addr=0, data_addr=0, nslots=4, window=1, slot_stride=64, page_bytes=16, keys=bytes(16),
             seg_ptrs=(0,), seg_lens=(16,), per_page=1, status=1, found=(0,), gens=(0,))
_WRITE = dict(index_addr=0, data_addr=0, fd=-1, index_offset=0, nslots=4, window=1, slot_stride=64, page_bytes=16,
              keys=bytes(16), seg_ptrs=(0,), seg_lens=(16,), per_page=1, order=(0,), seen=(0,), depths=(0,),
              namespace=0, pid=1, stamp=0, status=1)


def _args(good: dict, changes: dict) -> tuple:
    """A good call's arguments but for ``changes``, as the helper takes them."""
    fields = {**good, **changes}
    return tuple(_q(*value) if isinstance(value, tuple) else bytearray(value) if name == "status" else value
                 for name, value in fields.items())


def _read_args(**changes) -> tuple:
    return _args(_READ, changes)


def _write_args(**changes) -> tuple:
    return _args(_WRITE, changes)


#: (helper function, its arguments, the refusal): each call is wrong in one way the Python layer
#: never lets through - the helper's own second check, which must refuse before it touches any
#: address it was given (every address here is 0) and give back every buffer it had taken
_HELPER_REFUSALS = [
    ("copy_pages", (3, 1, 1, _q(0), _q(0), _q(8), _q(0, 0)), "bad direction"),
    ("copy_pages", (0, 2, 1, _q(0), _q(0, 0), _q(8, 8), _q(0, 0, 0, 0)), "slots holds 8 bytes, 16 needed"),
    ("copy_pages", (0, 1, 1, _q(0), _q(0), _q(8), _q(0)), "sums holds 8 bytes, 16 needed"),
    ("copy_pages", (0, 1, 0, _q(0), _q(), _q(), _q(0, 0)), "bad direction, page or segment count"),
    ("copy_pages", (0, 8, 1, _q(*[0] * 7), _q(*[0] * 8), _q(*[8] * 8), _q(*[0] * 16)),
     "slots holds 56 bytes, 64 needed"),
    ("lookup", (0, 0, 1, bytes(16), _q(0), _q(0)), "lookup: bad slot count"),
    ("lookup", (0, 4, 0, bytes(16), _q(0), _q(0)), "lookup: bad slot count, window"),
    ("lookup", (0, 4, 1, bytes(16), _q(0), _q()), "gens holds 0 bytes, 8 needed"),
    ("victims", (0, 4, 65, bytes(16), _q(*[0] * 65), _q(*[0] * 65)), "window \\(1-64"),
    ("victims", (0, 4, 2, bytes(16), _q(0, 0), _q(0)), "gens holds 8 bytes, 16 needed"),
    ("victims", (0, 0, 1, bytes(16), _q(0), _q(0)), "victims: bad"),
    ("victims", (0, 4, 0, bytes(16), _q(), _q()), "victims: bad"),
    ("victims", (0, 4, 5, bytes(16), _q(*[0] * 5), _q(*[0] * 5)), "victims: bad"),
    ("victims", (0, 100, 65, bytes(16), _q(*[0] * 65), _q(*[0] * 65)), "victims: bad"),
    ("victims", (0, 4, 1, bytes(15), _q(0), _q(0)), "victims: bad"),
    ("read_pages", _read_args(page_bytes=12, seg_lens=(12,)), "read_pages: bad"),
    ("read_pages", _read_args(nslots=0), "read_pages: bad"),
    ("read_pages", _read_args(window=0), "read_pages: bad"),
    ("read_pages", _read_args(seg_ptrs=(), seg_lens=(), per_page=0), "read_pages: bad"),
    ("read_pages", _read_args(keys=bytes(15)), "read_pages: bad"),
    ("read_pages", _read_args(status=0), "status holds 0 bytes, 1 needed"),
    ("read_pages", _read_args(seg_lens=(8,)), "page 0's segments are not whole words adding up to 16"),
    ("write_pages", _write_args(nslots=0), "write_pages: bad"),
    ("write_pages", _write_args(window=0, order=(), seen=()), "write_pages: bad"),
    ("write_pages", _write_args(seg_ptrs=(), seg_lens=(), per_page=0), "write_pages: bad"),
    ("write_pages", _write_args(keys=bytes(15)), "write_pages: bad"),
    ("write_pages", _write_args(page_bytes=12, seg_lens=(12,)), "write_pages: bad"),
    ("write_pages", _write_args(page_bytes=128, seg_lens=(128,)), "write_pages: bad"),
    ("write_pages", _write_args(namespace=0x10000), "namespace entry"),
    ("write_pages", _write_args(order=(9,)), "slot 9 is past the arena's 4"),
    ("write_pages", _write_args(order=(4,)), "slot 4 is past the arena's 4"),
    ("write_pages", _write_args(seg_lens=(24,)), "page 0's segments are not whole words adding up to 16"),
    ("write_pages", _write_args(status=0), "status holds 0 bytes, 1 needed"),
    ("write_pages", _write_args(window=2, seen=(0, 0)), "order holds 8 bytes, 16 needed"),
    ("check_segments", (_q(0), _q(8), 0, 8, 0, 0), "per_page must be >= 1"),
    ("check_segments", (_q(0, 0), _q(8), 1, 8, 0, 0), "differ in count"),
]


@pytest.mark.parametrize("name, args, refusal", _HELPER_REFUSALS, ids=lambda v: v if isinstance(v, str) else "")
def test_the_c_helper_refuses_a_bad_call_before_touching_memory(name, args, refusal):
    """The store's C helper checks its own arguments too - counts, windows, buffer lengths, a
    slot past the arena, segments that are not one page - and refuses with a ValueError naming
    what is wrong, having read and written nothing (every address given is 0: touching one would
    end the process). Under `make test-sanitized` ASan also holds each refusal's release of the
    buffers it had taken."""
    if _slots._native is None:
        pytest.skip("the C helper is not built here (no compiler): the Python fallback has no second check")
    with pytest.raises(ValueError, match=refusal):
        getattr(_slots._native, name)(*args)


@pytest.mark.parametrize("sums, error", [(bytes(16), BufferError), (None, TypeError)], ids=["read-only", "no buffer"])
def test_the_c_helper_refuses_a_buffer_it_cannot_write(sums, error):
    """A sums buffer the helper cannot write (bytes) or no buffer at all: the buffer request's own
    error comes out, before any address given (all 0) is touched."""
    if _slots._native is None:
        pytest.skip("the C helper is not built here (no compiler): the Python fallback has no second check")
    with pytest.raises(error):
        _slots._native.copy_pages(0, 1, 1, _q(0), _q(0), _q(8), sums)


def test_the_c_helper_writes_nothing_past_its_batch():
    """Output buffers longer than the batch keep their extra entries: lookup, victims, read_pages
    and copy_pages write each key's or page's answers and not one past them (over an index of
    empty slots: every key a miss, answered as one over whatever the caller's buffer held)."""
    if _slots._native is None:
        pytest.skip("the C helper is not built here (no compiler)")
    canary = 0xC0FFEE0DDBA11ADE
    index, page = (ctypes.c_char * (4 * 64))(), ctypes.create_string_buffer(b"0123456789abcdef", 16)
    at, key = ctypes.addressof(index), bytes(16)
    found, gens = _q(7, canary), _q(5, canary)
    _slots._native.lookup(at, 4, 2, key, found, gens)
    assert list(found) == [arena.NOT_FOUND, canary] and list(gens) == [0, canary]
    slots, gens = _q(*[0] * 2, canary), _q(*[0] * 2, canary)
    _slots._native.victims(at, 4, 2, key, slots, gens)
    assert (slots[2], gens[2]) == (canary, canary)
    status, found, gens = bytearray(b"\x07\xab"), _q(7, canary), _q(5, canary)
    _slots._native.read_pages(at, 0, 4, 2, 64, 16, key, _q(ctypes.addressof(page)), _q(16), 1, status, found, gens)
    assert list(status) == [_slots.MISS, 0xAB] and list(found) == [arena.NOT_FOUND, canary]
    assert list(gens) == [0, canary]
    sums = _q(1, 2, canary)
    _slots._native.copy_pages(2, 1, 1, _q(ctypes.addressof(page)), _q(0), _q(16), sums)
    assert sums[2] == canary


@pytest.mark.parametrize("direction", [0, 1, 2])
def test_the_c_helper_takes_an_empty_batch(direction):
    """No pages is a call that does nothing, not an error (and no page fails the segment check):
    the store's write path hands the helper the pages it claimed, none when every window is busy."""
    if _slots._native is None:
        pytest.skip("the C helper is not built here (no compiler)")
    assert _slots._native.copy_pages(direction, 0, 1, _q(), _q(), _q(), _q()) is None
    assert _slots._native.check_segments(_q(), _q(), 1, 8, 0, 0) == -1  # no page fails


def test_bad_pages_are_refused_before_any_copy(shm_dir, ops):
    """Segments that are not one page, or a page larger than a slot: errors naming them."""
    store = _open(shm_dir, ops)
    try:
        with pytest.raises(TransferError, match="not one page"):
            store.put(NS, ["k"], [[(Pages(1).data.data_ptr(), PAGE - 8)]])
        with pytest.raises(TransferError, match="1 keys but 2 pages"):
            store.put(NS, ["k"], Pages(2).segments())
        with pytest.raises(ArenaGeometryError, match="does not fit"):
            store.exists(Namespace(model="m", dtype="x", page_tokens=1, layout="l", pool="kv", page_bytes=2 * PAGE),
                         ["k"])
    finally:
        store.close()


class NoWrongBytes(RuleBasedStateMachine):
    """Puts, gets, dead writers and reattaches on a one-window arena: a get that says True
    always delivers the bytes that key was given; a key never given never hits."""

    def __init__(self) -> None:
        super().__init__()
        self.store = None

    @initialize(ops=st.sampled_from(OPS))
    def start(self, ops):
        import tempfile

        self.directory = tempfile.mkdtemp(prefix="hicache-test-", dir="/dev/shm")
        self.ops = ops
        self.store = open_store(self.directory + "/arena", size_bytes=ONE_WINDOW, slot_bytes=PAGE,
                                ops=arena.slot_ops(ops))
        self.pages = Pages(24, seed=11)
        self.given: set[int] = set()

    @rule(key=st.integers(0, 23), depth=st.integers(0, 40))
    def put(self, key, depth):
        assert self.store.put(NS, [f"k{key}"], self.pages.segments([key]), first_depth=depth) == [True]
        self.given.add(key)

    @rule(keys=st.lists(st.integers(0, 23), min_size=1, max_size=6, unique=True))
    def get(self, keys):
        out = Pages(len(keys), seed=99)
        ok = self.store.get(NS, [f"k{k}" for k in keys], out.segments())
        for row, (key, hit) in enumerate(zip(keys, ok)):
            if hit:
                assert key in self.given and torch.equal(out.data[row], self.pages.data[key])

    @rule(slot=st.integers(0, 15))
    def writer_dies(self, slot):
        leave_torn(self.store, slot)

    @rule()
    def reattach(self):
        self.store.close()
        self.store = open_store(self.directory + "/arena", size_bytes=None, slot_bytes=PAGE,
                                ops=arena.slot_ops(self.ops))

    @invariant()
    def at_most_the_slots(self):
        if self.store is not None:
            assert self.store.census().pages <= 16

    def teardown(self):
        import shutil

        if self.store is not None:
            self.store.close()
            shutil.rmtree(self.directory, ignore_errors=True)


TestNoWrongBytes = NoWrongBytes.TestCase
TestNoWrongBytes.settings = settings(max_examples=25, stateful_step_count=30, deadline=None)


def test_the_one_window_arena_has_sixteen_slots():
    """The constant the eviction tests rely on."""
    assert plan_store(ONE_WINDOW, slot_bytes=PAGE).slots == 16


@pytest.mark.concurrency
def test_two_threads_of_one_process_never_write_one_slot_at_once(shm_dir, ops):
    """OFD locks do not part threads sharing the arena's file (SGLang backs up on one thread
    while another prefetches): with writer 1 stopped inside its write (after claiming), writer 2
    of the same store queues for the process's writer mutex instead of claiming the same empty
    slot - events, not timing - and afterwards both pages read back byte-exact."""
    import time

    claimed, release, queued, done = (threading.Event() for _ in range(4))
    store = _open(shm_dir, ops, total=ONE_WINDOW)
    src = Pages(2, seed=12)

    def hook(stage, page):
        if stage == "claimed" and threading.current_thread().name == "first":
            claimed.set()
            assert release.wait(60), "hang guard"

    store.index.fault_hook = hook
    inner = store.index._writing

    class Watched:
        def __enter__(self):
            if threading.current_thread().name == "second":
                queued.set()
            inner.acquire()
            return self

        def __exit__(self, *exc):
            inner.release()

        def acquire(self, blocking=True):
            return inner.acquire(blocking)

        def release(self):
            inner.release()

    store.index._writing = Watched()

    def second():
        store.put(NS, ["b"], src.segments([1]))
        done.set()

    first = threading.Thread(target=store.put, args=(NS, ["a"], src.segments([0])), name="first")
    first.start()
    assert claimed.wait(60), "hang guard"
    other = threading.Thread(target=second, name="second")
    other.start()
    deadline = time.monotonic() + 60  # a hang guard
    while not (queued.is_set() or done.is_set()):
        assert time.monotonic() < deadline, "hang guard"
        time.sleep(0.001)
    assert queued.is_set() and not done.is_set()  # it waits for writer 1, it did not write beside it
    release.set()
    first.join(60)
    other.join(60)
    out = Pages(2, seed=13)
    try:
        assert store.get(NS, ["a", "b"], out.segments()) == [True, True]
        assert torch.equal(out.data, src.data)
    finally:
        store.close()


def test_a_slot_another_writer_filled_after_this_one_chose_it_is_not_taken(shm_dir, ops):
    """Two writers of one window (two attaches: two processes' locks): writer B stores its page
    in the empty slot writer A had just picked (between A's look at the window and A's lock -
    a writer descheduled there, as on a loaded box). A must not overwrite B's fresh page while
    the window has empty slots: both pages read back byte-exact, nothing evicted."""
    a, b = _open(shm_dir, ops, total=ONE_WINDOW), _open(shm_dir, ops, total=ONE_WINDOW)
    src = Pages(2, seed=21)
    real = a.index.ops

    class Stale:
        """A's ops, but B stores its page right after A ordered the window (every slot empty)."""

        def __getattr__(self, name):
            return getattr(real, name)

        @staticmethod
        def victims(*args):
            order = real.victims(*args)  # what A saw: every slot empty
            assert b.put(NS, ["b"], src.segments([1])) == [True]  # B fills the first of them meanwhile
            return order

    a.index.ops = Stale()
    out = Pages(2, seed=22)
    try:
        assert a.put(NS, ["a"], src.segments([0])) == [True]
        assert a.get(NS, ["a", "b"], out.segments()) == [True, True]
        assert torch.equal(out.data, src.data)
        assert a.arena.counters()["evictions"] == 0
    finally:
        a.close()
        b.close()


def test_a_batch_never_claims_one_slot_twice_whatever_its_window_order_says(shm_dir, ops):
    """Two keys of one batch whose windows both start at one slot, the second's look at it
    claiming the odd generation the first is about to give it (an order no lookup gives, but
    the protocol must not trust it): the first keeps its slot - and its lock - and the second
    goes to its next one; both read back byte-exact."""
    store = _open(shm_dir, ops, total=ONE_WINDOW)
    real, window = store.index.ops, store.arena.plan.window

    class Crossed:
        """The store's ops, with the second key's window ordered to start at the first's slot."""

        def __getattr__(self, name):
            return getattr(real, name)

        @staticmethod
        def victims(*args):
            order, seen = (list(part) for part in real.victims(*args))
            order[window:2 * window] = [order[0]] + [s for s in order[window:2 * window] if s != order[0]]
            seen[window:2 * window] = [seen[0] + 1] + [g for s, g in zip(order[window + 1:2 * window],
                                                                        seen[window + 1:2 * window])]
            return order, seen

    store.index.ops = Crossed()
    src, out = Pages(2, seed=31), Pages(2, seed=32)
    try:
        assert store.put(NS, ["a", "b"], src.segments()) == [True, True]
        assert store.get(NS, ["a", "b"], out.segments()) == [True, True]
        assert torch.equal(out.data, src.data)
        assert store.census().pages == 2
    finally:
        store.close()


def test_a_written_record_holds_every_field_the_plan_gives_it(shm_dir, ops):
    """After a put (the C helper's one-call write, or the fallback's steps) each record holds its
    key, both sums, the page's length, its chain depth, the namespace entry, an unset referenced
    bit, the writer's pid and the wall clock (ns) of the write - the same fields either way."""
    import os
    import time

    from hicache.plan._store import DEPTH, GEN, KEY, LENGTH, REF, STAMP, SUM1, SUM2, WRITER
    from hicache.plan._store import NS as ENTRY

    store = _open(shm_dir, ops)
    try:
        before = time.time_ns()
        assert store.put(NS, ["a", "b"], Pages(2, seed=41).segments(), first_depth=7) == [True, True]
        after = time.time_ns()
        found, _ = store.index.find(slot_keys(NS.digest, ["a", "b"]))
        entry = store.index.entry_of(NS.digest)
        for depth, (slot, key) in enumerate(zip(found, (slot_keys(NS.digest, ["a"]), slot_keys(NS.digest, ["b"]))), 7):
            record = store.arena.records.record(slot)
            assert record[GEN] % 2 == 0 and record[GEN] > 0 and record[KEY] == key
            assert record[SUM1] and record[SUM2]
            assert (record[LENGTH], record[DEPTH], record[ENTRY], record[REF]) == (PAGE, depth, entry, 0)
            assert record[WRITER] == os.getpid() & 0xFFFFFFFF and before <= record[STAMP] <= after
    finally:
        store.close()


@given(st.lists(st.tuples(st.integers(-2**63, 2**63 - 1), st.integers(-2**63, 2**63 - 1)), max_size=60),
       st.lists(st.tuples(st.integers(0, 59), st.integers(0, 59)), max_size=30))
def test_the_first_of_each_key_is_what_torch_unique_finds(rows, copies):
    """`_first_of_each` (the census's de-duplication of live slots' keys, now two stable sorts)
    gives exactly the unique rows, in torch.unique's ascending order, and each one's first
    index - held to torch.unique(dim=0) with a scatter of the lowest index as the oracle, over
    keys with any number of repeats (``copies``: row a written over row b) and one-column ties."""
    from hicache.store._index import _first_of_each

    keys = torch.tensor(rows, dtype=torch.int64).reshape(-1, 2)
    for a, b in copies:
        if a < len(rows) and b < len(rows):
            keys[b] = keys[a]
    unique, inverse = torch.unique(keys, dim=0, return_inverse=True)
    first = torch.full((unique.shape[0],), keys.shape[0], dtype=torch.int64)
    first.scatter_reduce_(0, inverse, torch.arange(keys.shape[0]), reduce="amin")
    got_unique, got_first = _first_of_each(keys)
    assert torch.equal(got_unique, unique) and torch.equal(got_first, first)


_WORDS = st.lists(st.tuples(st.sampled_from([0, 1, 2, 3, 8, 9, 2**40]),  # generation: empty, odd (torn), even
                            st.sampled_from([0, 5, -7, 2**62]), st.sampled_from([0, 5, -7, 2**62]),  # key halves
                            st.integers(0, 2**63 - 1), st.integers(0, 2**63 - 1)),  # length and entry words
                  max_size=40)


@given(_WORDS, st.integers(1, 9))
def test_the_census_counts_each_live_key_once_with_its_first_slot_in_any_chunking(slots, chunk):
    """The census of index words (gen, key halves, ..., length word, entry word per slot),
    read ``chunk`` slots at a time, against a plain loop over the slots: torn = odd
    generations; live = even, non-zero generations with a key; each live key counted once, with
    the length and entry of its first slot; keys drawn from a few values, so that many repeat and
    many share one half - the census's quick check for repeats looks at one half first."""
    from hicache.store._index import census_of

    words = torch.zeros(len(slots), 8, dtype=torch.int64)
    for i, (gen, k0, k1, length, entry) in enumerate(slots):
        words[i, 0], words[i, 1], words[i, 2], words[i, 5], words[i, 6] = gen, k0, k1, length, entry
    seen, pages, nbytes, by_namespace = set(), 0, 0, {}
    for gen, k0, k1, length, entry in slots:
        if gen and gen % 2 == 0 and (k0 or k1) and (k0, k1) not in seen:
            seen.add((k0, k1))
            pages, nbytes = pages + 1, nbytes + (length & 0xFFFFFFFF)
            by_namespace[entry & 0xFFFF] = by_namespace.get(entry & 0xFFFF, 0) + 1
    torn = sum(1 for gen, *_ in slots if gen % 2)
    got = census_of(words, 100, chunk=chunk)
    assert (got.slots, got.pages, got.bytes, got.torn, got.by_namespace) == (100, pages, nbytes, torn, by_namespace)
