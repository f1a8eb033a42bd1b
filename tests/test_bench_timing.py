"""The benchmarks' interleaving (benchmarks/_timing.py): over ``2 * n`` rounds every function
takes every place, and follows every other, equally often - so no row's baseline always runs
in the same place (with three functions, a fixed forward/backward order left one always in the
middle)."""

from __future__ import annotations

import importlib.util
from collections import Counter
from pathlib import Path

from hypothesis import given
from hypothesis import strategies as st

# benchmarks/ is no package: its shared helpers load by path
_SPEC = importlib.util.spec_from_file_location("bench_timing", Path(__file__).resolve().parents[1] / "benchmarks"
                                               / "_timing.py")
_timing = importlib.util.module_from_spec(_SPEC)
_SPEC.loader.exec_module(_timing)
interleaved, round_order = _timing.interleaved, _timing.round_order


@given(st.integers(min_value=1, max_value=6), st.integers(min_value=0, max_value=5))
def test_every_function_takes_every_place_and_follows_every_other_equally(count, cycles):
    """Over any whole number of ``2 * count``-round cycles, each item is at each position, and
    directly after each other item, the same number of times."""
    items = list(range(count))
    rounds = 2 * count * (cycles + 1)
    places, follows = Counter(), Counter()
    for number in range(rounds):
        order = round_order(items, number)
        assert sorted(order) == items
        places.update(enumerate(order))
        follows.update(zip(order, order[1:]))
    assert set(places.values()) == {rounds // count}
    if count > 1:
        assert len(set(follows.values())) == 1 and len(follows) == count * (count - 1)


def test_interleaved_times_every_function_every_round_in_round_order():
    """`interleaved` calls the functions in `round_order` and times each once per round (after
    its warmup), running a returned teardown before the next call."""
    calls, torn = [], []

    def make(name):
        def call():
            calls.append(name)
            return lambda: torn.append(name)
        return call

    times = interleaved({name: make(name) for name in "abc"}, rounds=6, warmup=1)
    assert {name: len(values) for name, values in times.items()} == {"a": 6, "b": 6, "c": 6}
    expected = list("abc") + [name for number in range(6) for name in round_order(list("abc"), number)]
    assert calls == expected and torn == expected
