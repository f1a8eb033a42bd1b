"""The node store at its edges (issue #51): a closed store is an error naming the arena and never
a read of unmapped memory (in a child process: no signal), and `close()` waits for a transfer in
flight on another thread; a segment is refused unless it is whole words, one page with every
page cut alike, and outside the arena's own mapping; a record a writer is changing reads as torn,
never corrupt; a second attach writes the windows the first one wrote (the first let its locks
go)."""

from __future__ import annotations

import ctypes
import subprocess
import sys
import textwrap
import threading

from array import array

import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st
from store_support import MovedOnAfterLookup, StoppingOps, shm_dir, wait_until  # noqa: F401 - shm_dir: a fixture
from test_store_index import NS, OPS, PAGE, Pages, _open, _slot_of

from hicache.errors import StoreClosedError, TransferError
from hicache.plan._store import LENGTH, RECORD
from hicache.effects.arena import NativeSlotOps, PythonSlotOps
from hicache.effects._arena._slots import _native as _slot_native
from hicache.store._pages import PageSegments, check_pages

torch = pytest.importorskip("torch")
_LENGTH_AT = 8 + 16 + 8 + 8  # a record's length field: after gen, key, sum1, sum2


@pytest.fixture(params=OPS)
def ops(request):
    return request.param


CALLS = {
    "exists": lambda s, p: s.exists(NS, ["k"]),
    "present": lambda s, p: s.present(NS, ["k"]),
    "get": lambda s, p: s.get(NS, ["k"], p.segments()),
    "put": lambda s, p: s.put(NS, ["k"], p.segments()),
    "census": lambda s, p: s.census(),
    "clear": lambda s, p: s.clear(),
}


@pytest.mark.parametrize("call", sorted(CALLS))
def test_every_call_on_a_closed_store_is_one_error_naming_the_arena(shm_dir, call):
    """After close(), each call raises StoreClosedError naming the arena and the call; close()
    again is a no-op."""
    store, page = _open(shm_dir, "python"), Pages(1)
    store.put(NS, ["k"], page.segments())
    store.close()
    store.close()
    with pytest.raises(StoreClosedError, match=rf"{shm_dir}/arena: {call}\(\) after close"):
        CALLS[call](store, page)


def test_a_with_block_closes_the_store_however_it_ends_and_its_pages_stay(shm_dir):
    """``with open_store(...) as store:`` closes the store when the block ends - and when it
    raises, the error going on unchanged; a call afterwards raises StoreClosedError, entering a
    closed store raises it naming the arena, and the next attach reads the pages put inside. Its
    repr names the arena, its backing, its slots and whether it is open."""
    page, out = Pages(1), Pages(1, seed=7)
    with _open(shm_dir, "python") as store:
        assert store.put(NS, ["k"], page.segments()) == [True]
        slots = f"{store.arena.plan.slots:,} slots of {store.arena.plan.slot_bytes:,} bytes"
        assert repr(store) == f"<NodeStore {shm_dir}/arena: tmpfs, {slots}, open>"
    assert store.closed and repr(store) == f"<NodeStore {shm_dir}/arena: tmpfs, {slots}, closed>"
    with pytest.raises(StoreClosedError, match=rf"{shm_dir}/arena: exists\(\) after close"):
        store.exists(NS, ["k"])
    with pytest.raises(StoreClosedError, match=rf"{shm_dir}/arena: with after close"):
        with store:
            pass
    with pytest.raises(KeyError, match="raised inside"):
        with _open(shm_dir, "python") as again:
            assert again.get(NS, ["k"], out.segments()) == [True] and torch.equal(out.data, page.data)
            raise KeyError("raised inside")
    assert again.closed


@pytest.mark.concurrency
def test_calls_after_close_in_a_child_process_raise_and_never_signal(shm_dir):
    """issue #51's crash: in a fresh process (native ops where built), every call after close()
    - NodeStore's and HiCacheNodeStore's zero-copy get - is an error; the child exits 0, no
    SIGSEGV."""
    script = textwrap.dedent(f"""
        import sys
        sys.path.insert(0, "tests")
        from test_store_index import NS, Pages
        from test_store_edges import CALLS
        from hicache.errors import StoreClosedError
        from hicache.store import open_store
        store = open_store({str(shm_dir / "arena")!r}, size_bytes=8 << 20, slot_bytes={PAGE})
        page = Pages(1)
        store.put(NS, ["k"], page.segments())
        store.close()
        for name, call in sorted(CALLS.items()):
            try:
                call(store, page)
            except StoreClosedError:
                print("refused", name)
    """)
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.split("\n")[:-1] == [f"refused {name}" for name in sorted(CALLS)]


@pytest.mark.concurrency
def test_close_waits_for_a_read_in_flight_and_the_read_completes(shm_dir, ops):
    """A thread stopped inside a get's copy (an Event it waits on): close() on another thread
    does not return while the copy is in flight; released, the read delivers its page byte-exact,
    close() returns, and the next call is StoreClosedError."""
    store, src, dst = _open(shm_dir, ops), Pages(1), Pages(1, seed=9)
    store.put(NS, ["k"], src.segments())
    closed = threading.Event()
    stopping = store.index.ops = StoppingOps(store.index.ops)
    result = []
    reader = threading.Thread(target=lambda: result.append(store.get(NS, ["k"], dst.segments())))
    closer = threading.Thread(target=lambda: (store.close(), closed.set()))
    try:
        reader.start()
        assert stopping.inside.wait(60), "hang guard"
        closer.start()
        wait_until(lambda: store.closed)
        assert not closed.is_set() and not store.arena.closed  # it waits for the copy in flight
    finally:
        stopping.go.set()
        reader.join(60)
        closer.join(60)
    assert result == [[True]] and torch.equal(dst.data, src.data) and closed.is_set()
    with pytest.raises(StoreClosedError):
        store.get(NS, ["k"], dst.segments())


@pytest.mark.parametrize("case, match", [
    ("mixed segment counts", "page 1 has 2 segments, page 0 has 1"),
    ("a page of no segments", "page 0 has no segments"),
    ("a negative pointer", "is not a pointer and a size inside the address space"),
    ("a size past 2**64", "is not a pointer and a size inside the address space"),
    ("a pointer that is not a number", "is not a pointer and a size inside the address space"),
    ("a segment not whole words", "4 bytes is not whole 8-byte words"),
    ("segments short of a page", "not one page"),
    ("a null pointer", "outside the address space"),
    ("past the address space", "outside the address space"),
    ("into the arena's index", "arena's own mapping"),
    ("ending in the arena's header", "arena's own mapping"),
])
@pytest.mark.parametrize("direction", ["put", "get"])
def test_bad_segments_are_refused_before_any_copy(shm_dir, case, match, direction, ops):
    """Every page's segments are checked before any byte moves, on reads and writes, by the C
    helper's pass and by the fallback's: the same number per page, whole 8-byte words, one page
    in all, inside the address space and outside the arena's mapping (a segment into its index
    would wipe every engine's view of it)."""
    store, src = _open(shm_dir, ops), Pages(2)
    try:
        store.put(NS, ["a", "b"], src.segments())
        index = store.arena.base + store.arena.plan.index_offset
        snapshot = ctypes.string_at(index, store.arena.plan.index_bytes)
        base = src.data[0].data_ptr()
        pages = {
            "mixed segment counts": [[(base, PAGE)], [(base, PAGE // 2), (base + PAGE // 2, PAGE // 2)]],
            "a page of no segments": [[]],
            "a negative pointer": [[(-base, PAGE)]],
            "a size past 2**64": [[(base, 2**64 + PAGE)]],
            "a pointer that is not a number": [[(str(base), PAGE)]],
            "a segment not whole words": [[(base, 4), (base + 4, PAGE - 4)]],
            "segments short of a page": [[(base, PAGE - 8)]],
            "a null pointer": [[(0, PAGE)]],
            "past the address space": [[(2**64 - 8, PAGE)]],
            "into the arena's index": [[(index, PAGE)]],
            "ending in the arena's header": [[(store.arena.base - PAGE + 8, PAGE)]],
        }[case]
        keys = ["a", "b"][:len(pages)] if direction == "get" else ["x", "y"][:len(pages)]
        with pytest.raises(TransferError, match=match):
            getattr(store, direction)(NS, keys, pages)
        assert ctypes.string_at(index, store.arena.plan.index_bytes) == snapshot
        assert store.exists(NS, ["a", "b"]) == 2 and store.present(NS, ["x"]) == [False]
    finally:
        store.close()


_TOP = 2**63


@st.composite
def segment_batches(draw):
    """Batches of pages cut into segments near every edge the checks draw: address 0, 2**63 and
    2**64, the arena's two ends, sizes of 0, not whole words, larger than a page, short of one."""
    per_page = draw(st.integers(1, 3))
    page_bytes = 8 * draw(st.integers(per_page, 64))
    arena = (draw(st.sampled_from([4096, 2**40, _TOP - 2**20])), 0)
    arena = (arena[0], arena[0] + 8 * draw(st.integers(1, 4096)))
    edges = [0, 8, arena[0], arena[1], _TOP, 2**64]
    pages = draw(st.integers(1, 6))
    ptrs, sizes = [], []
    for _ in range(pages):
        good = draw(st.booleans())
        cuts = [page_bytes // per_page // 8 * 8] * (per_page - 1)
        cuts.append(page_bytes - sum(cuts))
        for size in cuts:
            if good:
                ptrs.append(draw(st.integers(2**20, 2**30)) * 8)
                sizes.append(size)
                continue
            size = draw(st.one_of(st.just(size), st.integers(0, 2 * page_bytes), st.integers(0, 2**64 - 1)))
            # a segment starting or ending at an edge, a few words either side, or anywhere
            near = st.builds(lambda edge, end, words: (edge - (size if end else 0) + 8 * words) % 2**64,
                             st.sampled_from(edges), st.booleans(), st.integers(-2, 2))
            ptrs.append(draw(st.one_of(near, st.integers(0, 2**64 - 1))))
            sizes.append(size)
    return ptrs, sizes, per_page, page_bytes, arena


@pytest.mark.skipif(_slot_native is None, reason="the C helper is not built (no compiler)")
@settings(max_examples=400, deadline=None)
@given(segment_batches())
@example(([4096 - 64], [64], 1, 64, (4096, 8192)))  # ends where the arena starts: good
@example(([4096 - 56], [64], 1, 64, (4096, 8192)))  # one word into it
@example(([8192], [64], 1, 64, (4096, 8192)))  # starts where it ends: good
@example(([8192 - 8], [64], 1, 64, (4096, 8192)))
@example(([_TOP - 128], [64], 1, 64, (4096, 8192)))  # ends a page below 2**63: good
@example(([_TOP - 64], [64], 1, 64, (4096, 8192)))  # ends at 2**63
@example(([2**20, 2**21], [32, 32], 2, 64, (4096, 8192)))  # two segments, one page: good
@example(([8, 16, 24], [_TOP - 8, _TOP - 8, 80], 3, 64, (4096, 8192)))  # sizes adding up to 2**64 + a page
def test_the_c_helpers_segment_checks_agree_with_the_fallbacks(batch):
    """The C helper's `check_segments` and the fallback's torch pass find the same first bad page
    (or none) on every batch, edges included (a law: either pass may run the store's checks)."""
    ptrs, sizes, per_page, page_bytes, (start, end) = batch
    ptrs, sizes = array("Q", ptrs), array("Q", sizes)
    native = NativeSlotOps.first_bad_page(ptrs, sizes, per_page, page_bytes, start, end)
    assert native == PythonSlotOps.first_bad_page(ptrs, sizes, per_page, page_bytes, start, end)
    if native >= 0:  # the message pass agrees too: it names that page
        with pytest.raises(TransferError, match=f"^page {native}:"):
            check_pages(PageSegments(ptrs, sizes, per_page), count=len(ptrs) // per_page, page_bytes=page_bytes,
                        arena=(start, end), where="test", ops=NativeSlotOps)


_EDGES = [0, 8, 64, 2**20, 2**63 - 8, 2**63, 2**64 - 8, 2**64]
_ANY_NUMBER = st.one_of(st.integers(-2**65, 2**65), st.sampled_from(_EDGES),
                        st.floats(allow_nan=True), st.text(max_size=3), st.none())


@settings(max_examples=300, deadline=None)
@given(st.lists(st.lists(st.tuples(_ANY_NUMBER, _ANY_NUMBER), max_size=3), max_size=3))
@example([[(2**20, 2**64 + 64)]])  # a good pointer, a size past 2**64
@example([[(2**20, 64)], [(2**20, 2**64 + 64)]])
def test_any_list_of_segments_is_taken_or_refused_by_name(pages):
    """Whatever a caller passes as ``[(ptr, bytes), ...]`` per page - negative, past 2**64, not a
    number, ragged - the batch is checked or refused with a `TransferError`, never another error
    (an OverflowError once escaped for a size past 2**64)."""
    try:
        batch = PageSegments.of(pages)
        check_pages(batch, count=len(pages), page_bytes=64, arena=(4096, 8192), where="test", ops=PythonSlotOps)
    except TransferError:
        pass


@settings(max_examples=100, deadline=None)
@given(st.integers(1, 3).flatmap(lambda k: st.tuples(
    st.lists(st.lists(st.tuples(st.integers(1, 2**62), st.integers(1, 2**20)), min_size=k, max_size=k), max_size=6),
    st.data())))
def test_a_batch_taken_apart_holds_the_very_segments_of_the_pages_picked(case):
    """`PageSegments.page` and `.take` give each picked page's own segments - pointers and sizes
    that differ from page to page included - in the order picked (a write takes the pages whose
    keys are not held yet)."""
    pages, data = case
    batch = PageSegments.of(pages)
    assert [batch.page(i) for i in range(batch.count)] == [list(p) for p in pages]
    picked = data.draw(st.lists(st.integers(0, max(len(pages) - 1, 0)), max_size=len(pages))) if pages else []
    taken = batch.take(picked)
    assert [taken.page(i) for i in range(taken.count)] == [list(pages[i]) for i in picked]
    assert taken.per_page == batch.per_page and len(taken.ptrs) == len(taken.sizes)


class _FastPassSaysBad:
    """Slot ops whose one-pass check calls page 0 bad though every segment is good."""

    @staticmethod
    def first_bad_page(*_args) -> int:
        return 0


def test_a_page_the_fast_pass_refuses_and_the_message_pass_cannot_name_is_still_refused():
    """When the vectorized pass and the message pass disagree, the batch is refused (an
    AssertionError naming the disagreement), never let through to the copy."""
    good = PageSegments(array("Q", [2**20]), array("Q", [64]), 1)
    check_pages(good, count=1, page_bytes=64, arena=(4096, 8192), where="test", ops=PythonSlotOps)  # good
    with pytest.raises(AssertionError, match="the slow pass did not find"):
        check_pages(good, count=1, page_bytes=64, arena=(4096, 8192), where="test", ops=_FastPassSaysBad)


def _one_stored(shm_dir, ops):
    """(store, its page, a page to read into, the slot) of a store holding one page under "k"."""
    store, src, dst = _open(shm_dir, ops), Pages(1), Pages(1, seed=3)
    store.put(NS, ["k"], src.segments())
    return store, src, dst, _slot_of(store, "k")


def test_a_record_a_writer_is_changing_reads_as_torn_not_corrupt(shm_dir, ops):
    """Between the lookup and the record read another writer takes the slot (its generation odd,
    its length being rewritten): torn, not corrupt - corrupt means bytes that failed their
    checksum or a length no writer is changing."""
    store, _, dst, slot = _one_stored(shm_dir, ops)
    addr = store.arena.record_addr(slot)

    def writer_arrives(found, gens):
        store.arena.ops.store(addr, gens[0] + 1)  # a writer of another page claimed it: odd generation,
        ctypes.c_uint32.from_address(addr + _LENGTH_AT).value = 8  # its own length
        return gens

    store.index.ops = MovedOnAfterLookup(store.index.ops, writer_arrives)
    try:
        assert store.get(NS, ["k"], dst.segments()) == [False]
        assert (store.counts.torn, store.counts.corrupt) == (1, 0)
    finally:
        store.close()


def test_a_length_no_writer_is_changing_is_corrupt(shm_dir, ops):
    """A record whose length differs from its namespace's page, its generation steady: corrupt."""
    store, _, dst, slot = _one_stored(shm_dir, ops)
    offset = _LENGTH_AT
    assert RECORD.unpack_from(ctypes.string_at(store.arena.record_addr(slot), RECORD.size))[LENGTH] == PAGE
    ctypes.c_uint32.from_address(store.arena.record_addr(slot) + offset).value = PAGE - 8
    try:
        assert store.get(NS, ["k"], dst.segments()) == [False]
        assert (store.counts.torn, store.counts.corrupt) == (0, 1)
    finally:
        store.close()


def test_a_second_attach_rewrites_the_windows_the_first_wrote(shm_dir, ops):
    """Two attaches (two processes' locks): after A stored a batch, B overwrites every slot of
    that window - possible only if A let each slot's lock go - and A reads B's pages back."""
    from test_store_index import ONE_WINDOW

    a, b = _open(shm_dir, ops, total=ONE_WINDOW), _open(shm_dir, ops, total=ONE_WINDOW)
    first, second = Pages(16, seed=30), Pages(16, seed=31)
    out = Pages(16, seed=32)
    try:
        assert a.put(NS, [f"a{i}" for i in range(16)], first.segments()) == [True] * 16
        assert b.put(NS, [f"b{i}" for i in range(16)], second.segments()) == [True] * 16
        assert a.get(NS, [f"b{i}" for i in range(16)], out.segments()) == [True] * 16
        assert torch.equal(out.data, second.data) and a.exists(NS, ["a0"]) == 0
    finally:
        a.close()
        b.close()


def _namespace(i: int):
    from hicache.store import Namespace

    return Namespace(model=f"model-{i}", dtype="torch.bfloat16", page_tokens=16, layout="page_first/segments",
                     pool="kv", page_bytes=PAGE, shard=(("tp", 0, 1),))


def test_300_namespaces_each_cleared_leave_nothing_behind(shm_dir, ops):
    """300 namespaces (more than the table's 256 entries), each storing pages and then cleared:
    every clear() leaves no page of its namespace, its entry goes back to the table, and no page
    is ever filed under the old overflow entry 65535."""
    from hicache.store._index import NO_NAMESPACE

    store, src = _open(shm_dir, ops), Pages(2)
    try:
        for i in range(300):
            namespace = _namespace(i)
            assert store.put(namespace, ["a", "b"], src.segments()) == [True, True]
            census = store.census()
            assert NO_NAMESPACE not in census.by_namespace and census.pages == 2
            assert store.clear([namespace]) == 2
            assert store.census().pages == 0 and store.present(namespace, ["a", "b"]) == [False, False]
        assert store.index.namespaces() == {}
    finally:
        store.close()


def test_a_full_table_frees_entries_without_pages_and_refuses_when_none_is(shm_dir, ops):
    """256 namespaces holding a page each fill the table: a 257th namespace's write is
    NamespaceTableFullError naming the arena (its page is filed nowhere), reads still answer;
    once one namespace's last page goes (another process's clear), the next write takes its
    entry."""
    from hicache.errors import NamespaceTableFullError

    store, other, src = _open(shm_dir, ops), _open(shm_dir, ops), Pages(1)
    try:
        for i in range(256):
            assert store.put(_namespace(i), ["k"], src.segments()) == [True]
        with pytest.raises(NamespaceTableFullError, match=rf"{shm_dir}/arena: all 256 namespace entries hold pages"):
            store.put(_namespace(256), ["k"], src.segments())
        assert store.census().pages == 256 and store.exists(_namespace(3), ["k"]) == 1
        assert other.clear([_namespace(7)]) == 1
        assert store.put(_namespace(256), ["k"], src.segments()) == [True]
        assert store.exists(_namespace(256), ["k"]) == 1 and store.exists(_namespace(7), ["k"]) == 0
        assert len(store.index.namespaces()) == 256
    finally:
        store.close()
        other.close()


def test_entries_whose_pages_were_evicted_are_freed_when_the_table_fills(shm_dir, ops):
    """On a one-window arena (16 slots) 300 namespaces write one page each: eviction takes the
    old pages, and each registration past the 256th frees entries no page names - every write
    is stored, the table never overflows."""
    from test_store_index import ONE_WINDOW

    store, src = _open(shm_dir, ops, total=ONE_WINDOW), Pages(1)
    try:
        for i in range(300):
            assert store.put(_namespace(i), ["k"], src.segments()) == [True]
        assert len(store.index.namespaces()) <= 256 and store.census().pages == 16
    finally:
        store.close()


def test_a_new_namespace_entry_is_held_from_the_moment_it_is_claimed(shm_dir, ops):
    """register_namespace claims a free entry and holds it in one step (its exclusive lock turned
    shared): another attach can neither free it nor take it exclusively before the writer's
    release - the race a peer's clear() loop won three times in a row (a writer then crashed)."""
    a, b = _open(shm_dir, ops), _open(shm_dir, ops)
    namespace = _namespace(5)
    try:
        entry = a.index.register_namespace(namespace.digest, namespace.description)
        assert b.index.free_entries([entry]) == 0 and b.index.entry_of(namespace.digest) == entry
        a.index.release_entry(entry)
        assert b.index.free_entries([entry]) == 1
    finally:
        a.close()
        b.close()


def test_a_write_whose_entry_another_process_is_freeing_stores_nothing_and_does_not_wait(shm_dir, ops):
    """Another attach holding the namespace's entry exclusively at every look (freeing it): the
    put returns False for each page at once, counted busy, nothing filed under any entry; once
    it lets go, the same put stores."""
    from hicache.effects import arena as effects_arena

    a, b, src = _open(shm_dir, ops), _open(shm_dir, ops), Pages(2)
    namespace = _namespace(6)
    try:
        entry = b.index.register_namespace(namespace.digest, namespace.description)
        b.index.release_entry(entry)
        offset, length = b.index._namespace_range(entry)
        assert effects_arena.try_lock(b.arena.fd, offset, length)  # b "frees" it: exclusive
        try:
            assert a.put(namespace, ["x", "y"], src.segments()) == [False, False]
            assert a.counts.busy == 2 and a.census().pages == 0
        finally:
            effects_arena.unlock(b.arena.fd, offset, length)
        assert a.put(namespace, ["x", "y"], src.segments()) == [True, True]
    finally:
        a.close()
        b.close()


def test_a_namespace_entry_held_by_a_writer_is_not_freed_and_a_freed_one_is_claimed_again(shm_dir, ops):
    """A writer holding its entry (shared) keeps another attach from freeing it even with no
    page under it yet; a store whose cached entry was freed since (another attach's clear)
    claims an entry again on its next write, and its page is cleared with its namespace."""
    a, b, src = _open(shm_dir, ops), _open(shm_dir, ops), Pages(1)
    namespace = _namespace(1)
    try:
        assert a.put(namespace, ["k"], src.segments()) == [True]
        entry = a.index.entry_of(namespace.digest)
        assert a.index.hold_entry(entry, namespace.digest)
        assert b.clear([namespace]) == 1 and b.index.entry_of(namespace.digest) == entry  # held: not freed
        assert a.index.free_entries([entry]) == 0  # nor by a's own process while its writer holds it
        a.index.release_entry(entry)
        assert b.index.free_entries([entry]) == 1 and b.index.namespaces() == {}
        b.put(_namespace(2), ["x"], src.segments())  # takes the freed entry
        assert b.index.entry_of(_namespace(2).digest) == entry
        assert a.put(namespace, ["k"], src.segments()) == [True]  # a's cache is stale: claims again
        assert a.index.entry_of(namespace.digest) not in (entry, 0xFFFF)
        assert b.clear([namespace]) == 1 and b.census().pages == 1 and b.exists(_namespace(2), ["x"]) == 1
    finally:
        a.close()
        b.close()


_ROLE = """
import sys, torch
sys.path.insert(0, "tests")
from test_store_index import NS, PAGE
from hicache.store import open_store

role, path, rounds = sys.argv[1], sys.argv[2], int(sys.argv[3])
keys = [f"k{i}" for i in range(24)]
# each key's bytes are fixed (derived from the key): any hit must deliver exactly them
pages = torch.stack([torch.full((PAGE,), i + 1, dtype=torch.uint8) ^ torch.arange(PAGE, dtype=torch.uint8)
                     for i in range(24)])
out = torch.zeros_like(pages)
store = open_store(path, size_bytes=None, slot_bytes=PAGE)
print("ready", flush=True)
sys.stdin.readline()  # "go": every role starts together
wrong = hits = 0
for r in range(rounds):
    if role == "writer":
        store.put(NS, keys[r % 3::3], [[(pages[i].data_ptr(), PAGE)] for i in range(24)][r % 3::3])
    elif role == "clearer":
        store.clear([NS])
    else:
        ok = store.get(NS, keys, [[(out[i].data_ptr(), PAGE)] for i in range(24)])
        hits += sum(ok)
        wrong += sum(1 for i, hit in enumerate(ok) if hit and not torch.equal(out[i], pages[i]))
print("done", store.counts.corrupt, store.counts.torn, wrong, hits, flush=True)
store.close()
"""


@pytest.mark.concurrency
def test_three_processes_writing_clearing_and_reading_the_same_keys_count_nothing_corrupt(shm_dir):
    """A writer, a clearer and a reader process over the same 24 keys, started together
    (bounded loops): no read delivers a wrong byte, and nothing is counted corrupt - a page a
    writer or a clear was changing is torn or a miss, never "corrupt" (issue #51 item 5: 299
    on a healthy node)."""
    import subprocess

    path = str(shm_dir / "arena")
    _open(shm_dir, "python").close()
    rounds = {"writer": 300, "clearer": 300, "reader": 300}
    children = {role: subprocess.Popen([sys.executable, "-c", _ROLE, role, path, str(n)], stdin=subprocess.PIPE,
                                       stdout=subprocess.PIPE, text=True) for role, n in rounds.items()}
    try:
        for child in children.values():
            assert child.stdout.readline().strip() == "ready"
        for child in children.values():
            child.stdin.write("go\n")
            child.stdin.flush()
        results = {}
        for role, child in children.items():
            words = child.stdout.readline().split()
            assert words and words[0] == "done", role
            results[role] = [int(w) for w in words[1:]]
            assert child.wait(120) == 0
    finally:
        for child in children.values():
            child.kill() if child.poll() is None else None
            child.stdin.close()
            child.stdout.close()
    corrupt, torn, wrong, _ = results["reader"]
    assert (corrupt, wrong) == (0, 0), results
    store = _open(shm_dir, "python")
    try:
        assert store.arena.counters()["corrupt"] == 0
    finally:
        store.close()


def test_the_python_example_in_docs_store_md_runs_as_written(shm_dir):
    """docs/store.md's NodeStore example, run with its arena moved into the test's directory:
    it stores, reads its hits back and closes."""
    from pathlib import Path

    text = (Path(__file__).resolve().parent.parent / "docs" / "store.md").read_text()
    block = text.split("## From Python", 1)[1].split("```python\n", 1)[1].split("```", 1)[0]
    assert '"/dev/shm/my-arena"' in block
    scope: dict = {}
    exec(compile(block.replace('"/dev/shm/my-arena"', repr(str(shm_dir / "arena"))), "docs/store.md", "exec"), scope)
    assert scope["hits"] == [True, True, False] and torch.equal(scope["out"][:2], scope["pages"][:2])
    with pytest.raises(StoreClosedError):
        scope["store"].exists(scope["ns"], ["a"])


@pytest.mark.parametrize("call, refusal", [
    (lambda s, p: s.put(NS, "ab", p.segments()), "keys must be a list of strings, got one str: 'ab'"),
    (lambda s, p: s.exists(NS, b"ab"), "keys must be a list of strings, got one bytes"),
    (lambda s, p: s.put(NS, ["a", 2], p.segments()), "keys must be strings: key 1 is 2 (int)"),
    (lambda s, p: s.present(NS, [None]), "keys must be strings: key 0 is None (NoneType)"),
    (lambda s, p: s.put("kv", ["a", "b"], p.segments()), "namespace must be a hicache.store.Namespace, got 'kv'"),
    (lambda s, p: s.get(NS, ["a"], None), "pages must be a list of [(ptr, bytes), ...] per page, got None"),
    (lambda s, p: s.exists(NS, None), "keys must be a list of strings, got NoneType None"),
    (lambda s, p: s.put(NS, ["a"], [p.data[0]]), "page 0 is a Tensor (a page is a list of [(ptr, bytes), ...]: a "
                                                 "tensor's data_ptr() and nbytes, not the tensor)"),
    (lambda s, p: s.get(NS, ["a", "b"], p.data), "pages must be a list of [(ptr, bytes), ...] per page, got a Tensor"),
    (lambda s, p: s.put(NS, ["a"], [None]), "page 0 must be a list of (ptr, bytes) segments, got NoneType None"),
    (lambda s, p: s.put(NS, ["a"], [[(p.data[0].data_ptr(), PAGE, 0)]]), "page 0: a segment must be a (ptr, bytes) "
                                                                         "pair, got tuple"),
], ids=["str-keys", "bytes-keys", "int-key", "none-key", "namespace", "pages", "none-keys", "tensor-page",
        "tensor-pages", "none-page", "triple-segment"])
def test_a_batch_of_the_wrong_kind_is_refused_naming_it(shm_dir, call, refusal):
    """One string as the keys (it was read as one key per character: put "ab" stored pages under
    "a" and "b"), None as the keys (read as none), a key that is no string, a namespace that is
    no Namespace, pages that are no list, tensors given as pages, a segment that is no pair: each
    a TransferError naming it (they were AttributeErrors and TypeErrors - "iteration over a 0-d
    tensor"), nothing stored."""
    import re

    store, pages = _open(shm_dir, "python"), Pages(2)
    try:
        with pytest.raises(TransferError, match=re.escape(refusal)):
            call(store, pages)
        assert store.present(NS, ["a", "b"]) == [False, False]
    finally:
        store.close()


@pytest.mark.parametrize("kwargs, refusal", [
    (dict(path=5), "open_store.path must be a path, got 5"),
    (dict(label=5), "open_store.label must be a string, got 5"),
    (dict(label="x" * 65), "open_store.label must be at most 64 bytes of UTF-8, got 65"),
    (dict(label="a\nb"), "open_store.label must be printable text, got 'a\\nb'"),
    (dict(threads="4"), "open_store.threads must be an integer, got '4'"),
    (dict(threads=0), "open_store.threads must be positive, got 0"),
    (dict(budget="no"), "open_store.budget must be True or False, got 'no'"),
    (dict(size_bytes=-1), "open_store.size_bytes must be positive, got -1"),
    (dict(size_bytes="16M"), "open_store.size_bytes must be an integer, got '16M' (str)"),
    (dict(slot_bytes=4096.0), "open_store.slot_bytes must be an integer, got 4096.0 (float)"),
    (dict(size_bytes=None, slot_bytes=None), "open_store.slot_bytes must be an integer, got None (NoneType)"),
    (dict(ops="c"), "open_store.ops must be 'auto', 'native', 'python' or a slot-ops class, got 'c'"),
    (dict(ops=42), "open_store.ops must be 'auto', 'native', 'python' or a slot-ops class, got 42"),
    (dict(ops=dict), "open_store.ops must be 'auto', 'native', 'python' or a slot-ops class, got <class 'dict'>"),
], ids=["path", "label", "label-long", "label-newline", "threads-str", "threads-0", "budget", "size-negative", "size-str", "slot-float",
        "attach-slot-none", "ops-name", "ops-int", "ops-class"])
def test_open_stores_own_arguments_are_refused_before_any_file(shm_dir, kwargs, refusal):
    """A path that is no path, a label that is no string, a thread count that is no positive
    integer, a budget switch that is no bool (``"no"`` was truthy), sizes that are no positive
    integers - named as the caller named them (the plan called ``size_bytes`` total_bytes) - and
    slot ops that are neither a name nor an ops class (``"python"``'s neighbours failed at the first
    get, deep inside): a PlanError naming it, and no arena file made."""
    import os
    import re

    from hicache.errors import PlanError
    from hicache.store import open_store

    arguments = {"path": str(shm_dir / "arena"), "size_bytes": 1 << 24, "slot_bytes": PAGE, **kwargs}
    with pytest.raises(PlanError, match=re.escape(refusal)):
        open_store(arguments.pop("path"), **arguments)
    assert os.listdir(shm_dir) == []


@pytest.mark.parametrize("name", ["auto", "python", "native"])
def test_open_store_takes_the_slot_ops_by_name(shm_dir, name):
    """``ops="python"`` (or ``"native"``, ``"auto"``) is what `slot_ops` of that name gives - the
    fallback forced by name, as a user reaches for it - for a creator and an attaching engine
    alike, and a page goes round through it; before, the name was taken as the ops themselves and
    the first put failed with an AttributeError from the segment check."""
    import torch

    from hicache.effects import arena
    from hicache.store import open_store

    if name == "native" and _slot_native is None:
        pytest.skip("the C helper was not built here (no compiler): 'native' is its ImportError")
    path = str(shm_dir / "arena")
    page, out = Pages(1, seed=3), Pages(1)
    with open_store(path, size_bytes=1 << 24, slot_bytes=PAGE, ops=name) as store, \
            open_store(path, size_bytes=None, slot_bytes=PAGE, ops=name) as engine:
        assert store.arena.ops is engine.arena.ops is arena.slot_ops(name)
        assert store.put(NS, ["a"], page.segments()) == [True]
        assert engine.get(NS, ["a"], out.segments()) == [True] and torch.equal(out.data, page.data)


@pytest.mark.parametrize("call", ["attach_arena", "create_arena"])
def test_the_arenas_own_calls_refuse_ops_they_cannot_use_before_any_file(shm_dir, call):
    """`attach_arena` and `create_arena` check ``ops`` first, naming the call: a missing file is
    not what they report, and nothing is made."""
    import os

    from hicache.effects import arena
    from hicache.errors import PlanError
    from hicache.plan import plan_store

    path = str(shm_dir / "arena")
    with pytest.raises(PlanError, match=f"{call}.ops must be 'auto', 'native', 'python' or a slot-ops class, got 7"):
        if call == "attach_arena":
            arena.attach_arena(path, page_bytes=PAGE, ops=7)
        else:
            arena.create_arena(path, plan_store(1 << 24, slot_bytes=PAGE), label="t", ops=7)
    assert os.listdir(shm_dir) == []
