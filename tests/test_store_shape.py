"""The node store as a sans-I/O pair (issue #55 item 4): hicache/store orchestrates - it imports
no ctypes, mmap, time or os and reads no clock - while every memory word, lock, clock and copy
lives in hicache.effects' arena room and the slot policy (window, generations, victim order) is
pure in hicache.plan, whose laws are checked here."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from hicache.plan import (
    SlotView,
    claimed_generation,
    home_slot,
    published_generation,
    reclaimed_generation,
    victim_order,
    window_of,
)

STORE = Path(__file__).resolve().parents[1] / "hicache" / "store"
#: the effects the store leaves to the arena room: memory, the clock, the process
EFFECT_MODULES = {"ctypes", "mmap", "time", "os", "fcntl"}


def _effects_used(source: str) -> list[tuple[int, str]]:
    """(line, module) of each import of an effect module in ``source``."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            found += [(node.lineno, a.name) for a in node.names if a.name.split(".")[0] in EFFECT_MODULES]
        elif isinstance(node, ast.ImportFrom) and not node.level and (node.module or "").split(".")[0] in EFFECT_MODULES:
            found.append((node.lineno, node.module))
    return found


@pytest.mark.parametrize("path", sorted(STORE.glob("*.py")), ids=lambda p: p.name)
def test_the_store_touches_no_memory_clock_or_process_itself(path):
    """No module of hicache/store imports ctypes, mmap, time, os or fcntl: its records, table,
    locks, writer id and clock are the arena room's (`Arena.records`, the slot ops)."""
    assert not _effects_used(path.read_text()), f"{path.name} imports {_effects_used(path.read_text())}"


def test_the_store_rule_sees_an_effect():
    """Not vacuous: the arena room's own records module is found to import ctypes, os and time."""
    records = Path(__file__).resolve().parents[1] / "hicache" / "effects" / "_arena" / "_records.py"
    assert {name for _, name in _effects_used(records.read_text())} >= {"ctypes", "os", "time"}


@given(st.integers(0, 2**62))
def test_a_generation_only_grows_and_is_odd_exactly_while_a_writer_has_the_slot(gen):
    """A claim makes any generation odd and larger; its publish even and larger still; a
    reclaim holds it odd (never smaller) and publishes it even; publishing an even one is refused."""
    odd = claimed_generation(gen)
    assert odd % 2 == 1 and odd > gen
    assert published_generation(odd) % 2 == 0 and published_generation(odd) > odd
    held = reclaimed_generation(gen)
    assert held % 2 == 1 and held >= gen and published_generation(held) > gen
    with pytest.raises(ValueError, match="odd"):
        published_generation(odd + 1)


@given(st.binary(min_size=16, max_size=16), st.integers(1, 1000), st.integers(1, 64))
def test_a_window_is_consecutive_slots_from_the_keys_home(key, slots, window):
    """A key's window starts at its home (its first little-endian word mod the slot count) and
    walks consecutive slots, wrapping: the slots the C helper's lookup scans."""
    got = window_of(key, slots, window)
    assert got[0] == home_slot(key, slots) == int.from_bytes(key[:8], "little") % slots
    assert all(b == (a + 1) % slots for a, b in zip(got, got[1:])) and len(got) == window


views = st.lists(st.builds(SlotView, slot=st.integers(0, 99), gen=st.integers(0, 50), empty=st.booleans(),
                           referenced=st.booleans(), depth=st.integers(0, 5)),
                 max_size=16, unique_by=lambda v: v.slot)


@given(views)
def test_the_victim_order_tries_empty_torn_cold_then_warm_slots(window):
    """Every slot once, with the generation it was seen with: empty ones (never written or no
    key) and torn ones in window order, then unreferenced and referenced pages each deepest
    first; the hand passes exactly when every slot holds a referenced page."""
    order, spent = victim_order(window)
    assert sorted(order) == sorted((v.slot, v.gen) for v in window)
    kind = {v.slot: ("empty" if v.gen == 0 or v.empty else "torn" if v.gen % 2 else
                     "warm" if v.referenced else "cold") for v in window}
    rank = {"empty": 0, "torn": 1, "cold": 2, "warm": 3}
    ranks = [rank[kind[slot]] for slot, _ in order]
    assert ranks == sorted(ranks)
    position = {v.slot: i for i, v in enumerate(window)}
    depth = {v.slot: v.depth for v in window}
    for (a, _), (b, _) in zip(order, order[1:]):
        if kind[a] == kind[b] in ("empty", "torn"):
            assert position[a] < position[b]
        elif kind[a] == kind[b]:
            assert (-depth[a], a) < (-depth[b], b)
    assert spent == (bool(window) and all(kind[v.slot] == "warm" for v in window))
