"""`value_class`: the pure core's frozen attrs classes, with one shared repr, == and hash.

attrs writes and compiles a ``__repr__``, an ``__eq__`` and a ``__hash__`` for every class it
decorates: about two thirds of the ~0.5 ms each class costs at import, and `hicache plan`
builds eleven - most of hicache's own part of its start-up (issue #35 item 4: <= 1.5x
`import attrs`). `value_class` is `attrs.frozen` with those three written once, here, and
behaving as attrs's do: the repr ``Name(field=value, ...)`` over the fields attrs would show
(``repr=False`` / ``repr=callable`` honoured); equal when of the very same class with equal
fields in order (``eq=False`` / ``eq_key`` honoured), else NotImplemented; a hash consistent
with that (``hash=`` honoured). A class's own ``__repr__`` stays. Left out: attrs's guard for a
value that contains itself (plan values are trees). tests/test_value.py holds them to attrs's.
Pure: attrs and the standard library only.
"""

from __future__ import annotations

import operator
from typing import TYPE_CHECKING, Any, Callable, TypeVar, overload

import attrs

if TYPE_CHECKING:
    from typing_extensions import dataclass_transform
else:
    def dataclass_transform(**_options):
        """Read by type checkers only (PEP 681); Python 3.10's typing has no such name."""
        return lambda function: function

_SHAPES: dict = {}  # class -> _Shape, made on first use (not at import: that is the cost saved)


_C = TypeVar("_C", bound=type)


# Both forms typed (``@value_class`` and ``@value_class(kw_only=True)``): pyright applies the
# transform below to a decorator factory's call only when its overloads say what it returns
@overload
def value_class(maybe_cls: _C, /) -> _C: ...
@overload
def value_class(maybe_cls: None = None, /, **options: Any) -> Callable[[_C], _C]: ...


# PEP 681: type checkers (mypy, pyright) see a value class's fields and its keyword
# constructor, as they do attrs.frozen's - without it every field reads as unknown to importers
@dataclass_transform(frozen_default=True, field_specifiers=(attrs.field,))
def value_class(maybe_cls=None, /, **options):
    """``attrs.frozen(maybe_cls, **options)``, its repr, == and hash shared (see the charter)."""

    def wrap(cls):
        cls.__eq__, cls.__hash__ = _eq, _hash
        if "__repr__" not in vars(cls):
            cls.__repr__ = _repr
        return attrs.frozen(cls, repr=False, eq=False, **options)

    return wrap if maybe_cls is None else wrap(maybe_cls)


def _getter(names, keys):
    """A function from an instance to the tuple of those fields (through their eq_key, if any)."""
    if any(keys):
        pairs = tuple(zip(names, keys))
        return lambda instance: tuple(
            key(getattr(instance, name)) if key else getattr(instance, name) for name, key in pairs)
    if len(names) > 1:
        return operator.attrgetter(*names)  # already a tuple, at C speed
    if names:
        one = operator.attrgetter(names[0])
        return lambda instance: (one(instance),)
    return lambda instance: ()


class _Shape:
    """What the three methods read of one class's fields."""

    __slots__ = ("shown", "compared", "hashed", "name")

    def __init__(self, cls) -> None:
        fields = attrs.fields(cls)
        self.name = cls.__qualname__.rsplit(">.", 1)[-1]  # attrs's own spelling of the class
        self.shown = tuple((f.name, f.repr if callable(f.repr) else repr) for f in fields if f.repr)
        compared = [f for f in fields if f.eq]
        self.compared = _getter([f.name for f in compared], [f.eq_key for f in compared])
        hashed = [f for f in fields if (f.eq if f.hash is None else f.hash)]
        self.hashed = _getter([f.name for f in hashed], [f.eq_key for f in hashed])


def _shape(cls) -> _Shape:
    shape = _SHAPES.get(cls)
    if shape is None:
        shape = _SHAPES[cls] = _Shape(cls)
    return shape


def _repr(self) -> str:
    shape = _shape(self.__class__)
    shown = ", ".join(f"{name}={show(getattr(self, name))}" for name, show in shape.shown)
    return f"{shape.name}({shown})"


def _eq(self, other):
    if other.__class__ is not self.__class__:
        return NotImplemented
    compared = _shape(self.__class__).compared
    return compared(self) == compared(other)


def _hash(self) -> int:
    return hash((self.__class__, _shape(self.__class__).hashed(self)))
