"""The node store's `clear` (SGLang's /clear_hicache_storage_backend and a PD role switch call it on
the scheduler thread), with the C helper and with the fallback: it empties exactly the pages of the
namespaces it is given as they were when it looked - never another engine's page written into one
of their slots since, never a slot another process is writing - and waits for this process's own
write in flight instead of skipping every slot while it runs. The C helper locks a run of records
with one OFD lock and falls back to a lock per slot where another writer holds one of them."""

from __future__ import annotations

import threading

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from store_support import arena_of, shm_dir, wait_until  # noqa: F401 - shm_dir: a fixture
from test_store_index import NS, OPS, PAGE, Pages, _attach, _open, _slot_of

from hicache.effects import arena
from hicache.plan.store_format import RECORD_BYTES
from hicache.store import Namespace
from hicache.store import _index

torch = pytest.importorskip("torch")

OTHER = Namespace(model="other", dtype="torch.bfloat16", page_tokens=16, layout="page_first/segments", pool="kv",
                  page_bytes=PAGE, shard=(("tp", 0, 2),))


@pytest.fixture(params=OPS)
def ops(request):
    return request.param


class WatchedLock:
    """A threading.Lock that says when a caller starts waiting for it (``waiting``) while it is held."""

    def __init__(self) -> None:
        self.lock, self.waiting = threading.Lock(), threading.Event()

    def acquire(self, blocking: bool = True, timeout: float = -1) -> bool:
        if blocking and self.lock.locked():
            self.waiting.set()
        return self.lock.acquire(blocking, timeout)

    def release(self) -> None:
        self.lock.release()

    def __enter__(self):
        self.acquire()
        return self

    def __exit__(self, *exc) -> None:
        self.release()


@pytest.mark.concurrency
def test_clear_waits_for_this_processs_write_in_flight_and_then_empties_every_page(shm_dir, ops):
    """SGLang backs up on a thread of its own: a put stopped mid-write (holding the process's write
    lock) makes clear wait for it - not skip every slot while it runs (clear emptied 0 of 12
    pages so) - and every page stored before clear looked is then gone; the put's own page is
    stored."""
    claimed, release = threading.Event(), threading.Event()

    def hook(stage, page):
        if stage == "claimed" and threading.current_thread().name == "backup":
            claimed.set()
            assert release.wait(60), "hang guard"

    store, src = _open(shm_dir, ops, fault_hook=hook), Pages(13)
    store.index._writing = WatchedLock()
    keys = [f"k{i}" for i in range(12)]
    try:
        assert store.put(NS, keys, src.segments(range(12))) == [True] * 12
        backup = threading.Thread(target=store.put, args=(NS, ["late"], src.segments([12])), name="backup")
        backup.start()
        assert claimed.wait(60), "hang guard"
        cleared = []
        clearing = threading.Thread(target=lambda: cleared.append(store.clear([NS])))
        clearing.start()
        wait_until(lambda: store.index._writing.waiting.is_set() or not clearing.is_alive())
        assert store.index._writing.waiting.is_set(), f"clear did not wait for the write in flight: {cleared}"
        release.set()
        backup.join(60)
        clearing.join(60)
        assert not backup.is_alive() and not clearing.is_alive(), "hang guard"
        assert cleared == [12]
        assert store.present(NS, keys) == [False] * 12
        assert store.present(NS, ["late"]) == [True]  # claimed (odd) when clear looked: not the clear's
    finally:
        release.set()
        store.close()


def _read_back(store, keys, pages) -> None:
    """Every one of ``keys`` of the other engine's namespace reads back from ``store`` as ``pages``."""
    out = Pages(len(keys), seed=99)
    assert store.get(OTHER, keys, out.segments()) == [True] * len(keys)
    assert torch.equal(out.data, pages)


def test_a_slot_another_engine_rewrote_after_clear_looked_keeps_that_engines_page(shm_dir, ops, monkeypatch):
    """clear reads the index, then empties what it read; in between another attach evicts every
    page of the one-window arena for 16 pages of another model. Those 16 stay, byte-exact: a
    slot whose generation moved on is not the clearing namespace's any more (clear re-read each
    generation just before emptying its slot and so emptied the other engine's pages)."""
    mine, theirs = _open(shm_dir, ops, total=arena_of(16, PAGE)), None
    src = Pages(32, seed=3)
    try:
        assert mine.census().slots == 16
        assert mine.put(NS, [f"k{i}" for i in range(16)], src.segments(range(16))) == [True] * 16
        as_seen = mine.index._columns().clone()
        theirs = _attach(shm_dir, ops)
        other_keys = [f"o{i}" for i in range(16)]
        assert theirs.put(OTHER, other_keys, src.segments(range(16, 32))) == [True] * 16
        monkeypatch.setattr(mine.index, "_columns", lambda: as_seen)
        assert mine.clear([NS]) == 0
        _read_back(theirs, other_keys, src.data[16:])
    finally:
        mine.close()
        if theirs is not None:
            theirs.close()


def test_a_page_written_between_clears_reads_of_a_slots_namespace_and_generation_is_not_emptied(shm_dir, ops,
                                                                                                monkeypatch):
    """clear reads each slot's namespace and generation in passes over the index; another engine
    evicts every page of the one-window arena for its own right after the namespace pass. The
    generation clear keeps must be the one read first (the namespace then is that generation's):
    read after, it was the other engine's, and clear emptied those 16 pages as its own."""
    mine, theirs = _open(shm_dir, ops, total=arena_of(16, PAGE)), None
    src = Pages(32, seed=5)
    other_keys = [f"o{i}" for i in range(16)]
    try:
        assert mine.put(NS, [f"k{i}" for i in range(16)], src.segments(range(16))) == [True] * 16
        theirs = _attach(shm_dir, ops)
        raced = []

        class Racing(torch.Tensor):
            """The index, but the other engine writes right after the namespace column is read."""

            def __getitem__(self, where):
                got = super().__getitem__(where)
                if where == (slice(None), 6) and not raced:
                    got = got.clone()
                    raced.append(theirs.put(OTHER, other_keys, src.segments(range(16, 32))))
                return got

        real = mine.index._columns
        monkeypatch.setattr(mine.index, "_columns", lambda: real().as_subclass(Racing))
        assert mine.clear([NS]) == 0
        assert raced == [[True] * 16]
        _read_back(theirs, other_keys, src.data[16:])
    finally:
        mine.close()
        if theirs is not None:
            theirs.close()


def test_a_slot_another_process_is_writing_stays_and_every_other_slot_is_emptied(shm_dir, ops, monkeypatch):
    """Another attach holds one record's lock (a writer of another process there now) in the middle
    of a run the C helper locks whole: that slot stays, every other page of the namespace goes
    (the helper falls back to a lock per slot); once the lock is let go, clear empties it too.
    Runs of 3 slots, so the arena holds many."""
    monkeypatch.setattr("hicache.effects._arena._slots.CLEAR_RUN", 3)
    store, other = _open(shm_dir, ops), None
    keys = [f"k{i}" for i in range(40)]
    try:
        assert store.put(NS, keys, Pages(40).segments()) == [True] * 40
        held = sorted(_slot_of(store, key) for key in keys)[20]
        other = _attach(shm_dir, ops)
        offset = other.arena.plan.record_offset(held)
        assert arena.try_lock(other.arena.fd, offset, RECORD_BYTES)
        try:
            assert store.clear([NS]) == 39
            assert [key for key, here in zip(keys, store.present(NS, keys)) if here] == \
                   [key for key in keys if _slot_of(store, key) == held]
        finally:
            arena.unlock(other.arena.fd, offset, RECORD_BYTES)
        assert store.clear([NS]) == 1 and store.census().pages == 0
    finally:
        store.close()
        if other is not None:
            other.close()


@pytest.mark.parametrize("bad", ["past the arena", "out of order", "repeated", "a generation short"])
def test_clear_slots_refuses_a_bad_call_before_touching_a_record(shm_dir, ops, bad):
    """The slot ops' clear_slots (both) refuses a slot past the arena, slots out of order or
    repeated, or fewer generations than slots, with a ValueError - and no record changed."""
    store = _open(shm_dir, ops)
    try:
        assert store.put(NS, ["a", "b"], Pages(2).segments()) == [True, True]
        slots = sorted(_slot_of(store, key) for key in ["a", "b"])
        gens = [store.index.ops.load(store.arena.record_addr(slot)) for slot in slots]
        calls = {"past the arena": ([slots[0], store.arena.plan.slots], gens),
                 "out of order": (slots[::-1], gens[::-1]),
                 "repeated": ([slots[0], slots[0]], [gens[0], gens[0]]),
                 "a generation short": (slots, gens[:1])}
        given_slots, given_gens = calls[bad]
        before = store.index._columns().clone()
        with pytest.raises(ValueError, match="clear_slots"):
            store.index.ops.clear_slots(store.arena.base + store.arena.plan.index_offset, store.arena.fd,
                                        store.arena.plan.index_offset, store.arena.plan.slots, given_slots, given_gens,
                                        _index.EMPTY_RECORD)
        assert torch.equal(store.index._columns(), before)
    finally:
        store.close()


@pytest.mark.skipif("native" not in OPS, reason="the C helper is not built here: the fallback is all there is")
def test_a_c_helper_built_before_clear_slots_clears_through_the_fallback(shm_dir, monkeypatch):
    """An install whose C helper predates clear_slots (not rebuilt) still clears: the native slot
    ops hand the reclaims to the fallback's."""
    import sys
    import types

    slots_module = sys.modules["hicache.effects._arena._slots"]
    built = slots_module._native
    older = types.SimpleNamespace(**{name: getattr(built, name) for name in dir(built)
                                     if not name.startswith("_") and name != "clear_slots"})
    monkeypatch.setattr(slots_module, "_native", older)
    store = _open(shm_dir, "native")
    try:
        assert store.put(NS, ["a", "b", "c"], Pages(3).segments()) == [True] * 3
        assert store.clear([NS]) == 3 and store.census().pages == 0
    finally:
        store.close()


NAMESPACES = [NS, OTHER, Namespace(model="third", dtype="torch.bfloat16", page_tokens=16, layout="page_first/segments",
                                   pool="kv", page_bytes=PAGE, shard=(("tp", 1, 2),))]


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(stored=st.lists(st.tuples(st.integers(0, 2), st.integers(0, 30)), min_size=1, max_size=60, unique=True),
       cleared=st.sets(st.integers(0, 2)), run=st.integers(1, 9), batch=st.integers(1, 7))
def test_clear_empties_exactly_the_cleared_namespaces_pages_in_any_runs_and_batches(shm_dir, ops, stored, cleared, run,
                                                                                     batch):
    """Pages of three namespaces, some of them cleared, in runs of 1-9 slots (the C helper's OFD
    lock over a run) and batches of 1-7 slots (the process's write lock between them): afterwards
    a key is held exactly where it was held before and its namespace was not cleared, clear says
    how many went, and every page left reads back byte-exact."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr("hicache.effects._arena._slots.CLEAR_RUN", run)
        patch.setattr(_index, "CLEAR_BATCH", batch)
        store, src = _open(shm_dir, ops, total=arena_of(256, PAGE)), Pages(len(stored), seed=len(stored))
        try:
            for n, (ns, key) in enumerate(stored):
                store.put(NAMESPACES[ns], [f"k{key}"], src.segments([n]))
            before = [store.present(NAMESPACES[ns], [f"k{key}"])[0] for ns, key in stored]
            went = store.clear([NAMESPACES[ns] for ns in sorted(cleared)])
            after = [store.present(NAMESPACES[ns], [f"k{key}"])[0] for ns, key in stored]
            assert after == [held and ns not in cleared for held, (ns, _) in zip(before, stored)]
            assert went == sum(held and ns in cleared for held, (ns, _) in zip(before, stored))
            out = Pages(1, seed=99)
            for n, ((ns, key), held) in enumerate(zip(stored, after)):
                if held:
                    assert store.get(NAMESPACES[ns], [f"k{key}"], out.segments()) == [True]
                    assert torch.equal(out.data[0], src.data[n])
        finally:
            store.close()
            (shm_dir / "arena").unlink()
