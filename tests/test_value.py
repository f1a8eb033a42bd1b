"""`value_class` (the plan's frozen classes with one shared repr, == and hash) behaves as
attrs's generated methods do: attrs itself is the oracle, over classes with every field option
the shared methods honour (repr=False / callable, eq=False, eq_key, hash=)."""

from __future__ import annotations

import attrs
import pytest
from hypothesis import example, given
from hypothesis import strategies as st

from hicache.plan import PRESETS, Limits, MHALayout, plan_pool
from hicache.plan._value import value_class

#: (name, attrs.field options): one field per option the shared methods must honour
FIELDS = {
    "plain": {},
    "hidden": {"repr": False},
    "shown_by": {"repr": lambda v: f"<{v}>"},
    "ignored": {"eq": False},
    "folded": {"eq": str.lower},
    "unhashed": {"hash": False},
    "defaulted": {"default": 0},
}
NAMES = list(FIELDS)


def _twins(names: list[str], **options):
    """The same class made twice: by attrs.frozen (the oracle) and by value_class."""
    def make(decorate):
        body = {name: attrs.field(**FIELDS[name]) for name in names}
        return decorate(type("Twin", (), body))
    return make(lambda c: attrs.frozen(c, **options)), make(lambda c: value_class(c, **options))


def _values(name: str):
    return st.sampled_from(["a", "A", "b"]) if name == "folded" else st.integers(-2, 2)


@st.composite
def _case(draw):
    names = draw(st.lists(st.sampled_from(NAMES), unique=True, max_size=len(NAMES)))
    names.sort(key=lambda name: name == "defaulted")  # a defaulted field goes last, as attrs requires
    one = {name: draw(_values(name)) for name in names}
    two = {name: draw(st.just(value) | _values(name)) for name, value in one.items()}  # often equal
    return names, (one, two)


@given(_case())
@example((["folded"], ({"folded": "a"}, {"folded": "A"})))  # equal through its eq_key only
@example((["unhashed", "ignored"], ({"unhashed": 1, "ignored": 1}, {"unhashed": 1, "ignored": 2})))
def test_repr_eq_and_hash_agree_with_attrs_own_for_any_fields_and_values(case):
    """For any set of field options and any two instances, value_class's repr is attrs's text,
    == and != give attrs's answers, and equal instances hash equal."""
    names, (one, two) = case
    oracle, shared = _twins(names)
    a, b = oracle(**one), oracle(**two)
    x, y = shared(**one), shared(**two)
    assert repr(x) == repr(a) and repr(y) == repr(b)
    assert (x == y) == (a == b) and (x != y) == (a != b) and (x == x) is True
    if x == y:
        assert hash(x) == hash(y)
    assert {x, y} == ({x} if a == b else {x, y})


def test_another_class_with_equal_fields_is_not_equal_and_a_subclass_neither():
    """== is NotImplemented across classes, as attrs's: a subclass's equal-looking instance,
    another class with the same fields, and a tuple of the values are all unequal."""
    _, shared = _twins(["plain"])
    _, other = _twins(["plain"])
    sub = value_class(type("Sub", (shared,), {}))
    assert shared(1) != other(1) and shared(1) != sub(1) and sub(1) != shared(1) and shared(1) != (1,)
    assert shared(1).__eq__(other(1)) is NotImplemented
    assert sub(1) == sub(1) and hash(sub(1)) == hash(sub(1))


def test_options_pass_through_and_a_class_keeps_its_own_repr():
    """kw_only (the options attrs.frozen takes) still applies, instances stay frozen, and a class
    that writes its own __repr__ keeps it."""
    _, shared = _twins(["plain"], kw_only=True)
    with pytest.raises(TypeError):
        shared(1)
    with pytest.raises(attrs.exceptions.FrozenInstanceError):
        shared(plain=1).plain = 2

    @value_class
    class Named:
        x: int

        def __repr__(self) -> str:
            return "mine"

    assert repr(Named(1)) == "mine" and Named(1) == Named(1)


def test_the_plans_own_values_read_as_attrs_would_write_them():
    """The real plan classes: a layout's, limits' and a pool plan's repr is attrs's spelling, an
    evolved copy compares and hashes by its fields, and a model with an unhashed dict hashes."""
    layout = MHALayout("page_first", layer_num=2, head_num=2, head_dim=64, page_size=4, page_num=8, itemsize=2)
    assert repr(layout) == ("MHALayout(layout='page_first', layer_num=2, head_num=2, head_dim=64, page_size=4, "
                            "page_num=8, itemsize=2)")
    assert attrs.evolve(layout, page_num=8) == layout and attrs.evolve(layout, page_num=9) != layout
    assert hash(attrs.evolve(layout)) == hash(layout)
    limits = Limits(chunk_limit_bytes=2**20)
    assert repr(limits).startswith("Limits(chunk_limit_bytes=1048576, ")
    assert plan_pool(layout, limits) == plan_pool(layout, limits)
    assert len({plan_pool(layout, limits), plan_pool(layout, limits)}) == 1
    model = next(iter(PRESETS.values()))
    assert isinstance(model.facts, dict) and hash(model) == hash(attrs.evolve(model))
