"""Field checks shared by the pure core: integers that are really integers, in range.

Owns the wording of "bad field" errors so every descriptor names the field and the value the
same way. Pure: imports only the standard library and hicache.errors.
"""

from __future__ import annotations

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
    if isinstance(value, bool) or not hasattr(type(value), "__index__"):
        raise error(f"{owner}.{field} must be an integer, got {value!r} ({type(value).__name__})")
    number = operator.index(value)
    if number < minimum:
        bound = "positive" if minimum == 1 else f">= {minimum}"
        raise error(f"{owner}.{field} must be {bound}, got {number}")
    if number > maximum:
        raise error(f"{owner}.{field} must be <= {maximum}, got {number}")
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
