"""How a writer takes a slot, by the state it finds there - the C helper's `write_pages` and the
fallback's steps alike: an empty slot, a slot with a generation but no key, one with a key but
generation 0, a torn one (a dead writer's, odd) and a live page are each taken, the page reads
back, the slot's new generation is the next even one (past a torn slot's, never back: a reader
holding an old generation must never see it again) and only a live page counts as an eviction. A slot whose generation
moved on since the writer looked is let go, its lock with it."""

from __future__ import annotations

import ctypes
import os
import sys
from array import array

import pytest
from store_support import arena_of, shm_dir  # noqa: F401 - a fixture

from hicache.effects import arena
from hicache.plan.store_format import RECORD_BYTES, REF_OFFSET
from hicache.store import Namespace, open_store
from hicache.store._keys import slot_keys

torch = pytest.importorskip("torch")

#: the C helper itself (its raw calls take buffers the wrappers make for them), where built and current
NATIVE = sys.modules["hicache.effects._arena._slotops"] if arena.slot_ops("auto") is arena.NativeSlotOps else None
OPS = ["python"] + (["native"] if NATIVE is not None else [])
PAGE = 4096
NS = Namespace(model="m", dtype="torch.bfloat16", page_tokens=16, layout="page_first/segments", pool="kv",
               page_bytes=PAGE, shard=(("tp", 0, 1),))
#: an arena of exactly one window of 4 KiB slots (test_store_index's): every key competes for the same 16 slots
ONE_WINDOW = arena_of(16, PAGE)
#: (generation, whether the record keeps its key) the target slot is given; the generation its new page
#: is published with (the next even one - past a torn odd one's own successor, which its dead writer
#: might yet have published); whether taking it evicts a page
STATES = {"empty": (0, False, 2, False), "a generation, no key": (4, False, 6, False),
          "a key, generation 0": (0, True, 2, False), "torn": (7, True, 10, False),
          "torn, long-lived": (2**40 + 1, True, 2**40 + 4, False), "a live page": (6, True, 8, True)}


def _pages(count: int, seed: int):
    return torch.randint(0, 256, (count, PAGE), dtype=torch.uint8, generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("state", sorted(STATES))
@pytest.mark.parametrize("ops", OPS)
def test_a_writer_takes_a_slot_in_each_state_with_the_plans_generation(shm_dir, ops, state):
    """An arena of one window, every slot a referenced page but one put in the state: the next
    key is written there, reads back, the slot's generation is the state's successor, and the put
    counts an eviction exactly when a live page was there."""
    gen, keep_key, published, evicts = STATES[state]
    store = open_store(str(shm_dir / "arena"), size_bytes=ONE_WINDOW, slot_bytes=PAGE, ops=arena.slot_ops(ops))
    try:
        assert store.arena.plan.slots == store.arena.plan.window == 16
        old, new = _pages(16, 1), _pages(1, 2)
        keys = [f"k{i}" for i in range(16)]
        assert store.put(NS, keys, [[(old[i].data_ptr(), PAGE)] for i in range(16)]) == [True] * 16
        assert store.get(NS, keys, [[(old[i].data_ptr(), PAGE)] for i in range(16)]) == [True] * 16  # all referenced
        slot = store.index.find(slot_keys(NS.digest, ["k3"]))[0][0]
        record = store.arena.record_addr(slot)
        ctypes.c_uint64.from_address(record).value = gen
        if not keep_key:
            ctypes.memset(record + 8, 0, 16)
        ctypes.c_uint8.from_address(record + REF_OFFSET).value = 0
        evictions = store.counts.evictions
        assert store.put(NS, ["new"], [[(new[0].data_ptr(), PAGE)]]) == [True]
        assert store.index.find(slot_keys(NS.digest, ["new"]))[0] == [slot]
        assert ctypes.c_uint64.from_address(record).value == published
        assert store.counts.evictions - evictions == int(evicts)
        out = torch.zeros(1, PAGE, dtype=torch.uint8)
        assert store.get(NS, ["new"], [[(out.data_ptr(), PAGE)]]) == [True] and out.equal(new)
        assert store.get(NS, ["k3"], [[(out.data_ptr(), PAGE)]]) == [False]
    finally:
        store.close()


@pytest.mark.skipif(NATIVE is None, reason="the C helper is not built here (no compiler)")
def test_a_slot_that_moved_on_is_let_go_with_its_lock(tmp_path):
    """write_pages given a slot whose generation is no longer the one seen takes nothing, says
    so (status 0, over a caller's buffer that held another value) and leaves the slot's record lock
    free for the next writer; a window of two keys never lends the second key's slot to the first;
    a one-slot index is written."""
    path = tmp_path / "locks"
    path.write_bytes(bytes(4 * RECORD_BYTES))
    fd, other = os.open(path, os.O_RDWR), os.open(path, os.O_RDWR)
    index, page = (ctypes.c_char * (4 * RECORD_BYTES))(), (ctypes.c_char * (4 * 64))()
    at, data = ctypes.addressof(index), ctypes.addressof(page)
    try:
        status = bytearray(b"\xab")
        NATIVE.write_pages(at, data, fd, 0, 4, 1, 64, 64, bytes(16), array("Q", [data]), array("Q", [64]), 1,
                                   array("Q", [2]), array("Q", [6]), array("Q", [0]), 0, 1, 0, status)
        assert list(status) == [0] and ctypes.c_uint64.from_address(at + 2 * RECORD_BYTES).value == 0
        assert arena.try_lock(other, 2 * RECORD_BYTES, RECORD_BYTES), "the let-go slot's lock was kept"
        arena.unlock(other, 2 * RECORD_BYTES, RECORD_BYTES)
        assert arena.try_lock(other, 0, 2 * RECORD_BYTES)  # key 0's window (slots 0, 1) held by another writer
        status = bytearray(2)
        keys = bytes(range(32))
        NATIVE.write_pages(at, data, fd, 0, 4, 2, 64, 64, keys, array("Q", [data, data]),
                                   array("Q", [64, 64]), 1, array("Q", [0, 1, 2, 3]), array("Q", [0] * 4),
                                   array("Q", [0, 0]), 0, 1, 0, status)
        assert list(status) == [0, 1]
        assert ctypes.string_at(at + 2 * RECORD_BYTES + 8, 16) == keys[16:]  # the second key, in its own window
        arena.unlock(other, 0, 2 * RECORD_BYTES)
        status = bytearray(1)  # the smallest index (one slot, a window of one) is written, not refused
        NATIVE.write_pages(at, data, fd, 0, 1, 1, 64, 64, keys[:16], array("Q", [data]), array("Q", [64]), 1,
                                   array("Q", [0]), array("Q", [0]), array("Q", [0]), 0, 1, 0, status)
        assert list(status) == [1] and ctypes.c_uint64.from_address(at).value == 2
    finally:
        os.close(fd)
        os.close(other)
