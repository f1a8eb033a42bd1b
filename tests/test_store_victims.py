"""Which slot a writer takes (issue #51's write path): the C helper's `victims` and the fallback's
order every window alike - empty, torn, unreferenced by descending depth, referenced by
descending depth - and clear the referenced bits of a window that holds nothing else, checked
against an independent oracle over random index states."""

from __future__ import annotations

import ctypes
import struct

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from hicache.effects._arena import _slots
from hicache.plan._store import RECORD, RECORD_BYTES, REF_OFFSET

OPS = [_slots.PythonSlotOps] + ([_slots.NativeSlotOps] if _slots._native is not None else [])
SLOTS, WINDOW = 40, 16

records = st.lists(
    st.tuples(st.sampled_from(["empty", "nokey", "zerogen", "torn", "page"]), st.integers(0, 3), st.booleans()),
    min_size=SLOTS, max_size=SLOTS)
keys = st.lists(st.binary(min_size=16, max_size=16), min_size=1, max_size=4)


def _index(states) -> ctypes.Array:
    """A fake slot index: each state (kind, depth, referenced) as a packed record - empty (generation
    0, no key), nokey (a generation, no key), zerogen (a key, generation 0), torn (odd) or page. A
    key has one of its halves zero in two slots of three: only all 16 bytes zero is no key."""
    raw = (ctypes.c_char * (SLOTS * RECORD_BYTES))()
    for slot, (kind, depth, ref) in enumerate(states):
        gen = {"empty": 0, "nokey": 4, "zerogen": 0, "torn": 7, "page": 6}[kind]
        key = bytes(16) if kind in ("empty", "nokey") else struct.pack("<QQ", 0 if slot % 3 == 0 else slot + 1,
                                                                       0 if slot % 3 == 1 else 9)
        RECORD.pack_into(raw, slot * RECORD_BYTES, gen, key, 0, 0, 64, depth, 0, int(ref), 0, 0)
    return raw


def _oracle(states, key: bytes) -> tuple[list[int], bool]:
    """The order a writer tries the key's window in, and whether its referenced bits are cleared."""
    home = int.from_bytes(key[:8], "little") % SLOTS
    window = [(home + j) % SLOTS for j in range(WINDOW)]
    kind = {slot: states[slot][0] for slot in window}
    first = [s for s in window if kind[s] in ("empty", "nokey", "zerogen")] + [s for s in window if kind[s] == "torn"]
    pages = [s for s in window if kind[s] == "page"]
    cold = sorted((s for s in pages if not states[s][2]), key=lambda s: (-states[s][1], s))
    warm = sorted((s for s in pages if states[s][2]), key=lambda s: (-states[s][1], s))
    return first + cold + warm, len(warm) == WINDOW


@pytest.mark.parametrize("ops", OPS, ids=lambda ops: ops.name)
@settings(max_examples=150, deadline=None)
@given(states=records, batch=keys)
def test_every_window_is_ordered_as_the_oracle_says(ops, states, batch):
    """For random index states and keys: each key's window in the oracle's order with the
    generations seen, and the referenced bits cleared exactly where a window holds nothing else."""
    index = _index(states)
    base = ctypes.addressof(index)
    slots, gens = ops.victims(base, SLOTS, WINDOW, b"".join(batch))
    cleared = set()
    for i, key in enumerate(batch):
        order, clears = _oracle(states, key)
        assert slots[i * WINDOW:(i + 1) * WINDOW] == order
        assert gens[i * WINDOW:(i + 1) * WINDOW] == [ctypes.c_uint64.from_address(base + s * RECORD_BYTES).value
                                                      for s in order]
        if clears:
            cleared.update(order)
    for slot, (_, _, ref) in enumerate(states):
        assert index[slot * RECORD_BYTES + REF_OFFSET] == (b"\x01" if ref and slot not in cleared else b"\x00")


def test_an_all_referenced_window_loses_its_bits_and_is_then_ordered_by_depth():
    """Sixteen referenced pages: the first look orders them by depth and clears every bit; the
    second sees them unreferenced (CLOCK's hand has passed) - the fallback and the helper alike."""
    for ops in OPS:
        states = [("page", slot % 4, True) for slot in range(SLOTS)]
        index = _index(states)
        key = struct.pack("<QQ", 0, 1)
        first, _ = ops.victims(ctypes.addressof(index), SLOTS, WINDOW, key)
        assert all(index[s * RECORD_BYTES + REF_OFFSET] == b"\x00" for s in range(WINDOW)), ops.name
        again, _ = ops.victims(ctypes.addressof(index), SLOTS, WINDOW, key)
        assert first == again == sorted(range(WINDOW), key=lambda s: (-(s % 4), s)), ops.name


@pytest.mark.parametrize("slots, window", [(64, 64), (100, 64), (1, 1)])
def test_the_widest_window_and_the_smallest_index_are_served(slots, window):
    """A window of 64 slots (the most the C helper orders) and an index of one slot are orders,
    not refusals: over empty slots, the window from the key's home in slot order."""
    raw = (ctypes.c_char * (slots * RECORD_BYTES))()
    key = struct.pack("<QQ", 7, 1)
    home = 7 % slots
    for ops in OPS:
        order, gens = ops.victims(ctypes.addressof(raw), slots, window, key)
        assert order == [(home + j) % slots for j in range(window)] and gens == [0] * window, ops.name
