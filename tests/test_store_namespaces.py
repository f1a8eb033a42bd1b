"""The node store's namespace table, entry by entry: each entry is locked on its own bytes (a
writer holding one never stops another attach freeing another), a write lets go of every entry
it held, a hold that finds its entry reused lets go at once, `free_entries` counts what it
freed, and a description longer than an entry holds is cut to fit rather than failing the put.
With the C helper and with the fallback."""

from __future__ import annotations

import pytest
from store_support import shm_dir  # noqa: F401 - a fixture
from test_store_edges import _namespace
from test_store_index import OPS, Pages, _open

from hicache.plan.store_format import NAMESPACE_BYTES, NAMESPACE_ENTRIES
from hicache.store import Namespace
from hicache.store._keys import DIGEST_BYTES

pytest.importorskip("torch")

pytestmark = pytest.mark.concurrency  # two attaches' OFD locks: run again under load


@pytest.fixture(params=OPS)
def ops(request):
    return request.param


def test_each_entry_is_locked_on_its_own_bytes(shm_dir, ops):
    """Another attach holding one entry (shared, as a writer does) stops nobody freeing a
    different one - each entry's lock covers its own 256 bytes of the table - and a held one
    stays until let go."""
    a, b, src = _open(shm_dir, ops), _open(shm_dir, ops), Pages(2)
    kept, freed = _namespace(1), _namespace(2)
    try:
        assert a.put(kept, ["k"], src.segments([0])) == [True]
        assert a.put(freed, ["f"], src.segments([1])) == [True]
        kept_entry, freed_entry = a.index.entry_of(kept.digest), a.index.entry_of(freed.digest)
        assert (kept_entry, freed_entry) == (0, 1)  # neighbours: a range spanning two would overlap
        assert a.index._namespace_range(freed_entry) == (b.arena.plan.namespace_offset + NAMESPACE_BYTES,
                                                              NAMESPACE_BYTES)
        assert a.index.hold_entry(kept_entry, kept.digest)
        try:
            assert b.clear([freed]) == 1
            assert b.index.entry_of(freed.digest) == 0xFFFF  # freed beside the held one
            assert b.clear([kept]) == 1 and b.index.entry_of(kept.digest) == kept_entry  # held: stays
        finally:
            a.index.release_entry(kept_entry)
        assert b.index.free_entries([kept_entry]) == 1 and b.index.namespaces() == {}
    finally:
        a.close()
        b.close()


def test_a_write_and_a_hold_that_finds_its_entry_reused_leave_nothing_held(shm_dir, ops):
    """After a put - the namespace's first, and a later one into its cached entry - this
    process holds no entry, so another attach frees it once its pages are cleared; an entry
    left without pages is not freed while the table has room (only a full table frees them);
    a hold that finds another namespace's digest in the entry returns False and lets go at once."""
    a, b, src = _open(shm_dir, ops), _open(shm_dir, ops), Pages(2)
    namespace, other, stale = _namespace(1), _namespace(2), _namespace(3)
    try:
        assert a.put(stale, ["s"], src.segments([0])) == [True]
        assert a.index.clear({a.index.entry_of(stale.digest)}) == 1  # pages gone, entry left
        assert a.put(namespace, ["k"], src.segments([0])) == [True]
        assert a.index._held == {}
        assert stale.description in a.index.namespaces().values()
        assert a.put(namespace, ["l"], src.segments([1])) == [True]
        assert a.index._held == {}
        entry = a.index.entry_of(namespace.digest)
        assert not a.index.hold_entry(entry, other.digest)
        assert a.index._held == {}
        assert b.clear([namespace]) == 2 and list(b.index.namespaces().values()) == [stale.description]
    finally:
        a.close()
        b.close()


def test_free_entries_returns_how_many_it_freed(shm_dir, ops):
    """An empty table frees 0 (a number, not None); with one namespace holding a page and one
    emptied of its pages (by a raw clear of its slots, its entry left), it frees exactly the
    emptied one, and the free entries around them are not counted."""
    store, src = _open(shm_dir, ops), Pages(2)
    full, emptied = _namespace(1), _namespace(2)
    try:
        assert store.index.free_entries() == 0
        assert store.put(full, ["k"], src.segments([0])) == [True]
        assert store.put(emptied, ["e"], src.segments([1])) == [True]
        entry = store.index.entry_of(emptied.digest)
        assert store.index.clear({entry}) == 1  # its pages gone, its entry still in the table
        assert len(store.index.namespaces()) == 2
        assert store.index.free_entries() == 1
        assert list(store.index.namespaces().values()) == [full.description]
        assert store.index.free_entries() == 0
    finally:
        store.close()


def test_a_description_longer_than_an_entry_is_cut_to_fit_and_the_page_stored(shm_dir, ops):
    """A model path longer than an entry's description (256 bytes less the 16-byte digest):
    the put stores its page and the table keeps the description's first 240 bytes; one cut
    inside a multi-byte character reads with a replacement character, never an error."""
    store, src = _open(shm_dir, ops), Pages(2)
    room = NAMESPACE_BYTES - DIGEST_BYTES
    long = Namespace(model="/models/" + "m" * 300, dtype="torch.bfloat16", page_tokens=16,
                     layout="page_first/segments", pool="kv", page_bytes=src.data.shape[1])
    cut = Namespace(model="é" * 200, dtype="torch.bfloat16", page_tokens=16, layout="page_first/segments",
                    pool="kv", page_bytes=src.data.shape[1])
    try:
        assert store.put(long, ["k"], src.segments([0])) == [True]
        assert store.put(cut, ["k"], src.segments([1])) == [True]
        kept = store.index.namespaces()
        assert kept[store.index.entry_of(long.digest)] == long.description[:room]
        assert kept[store.index.entry_of(cut.digest)] == "é" * (room // 2)  # 120 two-byte characters exactly
        three = Namespace(model="x" + "é" * 200, dtype="torch.bfloat16", page_tokens=16,
                          layout="page_first/segments", pool="kv", page_bytes=src.data.shape[1])
        assert store.put(three, ["k"], src.segments([0])) == [True]
        assert store.index.namespaces()[store.index.entry_of(three.digest)] == "x" + "é" * 119 + "\ufffd"
        assert len(store.index.namespaces()) == 3 < NAMESPACE_ENTRIES
    finally:
        store.close()


def test_a_second_attach_finds_the_entry_another_made_and_a_busy_one_is_looked_at_eight_times(shm_dir, ops,
                                                                                                monkeypatch):
    """Another attach writing a namespace the first one made finds its entry in one look and
    stores, holding nothing after; an entry another attach holds exclusively (freeing it) at
    every look is looked for exactly 8 times (`register_namespace`'s bound), then the put
    stores nothing, counted busy, holding nothing."""
    from hicache.effects import arena as effects_arena

    a, b, src = _open(shm_dir, ops), _open(shm_dir, ops), Pages(1)
    namespace = _namespace(1)
    try:
        assert a.put(namespace, ["k"], src.segments()) == [True]
        scans = []
        real_scan = b.index._scan
        monkeypatch.setattr(b.index, "_scan", lambda *args: scans.append(args) or real_scan(*args))
        assert b.put(namespace, ["l"], src.segments()) == [True]
        assert len(scans) == 1 and b.index._held == {} and b.index.entry_of(namespace.digest) == 0
        c = _open(shm_dir, ops)
        try:
            c_scan = c.index._scan
            monkeypatch.setattr(c.index, "_scan", lambda *args: scans.append(args) or c_scan(*args))
            offset, length = a.index._namespace_range(0)
            assert effects_arena.try_lock(a.arena.fd, offset, length)  # a frees it, at every look
            try:
                scans.clear()
                assert c.put(namespace, ["m"], src.segments()) == [False]
                assert len(scans) == 8 and c.counts.busy == 1 and c.index._held == {}
            finally:
                effects_arena.unlock(a.arena.fd, offset, length)
        finally:
            c.close()
    finally:
        a.close()
        b.close()


def test_a_namespace_already_in_a_later_entry_is_held_there_and_the_free_one_left_claimable(shm_dir, ops):
    """A scan that reaches a free entry before the one already holding its digest (another
    attach filed it there while an earlier entry was taken, since freed) holds the existing
    entry - one entry per namespace - and leaves the free one unlocked for the next namespace;
    when that existing entry is being freed at every look, the put is busy (not a full table)."""
    from hicache.effects import arena as effects_arena

    a, b, src = _open(shm_dir, ops), _open(shm_dir, ops), Pages(1)
    first, namespace, later = _namespace(1), _namespace(2), _namespace(3)
    try:
        assert a.put(first, ["f"], src.segments()) == [True]
        assert a.put(namespace, ["k"], src.segments()) == [True]
        assert a.clear([first]) == 1  # entry 0 free again, the namespace in entry 1
        assert b.put(namespace, ["l"], src.segments()) == [True]
        assert b.index.entry_of(namespace.digest) == 1 and b.index._held == {}
        assert list(b.index.namespaces()) == [1]
        assert a.put(later, ["x"], src.segments()) == [True]
        assert a.index.entry_of(later.digest) == 0  # b left entry 0 unlocked
        assert a.clear([later]) == 1
        c = _open(shm_dir, ops)
        try:
            offset, length = a.index._namespace_range(1)
            assert effects_arena.try_lock(a.arena.fd, offset, length)  # a frees entry 1, at every look
            try:
                assert c.put(namespace, ["m"], src.segments()) == [False]
                assert c.counts.busy == 1 and c.index._held == {}
            finally:
                effects_arena.unlock(a.arena.fd, offset, length)
            assert c.put(namespace, ["m"], src.segments()) == [True] and c.index.entry_of(namespace.digest) == 1
        finally:
            c.close()
    finally:
        a.close()
        b.close()


def test_a_freed_entry_is_all_zeros_and_an_entry_takes_no_more_than_it_holds(shm_dir, ops):
    """Freeing an entry zeroes all 256 bytes - its digest and its description, so no earlier
    engine's model name stays behind in the table - and the table's writer refuses a digest that
    is not 16 bytes or a description over 240 (a ValueError, nothing written)."""
    import ctypes

    store, src = _open(shm_dir, ops), Pages(1)
    kept = _namespace(1)
    namespace = Namespace(model="m" * 300, dtype="torch.bfloat16", page_tokens=16, layout="page_first/segments",
                          pool="kv", page_bytes=src.data.shape[1])  # a description filling its entry
    try:
        assert store.put(kept, ["k"], src.segments()) == [True]
        assert store.put(namespace, ["k"], src.segments()) == [True]
        entry = store.index.entry_of(namespace.digest)
        address = store.arena.base + store.arena.plan.namespace_offset + entry * NAMESPACE_BYTES
        assert ctypes.string_at(address + NAMESPACE_BYTES - 4, 4) == b"mmmm"
        assert store.clear([namespace]) == 1
        assert ctypes.string_at(address, NAMESPACE_BYTES) == bytes(NAMESPACE_BYTES)
        assert list(store.index.namespaces().values()) == [kept.description]  # its neighbour whole
        records = store.index.records
        for digest, body in ((bytes(15), b"x"), (bytes(17), b"x"), (b"d" * 16, b"x" * 241)):
            with pytest.raises(ValueError, match="16-byte digest and at most 240 bytes"):
                records.write_namespace(entry, digest, body)
        assert ctypes.string_at(address, NAMESPACE_BYTES) == bytes(NAMESPACE_BYTES)
        records.write_namespace(entry, b"d" * 16, b"x" * 240)  # exactly full: taken
        assert ctypes.string_at(address, NAMESPACE_BYTES) == b"d" * 16 + b"x" * 240
        records.erase_namespace(entry)
    finally:
        store.close()
