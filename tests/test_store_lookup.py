"""Which slot a reader finds: the C helper's `lookup` and the fallback's answer alike, against an
independent oracle over random index states - only a slot of the key's own window, holding the
key with an even (published) generation, the first in window order; else not found."""

from __future__ import annotations

import ctypes
import struct
import sys
from array import array

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from hicache.effects import arena
from hicache.plan._store import RECORD, RECORD_BYTES

MISS = sys.modules["hicache.effects._arena._slots"].MISS  # a read's outcome: not held (no face names it)
OPS = [arena.PythonSlotOps] + ([arena.NativeSlotOps] if arena.slot_ops("auto") is arena.NativeSlotOps else [])
SLOTS, WINDOW = 20, 8
#: five keys whose homes are slots 3, 15 (its window wraps), 3 again, 12 and 3 once more - the last
#: the first key but for its 16th byte
KEYS = [struct.pack("<QQ", home, tag) for home, tag in ((3, 1), (SLOTS + 15, 2), (2 * SLOTS + 3, 3), (12, 4),
                                                        (3, 1 | 1 << 56))]

records = st.lists(st.tuples(st.sampled_from([0, 2, 3, 8, 9]), st.integers(0, len(KEYS))),
                   min_size=SLOTS, max_size=SLOTS)  # (generation, key: one of KEYS or, at len(KEYS), none)


def _index(states) -> ctypes.Array:
    raw = (ctypes.c_char * (SLOTS * RECORD_BYTES))()
    for slot, (gen, key) in enumerate(states):
        RECORD.pack_into(raw, slot * RECORD_BYTES, gen, KEYS[key] if key < len(KEYS) else bytes(16), 0, 0, 64, 0, 0, 0,
                         0, 0)
    return raw


def _oracle(states, key: int) -> tuple[int, int]:
    home = int.from_bytes(KEYS[key][:8], "little") % SLOTS
    for slot in ((home + j) % SLOTS for j in range(WINDOW)):
        gen, held = states[slot]
        if gen and gen % 2 == 0 and held == key:
            return slot, gen
    return arena.NOT_FOUND, 0


@pytest.mark.parametrize("ops", OPS, ids=lambda ops: ops.name)
@settings(max_examples=200, deadline=None)
@given(states=records, asked=st.lists(st.integers(0, len(KEYS) - 1), min_size=1, max_size=6))
def test_each_key_is_found_in_its_own_window_published_or_not_at_all(ops, states, asked):
    """For random index states (each key also placed outside its window, unpublished or torn):
    each key asked is found at the oracle's slot with that slot's generation, or not found."""
    index = _index(states)
    found, gens = ops.lookup(ctypes.addressof(index), SLOTS, WINDOW, b"".join(KEYS[k] for k in asked))
    assert list(zip(found, gens)) == [_oracle(states, k) for k in asked]


def test_a_one_slot_index_finds_its_one_key():
    """The smallest index, one slot and a window of one (a plan with ``window=1`` makes it), finds
    the key it holds, and a read of another key there is a miss, not a refusal."""
    page = (ctypes.c_char * 64)()
    for ops in OPS:
        index = (ctypes.c_char * RECORD_BYTES)()
        RECORD.pack_into(index, 0, 4, KEYS[1], 0, 0, 64, 0, 0, 0, 0, 0)
        assert ops.lookup(ctypes.addressof(index), 1, 1, KEYS[1] + KEYS[0]) == ([0, arena.NOT_FOUND], [4, 0]), ops.name
        status, _, _ = ops.read_pages(ctypes.addressof(index), ctypes.addressof(page), 1, 1, 64, 64, KEYS[0],
                                      array("Q", [ctypes.addressof(page)]), array("Q", [64]), 1)
        assert list(status) == [MISS], ops.name


def test_a_key_just_past_its_window_is_not_found():
    """The key published in the slot after its window's last (and every slot of the window
    holding other keys): not found, by either implementation."""
    states = [(2, 3)] * SLOTS
    states[(3 + WINDOW) % SLOTS] = (2, 0)
    for ops in OPS:
        index = _index(states)  # held while the lookup reads it (a temporary's memory is freed before)
        found = ops.lookup(ctypes.addressof(index), SLOTS, WINDOW, KEYS[0])
        assert found == ([arena.NOT_FOUND], [0]), ops.name
