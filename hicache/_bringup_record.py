"""What a bring-up says of itself (issue #34 item 7): `BringupRecord`, a frozen record of its
state, bytes, calls, phase seconds, page tiers and the host's claims - what the metrics show,
as fields, so no reader guesses at a handle's attributes - and `make_record`, the one
derivation of those seconds. `hicache.effects`' handles and the registrations the SGLang seam
hands on (`hicache.metrics`) both make theirs here. A leaf: attrs only (both sides import it).
"""

from __future__ import annotations

import attrs


@attrs.frozen
class BringupRecord:
    """What one bring-up says of itself now (issue #34 item 7): what the metrics show, as fields -
    no reader guesses at a handle's attributes. ``calls``: register calls made; seconds are None
    where a phase did not happen (or, ``register_s`` of a progressive bring-up, the calls so
    far); ``tiers``: ``(buffer, PageTiers)`` as the kernel backs them (empty when not read);
    ``claims``: this host's budget claims ``(pid, bytes)`` as the budget file says;
    ``page_rules``: ``(buffer, rule, bytes)`` - under ``hugepages="auto"``, the bytes each rule of
    `hicache.plan._thp.RULES` decided for each buffer (empty otherwise)."""

    state: str
    total_bytes: int
    registered_bytes: int
    calls: int
    map_s: float | None
    prefault_s: float | None
    register_s: float | None
    ready_s: float | None
    tiers: tuple = ()
    claims: tuple = ()
    page_rules: tuple = ()


def make_record(*, state: str, total_bytes: int, registered_bytes: int, calls, timings: dict, allocator,
                progressive: bool = False, tiers=(), claims=(), page_rules=()) -> BringupRecord:
    """The one derivation of a record's seconds: pre-fault from the handle's timing, else its
    allocator's, else the allocate+pre-fault span; registration from its timing, else (a
    progressive bring-up, whose calls go on after it returned) the seconds of the calls so far."""
    prefault = timings.get("prefault_s") or getattr(allocator, "prefault_s", None) or timings.get("allocate_prefault_s")
    register = timings.get("register_s")
    if register is None and progressive:
        register = sum(call[2] for call in calls) or None
    return BringupRecord(state, total_bytes, registered_bytes, len(calls), getattr(allocator, "allocate_s", None),
                         prefault, register, timings.get("ready_s"), tuple(tiers), tuple(sorted(dict(claims).items())),
                         tuple(page_rules))
