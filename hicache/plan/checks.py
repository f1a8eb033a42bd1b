"""The one home of value checks (public: ``hicache.plan.checks``): integers that are really
integers, real numbers that are really finite numbers, in range - for the pure core and every
layer above it (issue #34: the integer check was written eight times).

Owns what counts (a bool is not an integer or a number, ``4096.0`` is not an integer, numpy's
and torch's integers are) and the wording of "bad field" errors, so every check names the
field and the value the same way. ``tests/test_import_rules.py`` refuses a hand-written
``isinstance(x, bool)`` check anywhere outside ``hicache/plan/``. Pure: the standard library only.
"""

from __future__ import annotations

import math
import numbers
import operator

MAX_BYTES = 2**63 - 1  # sizes are signed 64-bit on every CUDA and OS interface we call


def check_int(
    error: type[Exception],
    owner: str,
    field: str,
    value: object,
    *,
    minimum: int = 1,
    maximum: int = MAX_BYTES,
) -> int:
    """Return ``value`` as a plain int, or raise ``error`` naming ``owner.field`` and the value.

    Booleans and floats are refused (``True`` is not a size, ``4096.0`` is a typo); anything
    with ``__index__`` (numpy integers) is accepted.
    """
    if not is_integer(value):
        raise error(f"{owner + '.' if owner else ''}{field} must be an integer, got {value!r} ({type(value).__name__})")
    number = operator.index(value)
    if number < minimum:
        bound = "positive" if minimum == 1 else f">= {minimum}"
        raise error(f"{owner + '.' if owner else ''}{field} must be {bound}, got {number}")
    if number > maximum:
        raise error(f"{owner + '.' if owner else ''}{field} must be <= {maximum}, got {number}")
    return number


def is_integer(value: object) -> bool:
    """Whether ``value`` is an integer: anything with ``__index__`` (numpy, a 0-d integer
    tensor), never a bool or a float."""
    return not isinstance(value, bool) and hasattr(type(value), "__index__")


def check_bool(error: type[Exception], owner: str, field: str, value: object) -> bool:
    """Return ``value`` as a bool, or raise ``error`` naming ``owner.field`` and the value: True or
    False (numpy's bool too), never a string or a number ("no" is truthy, 0 a typo)."""
    if isinstance(value, bool) or (type(value).__module__ == "numpy" and type(value).__name__ in ("bool", "bool_")):
        return bool(value)
    raise error(f"{owner + '.' if owner else ''}{field} must be True or False, got {value!r}")


def is_real(value: object) -> bool:
    """Whether ``value`` is a real number (numpy's included), never a bool or a string."""
    return not isinstance(value, bool) and isinstance(value, numbers.Real)


def check_real(error: type[Exception], owner: str, field: str, value: object, *, above: float | None = None,
               minimum: float | None = None, maximum: float | None = None, finite: bool = True,
               what: str = "a number") -> float:
    """Return ``value`` as a float, or raise ``error`` naming ``owner.field`` and the value: a
    real number (not a bool), finite unless ``finite=False``, ``> above``, ``>= minimum``,
    ``<= maximum``. ``what`` says what it is in the message ("a number of seconds")."""
    name = f"{owner}.{field}" if owner else field
    if not is_real(value):
        raise error(f"{name} must be {what}, got {value!r}")
    number = float(value)
    if finite and not math.isfinite(number):
        finite_what = what if "finite" in what else "a finite " + what.removeprefix("a ")
        raise error(f"{name} must be {finite_what}, got {value!r}")
    if above is not None and not number > above:
        raise error(f"{name} must be {what} over {above:g}, got {value!r}")
    if minimum is not None and not number >= minimum:
        raise error(f"{name} must be {what} >= {minimum:g}, got {value!r}")
    if maximum is not None and not number <= maximum:
        raise error(f"{name} must be {what} <= {maximum:g}, got {value!r}")
    return number


def as_int(value: object) -> object:
    """attrs converter: anything with ``__index__`` (numpy integers) becomes a plain Python int,
    so later arithmetic cannot wrap at 32 or 64 bits; anything else is left for the validator
    to refuse (booleans included)."""
    if type(value) is int or isinstance(value, bool):
        return value
    if hasattr(type(value), "__index__"):
        return operator.index(value)
    return value


def check_power_of_two(error: type[Exception], owner: str, field: str, value: object) -> int:
    """Return ``value`` if it is a positive power of two, else raise ``error`` naming it."""
    number = check_int(error, owner, field, value)
    if number & (number - 1):
        raise error(f"{owner}.{field} must be a power of two, got {number}")
    return number


def check_name(error: type[Exception], owner: str, field: str, value: object, known) -> str:
    """Return ``value`` if it is one of ``known``, else raise ``error`` listing them."""
    if not isinstance(value, str) or value not in known:
        raise error(
            f"{owner}.{field} must be one of {', '.join(sorted(known))}; got {value!r}"
        )
    return value


def as_tuple(value) -> tuple:
    """attrs converter to a tuple. A Python function on purpose: attrs inspects a converter's
    signature, and for the builtin ``tuple`` that costs ~5 ms of tokenizing at import."""
    return tuple(value)
