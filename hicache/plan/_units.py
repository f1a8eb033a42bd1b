"""Byte sizes at the edges: parse "64GiB" / "512MiB" / "2GB" / "4096", print 1.5 GiB.

Owns the one spelling of human units: GiB = 2**30 (binary), GB = 10**9 (decimal), and every
message says which. Pure: standard library and hicache.errors only.
"""

from __future__ import annotations

import re
from decimal import Decimal

from hicache.errors import PlanError

_UNITS = {
    "": 1,
    "b": 1,
    "kib": 2**10,
    "mib": 2**20,
    "gib": 2**30,
    "tib": 2**40,
    "pib": 2**50,
    "kb": 10**3,
    "mb": 10**6,
    "gb": 10**9,
    "tb": 10**12,
    "pb": 10**15,
}
#: ASCII digits only: ``\d`` also matches "١٢" (Arabic-Indic), which int() and Decimal() then read
#: as 12 - no operator meant that (issue #33). Compiled on first use (start-up time).
_SIZE = r"(?a)^\s*([0-9]+(?:\.[0-9]+)?)\s*([a-zA-Z]*)\s*$"


def parse_size(text: str, *, what: str = "size", minimum: int = 1) -> int:
    """Parse a byte size such as ``64GiB``, ``512MiB``, ``2GB`` or ``4096`` into an int.

    Binary units (KiB, MiB, GiB, TiB) are powers of 1024, decimal ones (KB, MB, GB, TB) powers
    of 1000. A fractional size must come out a whole number of bytes. Raises ``PlanError``
    naming ``what`` and the text for anything else (``12XB``, ``-1``, ``0`` below ``minimum``).
    """
    match = re.match(_SIZE, text) if isinstance(text, str) else None
    if match is None:
        raise PlanError(f"{what}: cannot read {text!r} as a size (examples: 64GiB, 512MiB, 4096)")
    number, unit = match.groups()
    if unit.lower() not in _UNITS:
        raise PlanError(
            f"{what}: unknown unit {unit!r} in {text!r} (use B, KiB, MiB, GiB, TiB, KB, MB, GB, TB)"
        )
    exact = Decimal(number) * _UNITS[unit.lower()]
    if exact != exact.to_integral_value():
        raise PlanError(f"{what}: {text!r} is not a whole number of bytes")
    value = int(exact)
    if value < minimum:
        raise PlanError(f"{what}: {text!r} must be at least {minimum} bytes")
    if value >= 2**63:
        raise PlanError(f"{what}: {text!r} is larger than 2**63 - 1 bytes")
    return value


def format_bytes(nbytes: int) -> str:
    """Binary units for people: ``1.50 GiB``; exact byte counts below 1 KiB."""
    if nbytes < 1024:
        return f"{nbytes} B"
    for unit, scale in (("PiB", 2**50), ("TiB", 2**40), ("GiB", 2**30), ("MiB", 2**20)):
        if nbytes >= scale:
            break
    else:
        unit, scale = "KiB", 2**10
    value = nbytes / scale
    text = f"{value:.2f}"
    if float(text) == round(value) and nbytes % scale:  # never round 1.998 up to a whole "2"
        text = f"{value:.3f}"
    text = text.rstrip("0").rstrip(".")
    return f"{text} {unit}"


def format_progress(verb: str, done: int, total: int, elapsed_s: float) -> str:
    """One phase of a bring-up for people: ``registered 1 GiB / 2 GiB (50 %) 1.07 GB/s ETA 1 s``
    (rate in decimal GB/s; ETA at the rate so far, ``?`` before there is one)."""
    share = 100.0 * done / total if total else 100.0
    rate = done / elapsed_s if elapsed_s > 0 else 0.0
    eta = f"{max(0.0, (total - done) / rate):.0f} s" if done > 0 and rate > 0 else "?"
    return f"{verb} {format_bytes(done)} / {format_bytes(total)} ({share:.0f} %) {rate / 1e9:.2f} GB/s ETA {eta}"


def format_gb(nbytes: int) -> str:
    """Decimal gigabytes (10**9), as SGLang's --hicache-size counts: ``85.9 GB``."""
    return f"{nbytes / 1e9:.1f} GB"
