"""The node store's C write, lookup, read and clear stopped at each step of the slot protocol - the
path a user's build runs, which the Python fault hook never reaches (a store given one writes
step by step in Python). A test build of the C helper (`-DHICACHE_STEP_HOOK`, never setup.py's)
calls a hook at the Python write's steps, between a lookup's generation and key reads, and
between a read's copy and its re-check. A reader meeting a write stopped at any step sees a plain
miss - not torn, not corrupt, never a wait (a page being cleared too); a lookup meeting a claim
does not report it; a read whose slot is rewritten after it copied is torn, not returned; and a
state machine stops writes
and reads anywhere among puts, gets, bit flips, dead writers and re-attaches: every hit is the
key's own bytes. The multi-process kill -9 at each step is test_store_processes' (both paths)."""

from __future__ import annotations

import ctypes
import sys
import threading

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import (RuleBasedStateMachine, initialize, invariant, precondition, rule,
                                 run_state_machine_as_test)
from store_roles import PAGE_BYTES, _segments, core_namespace, page_bytes_of
from store_support import arena_of, build_slotops, leave_torn, shm_dir  # noqa: F401 - shm_dir: a fixture

from hicache.effects import arena
from hicache.plan import claimed_generation
from hicache.store import open_store
from hicache.store._keys import slot_keys

torch = pytest.importorskip("torch")

pytestmark = pytest.mark.concurrency  # threads stopped on events: `make test-loaded` runs these again

STAGES = ("claimed", "half", "copied", "summed", "published")  # SlotIndex._write's fault-hook stages


@pytest.fixture(scope="module")
def hooked(tmp_path_factory):
    """The C helper built with its step hook."""
    module = build_slotops(tmp_path_factory.mktemp("step-hook"), "HICACHE_STEP_HOOK")
    assert module.STEP_HOOK == 1 and hasattr(module, "set_step_hook")
    return module


@pytest.fixture
def c_path(hooked, monkeypatch):
    """The store's native slot ops run the hooked build for this test (the same source)."""
    monkeypatch.setattr("hicache.effects._arena._slots._native", hooked)
    try:
        yield hooked
    finally:
        hooked.set_step_hook(None)


def _open(path, size=None, **kwargs):
    """An open of the arena at ``path`` with the slot ops a user's build picks: under `c_path` the
    hooked build, where no helper is built the fallback (the Python path's tests run there too)."""
    return open_store(str(path), size_bytes=size, slot_bytes=PAGE_BYTES, ops=arena.slot_ops("auto"), **kwargs)


def test_a_users_build_has_no_step_hook(hooked):
    """The hook is the test build's alone: the build in use has none (no call, no cost)."""
    built = sys.modules["hicache.effects._arena._slotops"]
    assert built.STEP_HOOK == 0 and not hasattr(built, "set_step_hook")
    with pytest.raises(TypeError, match="a callable or None"):
        hooked.set_step_hook(3)


class Stopped:
    """One operation run on a thread of its own and stopped at one step (stage, n) of that
    thread's (n None: the stage's first) - or left to end first, when the step never comes."""

    def __init__(self, run, stage: str, n: int | None) -> None:
        self.at, self.stopped, self.release, self.result = None, threading.Event(), threading.Event(), []

        def body():
            self.at = (stage, n, threading.get_ident())  # this thread's steps only
            self.result.append(run())

        self.thread = threading.Thread(target=body)

    def start(self) -> "Stopped":
        """Run it (once the hook can see it) until it stops at its step or ends."""
        self.thread.start()
        for _ in range(6000):  # a hang guard of 60 s
            if self.stopped.wait(0.01) or not self.thread.is_alive():
                break
        assert self.stopped.is_set() or not self.thread.is_alive(), "hang guard"
        return self

    def hook(self, stage: str, n: int) -> None:
        if self.at is not None and (stage, threading.get_ident()) == (self.at[0], self.at[2]) and \
                self.at[1] in (None, n) and not self.stopped.is_set():
            self.stopped.set()
            assert self.release.wait(60), "hang guard"

    def let_go(self) -> None:
        """Release it, if it stopped, and wait for it to end (a teardown's: whatever happened)."""
        self.release.set()
        if self.thread.ident is not None:
            self.thread.join(60)

    def go_on(self):
        """Let it go on; its result."""
        self.let_go()
        assert not self.thread.is_alive(), "hang guard"
        (result,) = self.result
        return result


@pytest.mark.parametrize("evicting", [False, True], ids=["empty-slot", "evicting"])
@pytest.mark.parametrize("stage", STAGES)
@pytest.mark.parametrize("path", ["c", "python"])
def test_a_page_being_written_is_a_plain_miss_at_each_step(request, shm_dir, path, stage, evicting):
    """A writer stopped at each step of putting one page into a one-window arena (into its empty
    slot, or evicting one of 16 live pages): a reader's get of every key meanwhile returns at once
    - the new key False until it is published, every old page True and byte-exact but the one
    being evicted, nothing counted torn or corrupt (a slot being written is invisible, not
    damaged) - and once the writer goes on, the new page reads back byte-exact. Both paths."""
    ns = core_namespace()
    old = [f"old{i}" for i in range(16 if evicting else 15)]
    keys = [*old, "new"]
    pages = {key: page_bytes_of(1, i) for i, key in enumerate(keys)}
    out = {key: torch.zeros(PAGE_BYTES, dtype=torch.uint8) for key in keys}
    writer = Stopped(lambda: writer_store.put(ns, ["new"], [_segments(pages["new"])]), stage, None)
    if path == "c":
        request.getfixturevalue("c_path").set_step_hook(writer.hook)
        writer_store = _open(shm_dir / "arena", arena_of(16, PAGE_BYTES))
    else:
        writer_store = _open(shm_dir / "arena", arena_of(16, PAGE_BYTES), fault_hook=writer.hook)
    reader_store = _open(shm_dir / "arena")
    try:
        assert writer_store.census().slots == 16
        assert reader_store.put(ns, old, [_segments(pages[k]) for k in old]) == [True] * len(old)
        assert writer.start().stopped.is_set(), "hang guard"
        got = reader_store.get(ns, keys, [_segments(out[k]) for k in keys])
        assert writer.thread.is_alive() and not writer.release.is_set()  # the read did not wait for the writer
        assert got[-1] is (stage == "published")
        gone = [key for key, ok in zip(old, got) if not ok]
        assert len(gone) == evicting  # the page it evicts is gone from the claim on; no other
        assert all(torch.equal(out[k], pages[k]) for k, ok in zip(keys, got) if ok)
        assert (reader_store.counts.torn, reader_store.counts.corrupt) == (0, 0)
        assert writer.go_on() == [True]
        out = {key: torch.zeros(PAGE_BYTES, dtype=torch.uint8) for key in keys}
        after = reader_store.get(ns, keys, [_segments(out[k]) for k in keys])
        assert after == [key not in gone for key in keys] and torch.equal(out["new"], pages["new"])
        assert (reader_store.counts.torn, reader_store.counts.corrupt) == (0, 0)
        assert reader_store.census().torn == 0
    finally:
        writer.let_go()
        writer_store.close()
        reader_store.close()


def test_a_page_being_cleared_is_a_plain_miss_and_a_put_meanwhile_is_not_the_clears(c_path, shm_dir):
    """A clear stopped in the C helper between one slot's odd generation and its empty record: another
    open's get of that key is False at once (not torn, not corrupt), and a put of the same key then
    stores it in another slot of the one-window arena. Once the clear goes on, it has emptied the 8
    pages it saw, and the page put meanwhile reads back byte-exact - it was not there to be seen."""
    ns = core_namespace()
    keys = [f"k{i}" for i in range(8)]
    pages = [page_bytes_of(6, i) for i in range(9)]
    clearing_store = _open(shm_dir / "arena", arena_of(16, PAGE_BYTES))
    other = _open(shm_dir / "arena")
    landing, clearer = torch.zeros(PAGE_BYTES, dtype=torch.uint8), None
    try:
        assert clearing_store.put(ns, keys, [_segments(p) for p in pages[:8]]) == [True] * 8
        slot = clearing_store.index.find(slot_keys(ns.digest, ["k3"]))[0][0]
        clearer = Stopped(lambda: clearing_store.clear([ns]), "reclaiming", slot)
        c_path.set_step_hook(clearer.hook)
        assert clearer.start().stopped.is_set(), "hang guard"
        assert other.get(ns, ["k3"], [_segments(landing)]) == [False]
        assert clearer.thread.is_alive() and not clearer.release.is_set()  # the read did not wait for the clear
        assert (other.counts.torn, other.counts.corrupt) == (0, 0)
        assert other.put(ns, ["k3"], [_segments(pages[8])]) == [True]
        assert other.index.find(slot_keys(ns.digest, ["k3"]))[0][0] != slot
        assert clearer.go_on() == 8
        assert other.present(ns, keys) == [key == "k3" for key in keys]
        assert other.get(ns, ["k3"], [_segments(landing)]) == [True] and torch.equal(landing, pages[8])
        assert other.census().torn == 0
    finally:
        if clearer is not None:
            clearer.let_go()
        clearing_store.close()
        other.close()


def test_a_lookup_never_finds_a_slot_claimed_between_its_generation_and_its_key(c_path, shm_dir):
    """A one-window arena of 16 live pages; a lookup of a new key reads its first slot's even
    generation, and before it compares that slot's key a writer claims the slot for the new key
    (odd generation, the new key in the record, as SlotIndex's claim writes them): the lookup
    must not report the key (exists 0, present False) and the read is a plain miss - the key it
    compared is the claim's, not a published page's."""
    ns = core_namespace()
    store = _open(shm_dir / "arena", arena_of(16, PAGE_BYTES))
    try:
        old = [f"old{i}" for i in range(16)]
        pages = [page_bytes_of(2, i) for i in range(19)]  # held while the helper reads them
        landing = torch.zeros(PAGE_BYTES, dtype=torch.uint8)
        assert store.put(ns, old, [_segments(pages[i]) for i in range(16)]) == [True] * 16
        index = store.index
        digest = slot_keys(ns.digest, ["new"])
        entry = index.entry_of(ns.digest)
        claims = []

        def claim_first_slot_looked_at(at, slot):
            if at != "looked" or claims:
                return
            record = index.arena.record_addr(slot)
            assert index._lock(slot), "no other writer holds it"
            odd = claimed_generation(index.ops.load(record))
            index.ops.store(record, odd)
            index.records.write_fields(slot, (odd, digest, 0, 0, PAGE_BYTES, 0, entry, 0, index.records.writer(),
                                              index.records.now_ns()))
            claims.append(slot)

        lookups = (lambda: store.exists(ns, ["new"]), lambda: store.present(ns, ["new"]),
                   lambda: store.get(ns, ["new"], [_segments(landing)]))
        for n, (lookup, missed) in enumerate(zip(lookups, (0, [False], [False]))):
            c_path.set_step_hook(claim_first_slot_looked_at)
            try:
                assert lookup() == missed
            finally:
                c_path.set_step_hook(None)
            assert len(claims) == 1
            index._unlock(claims.pop())
            assert index.reclaim_torn() == 1, "the claim is reclaimable: nothing else moved it"
            assert store.put(ns, [f"again{n}"], [_segments(pages[16 + n])]) == [True]  # refills it
        assert (store.counts.torn, store.counts.corrupt) == (0, 0)
    finally:
        store.close()


@pytest.mark.parametrize("rewrite", ["another-key", "the-same-key"])
def test_a_page_rewritten_after_the_c_read_delivered_it_is_torn_not_returned(c_path, shm_dir, rewrite):
    """A get stopped after the C read copied a found page out and before it re-checked the slot;
    meanwhile another open evicts every page of the one-window arena (another key now in that
    slot), or drops the key and stores it again (its own bytes, a new generation): the get says
    False and counts the page torn - not corrupt, so the slot's new page is left alone and reads
    back. A generation that moved on means the bytes are not this read's to trust."""
    ns = core_namespace()
    pages = [page_bytes_of(5, i) for i in range(32)]
    reader_store = _open(shm_dir / "arena", arena_of(16, PAGE_BYTES))
    writer_store = _open(shm_dir / "arena")
    landing = torch.zeros(PAGE_BYTES, dtype=torch.uint8)
    reader = Stopped(lambda: reader_store.get(ns, ["k3"], [_segments(landing)]), "delivered", None)
    try:
        keys = [f"k{i}" for i in range(16)]
        assert writer_store.put(ns, keys, [_segments(p) for p in pages[:16]]) == [True] * 16
        c_path.set_step_hook(reader.hook)
        assert reader.start().stopped.is_set(), "hang guard"
        if rewrite == "another-key":
            new = [f"n{i}" for i in range(16)]
            assert writer_store.put(ns, new, [_segments(p) for p in pages[16:]]) == [True] * 16
            assert writer_store.present(ns, ["k3"]) == [False]
        else:
            assert writer_store.clear([ns]) == 16
            assert writer_store.put(ns, ["k3"], [_segments(pages[3])]) == [True]
        assert reader.go_on() == [False]
        assert (reader_store.counts.torn, reader_store.counts.corrupt) == (1, 0)
        held = [f"n{i}" for i in range(16)] if rewrite == "another-key" else ["k3"]
        out = [torch.zeros(PAGE_BYTES, dtype=torch.uint8) for _ in held]
        assert reader_store.get(ns, held, [_segments(t) for t in out]) == [True] * len(held)  # none reclaimed
        expected = pages[16:] if rewrite == "another-key" else [pages[3]]
        assert all(torch.equal(got, want) for got, want in zip(out, expected))
    finally:
        reader.let_go()
        reader_store.close()
        writer_store.close()


def test_a_batch_copied_on_several_threads_stays_invisible_until_published(c_path, shm_dir, monkeypatch):
    """A batch of 8 pages whose copy the C write shares out over 4 threads (the host copy rule's
    threshold and thread count injected), stopped half-way through one page on a copy thread of
    its own (not the caller's): every page of the batch reads as a plain miss, the other
    threads' pages already copied included, and after the write goes on all 8 read back
    byte-exact."""
    monkeypatch.setattr("hicache.effects._copy._host_copy.PARALLEL_BYTES", 0)
    monkeypatch.setattr("hicache.effects._copy._host_copy.copy_threads", lambda: 4)
    ns = core_namespace()
    keys = [f"k{i}" for i in range(8)]
    pages = [page_bytes_of(3, i) for i in range(8)]
    out = [torch.zeros(PAGE_BYTES, dtype=torch.uint8) for _ in keys]
    stopped, release, result, halves = threading.Event(), threading.Event(), [], []
    writing = {}

    def hook(at, n):
        if at != "half":
            return
        halves.append((n, threading.get_ident()))
        if n == 7:  # the last share's: a copy thread's, never the caller's
            stopped.set()
            assert release.wait(60), "hang guard"

    def write():
        writing["thread"] = threading.get_ident()
        result.append(writer_store.put(ns, keys, [_segments(p) for p in pages]))

    writer_store = _open(shm_dir / "arena", 8 << 20)
    reader_store = _open(shm_dir / "arena")
    writer = threading.Thread(target=write)
    try:
        c_path.set_step_hook(hook)
        writer.start()
        assert stopped.wait(60), "hang guard"
        assert reader_store.get(ns, keys, [_segments(t) for t in out]) == [False] * 8
        assert reader_store.exists(ns, keys) == 0 and writer.is_alive()
        assert (reader_store.counts.torn, reader_store.counts.corrupt) == (0, 0)
        release.set()
        writer.join(60)
        assert result == [[True] * 8]
        assert sorted(n for n, _ in halves) == list(range(8))  # each page's half-way point once
        assert len({thread for _, thread in halves}) == 4 and writing["thread"] != dict(halves)[7]
        assert reader_store.get(ns, keys, [_segments(t) for t in out]) == [True] * 8
        assert all(torch.equal(got, want) for got, want in zip(out, pages))
    finally:
        release.set()
        writer.join(60)
        writer_store.close()
        reader_store.close()


class StoppedWriterAndReader(RuleBasedStateMachine):
    """Three opens of a one-window arena. One write and one get at a time are each stopped at any
    step of any page of their batch - the write (the C path's step hook, or the Python path's
    fault hook) anywhere from its claim to its publish, the C get after it delivered a page and
    before it re-checks the slot - while the third open puts, gets, flips a bit of any slot,
    leaves a dead writer's torn slot or re-attaches; then each goes on. A get that says True
    always delivers the bytes that key was given - never a torn page, a flipped one or another
    key's - and nothing ever waits on a stopped operation."""

    def __init__(self, hooked, path: str) -> None:
        super().__init__()
        self.hooked, self.path = hooked, path
        self.stores, self.writer, self.reader = [], None, None

    @initialize()
    def start(self):
        import tempfile

        self.directory = tempfile.mkdtemp(prefix="hicache-test-", dir="/dev/shm")
        self.ns = core_namespace()
        self.pages = [page_bytes_of(4, i) for i in range(24)]
        self.given: set[int] = set()
        if self.hooked is not None:
            self.hooked.set_step_hook(self._hook)  # the C write's steps (path "c") and every C read's
        hook = self._hook if self.path == "python" else None
        first = _open(self.directory + "/arena", arena_of(16, PAGE_BYTES), fault_hook=hook)
        self.stores = [first, _open(self.directory + "/arena"), _open(self.directory + "/arena")]

    def _hook(self, stage, n):
        for stopped in (self.writer, self.reader):
            if stopped is not None:
                stopped.hook(stage, n)

    @property
    def other(self):
        return self.stores[1]

    def _check(self, keys, ok, out):
        for key, hit, got in zip(keys, ok, out):
            if hit:
                assert key in self.offered and torch.equal(got, self.pages[key]), key

    @property
    def offered(self) -> set:
        """Keys some put has been given (a read may meet a write in flight: never other bytes)."""
        return self.given | set(getattr(self, "writing", ()))

    @precondition(lambda self: self.writer is None)
    @rule(keys=st.lists(st.integers(0, 23), min_size=1, max_size=4, unique=True), stage=st.sampled_from(STAGES),
          page=st.integers(0, 3))
    def stop_a_write(self, keys, stage, page):
        self.writing = keys
        self.writer = Stopped(lambda: self.stores[0].put(self.ns, [f"k{k}" for k in keys],
                                                         [_segments(self.pages[k]) for k in keys]),
                              stage, page % len(keys))
        self.writer.start()

    @precondition(lambda self: self.writer is not None)
    @rule()
    def the_write_goes_on(self):
        stored = self.writer.go_on()
        self.given.update(k for k, ok in zip(self.writing, stored) if ok)
        self.writer = None

    @precondition(lambda self: self.reader is None and self.hooked is not None)
    @rule(keys=st.lists(st.integers(0, 23), min_size=1, max_size=4, unique=True))
    def stop_a_get(self, keys):
        self.reading = keys
        self.landing = [torch.zeros(PAGE_BYTES, dtype=torch.uint8) for _ in keys]
        self.reader = Stopped(lambda: self.stores[2].get(self.ns, [f"k{k}" for k in keys],
                                                         [_segments(t) for t in self.landing]),
                              "delivered", None)  # after the first page it found is copied out
        self.reader.start()

    @precondition(lambda self: self.reader is not None)
    @rule()
    def the_get_goes_on(self):
        self._check(self.reading, self.reader.go_on(), self.landing)
        self.reader = None

    @rule(key=st.integers(0, 23))
    def put(self, key):
        if self.other.put(self.ns, [f"k{key}"], [_segments(self.pages[key])]) == [True]:
            self.given.add(key)

    @rule(keys=st.lists(st.integers(0, 23), min_size=1, max_size=6, unique=True))
    def get(self, keys):
        out = [torch.zeros(PAGE_BYTES, dtype=torch.uint8) for _ in keys]
        self._check(keys, self.other.get(self.ns, [f"k{k}" for k in keys], [_segments(t) for t in out]), out)

    @rule(slot=st.integers(0, 15), offset=st.integers(0, PAGE_BYTES - 1), bit=st.integers(0, 7))
    def flip(self, slot, offset, bit):
        byte = ctypes.c_ubyte.from_address(self.other.arena.slot_addr(slot) + offset)
        byte.value ^= 1 << bit

    @rule(slot=st.integers(0, 15))
    def a_writer_dies(self, slot):
        leave_torn(self.other, slot)

    @rule()
    def reattach(self):
        self.stores[1].close()
        self.stores[1] = _open(self.directory + "/arena")

    @invariant()
    def at_most_the_slots(self):
        if self.stores:
            assert self.other.census().pages <= 16

    def teardown(self):
        import shutil

        for stopped in (self.writer, self.reader):
            if stopped is not None:
                stopped.let_go()
        if self.hooked is not None:
            self.hooked.set_step_hook(None)
        for store in self.stores:
            store.close()
        if self.stores:
            shutil.rmtree(self.directory, ignore_errors=True)


@pytest.mark.parametrize("path", ["c", "python"])
def test_no_get_returns_wrong_bytes_with_a_write_stopped_at_any_step(request, path):
    """The StoppedWriterAndReader machine over each write path (the C one through the test build;
    the Python one stops no read where no helper can be built, its reads being Python's too)."""
    try:
        hooked = request.getfixturevalue("c_path")
    except pytest.skip.Exception:
        if path == "c":
            raise
        hooked = None
    run_state_machine_as_test(lambda: StoppedWriterAndReader(hooked, path),
                              settings=settings(max_examples=60, stateful_step_count=30, deadline=None))
