"""The node store's slot policy, pure: which slots a key may live in, the order a writer tries
them, and how a slot's generation moves (issue #55 item 4: the store as a sans-I/O pair - these
rules here, every memory word, lock, clock and copy in hicache.effects' arena room, and
hicache.store orchestrating the two). The C helper (`victims`, `write_pages`) runs the same rules
at memory speed; the suite holds it to them through the fallback, which calls these.

A generation is even while a slot is stable (0: never written) and odd while a writer has it
(or after a writer died with it): a claim makes it odd, a publish or a reclaim makes it even
again, and it only ever grows, so a reader that saw one generation before its copy and the same
one after knows no writer touched the slot in between.
"""

from __future__ import annotations

from typing import NamedTuple


def home_slot(key: bytes, slots: int) -> int:
    """The first slot of a 16-byte slot key's window: its first little-endian u64 mod ``slots``."""
    return int.from_bytes(key[:8], "little") % slots


def window_of(key: bytes, slots: int, window: int) -> list[int]:
    """The slots a key may live in, in window order (wrapping past the last slot)."""
    home = home_slot(key, slots)
    return [(home + j) % slots for j in range(window)]


def claimed_generation(gen: int) -> int:
    """The odd generation a writer gives a slot it claims: past an odd (torn) one, never back."""
    return gen + 1 if gen % 2 == 0 else gen + 2


def published_generation(odd: int) -> int:
    """The even generation a writer publishes its page with."""
    if not odd % 2:
        raise ValueError(f"a slot is published from the odd generation its writer claimed, got {odd}")
    return odd + 1


def reclaimed_generation(gen: int) -> int:
    """The odd generation a reclaimer holds a slot at while it empties it (then publishes it)."""
    return gen + 1 if gen % 2 == 0 else gen


class SlotView(NamedTuple):
    """One slot of a window as a writer saw it, unlocked: its generation, whether it holds no
    key, its CLOCK referenced bit and its page's chain depth."""

    slot: int
    gen: int
    empty: bool
    referenced: bool
    depth: int


def victim_order(views: list[SlotView]) -> tuple[list[tuple[int, int]], bool]:
    """The order a writer tries a window's slots, each with the generation it was seen with:
    empty (never written, or holding no key), then torn (odd: a dead writer's - its lock will be
    free), both in window order, then unreferenced pages and then referenced ones, each by
    descending chain depth (a chain's tail goes first: its leading pages keep their hits), then
    slot. Second: whether every slot held a referenced page - CLOCK's hand passing, their second
    chance spent: the caller clears their referenced bits."""
    empty = [(v.slot, v.gen) for v in views if v.gen == 0 or v.empty]
    torn = [(v.slot, v.gen) for v in views if not (v.gen == 0 or v.empty) and v.gen & 1]
    pages = [v for v in views if not (v.gen == 0 or v.empty) and not v.gen & 1]
    cold = sorted((v for v in pages if not v.referenced), key=lambda v: (-v.depth, v.slot))
    warm = sorted((v for v in pages if v.referenced), key=lambda v: (-v.depth, v.slot))
    order = empty + torn + [(v.slot, v.gen) for v in cold] + [(v.slot, v.gen) for v in warm]
    return order, bool(views) and len(warm) == len(views)
