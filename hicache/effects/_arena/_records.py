"""The words of an attached arena that hold its state: the index's records and the namespace
table, read and written where the store's protocol says (hicache.store orchestrates and never
touches memory itself: issue #55 item 4), and the writer's identity and clock that go into a
record. Addresses come from the arena's mapping and hicache.plan's layout; every read or write
is of one record or one table entry inside it.

Ordering: a record's generation word is read and written through the arena's slot ops
(atomics with the C helper); the fields after it are plain bytes, written only by the writer
that holds the slot's lock with the generation odd, and checked by readers against the
generation before and after.
"""

from __future__ import annotations

import ctypes
import os
import time

from hicache.plan.store_format import NAMESPACE_BYTES, RECORD, RECORD_BYTES

_DIGEST = 16  # a namespace entry starts with its digest; the rest is its description


class Records:
    """The index records and namespace entries of the arena mapped at ``base`` with ``plan``."""

    def __init__(self, base: int, plan) -> None:
        self.base, self.plan = base, plan

    # -- index records ---------------------------------------------------------------------------
    def record(self, slot: int) -> tuple:
        """The slot's record as hicache.plan's RECORD fields (a snapshot: unlocked, it may be torn)."""
        return RECORD.unpack(ctypes.string_at(self.base + self.plan.record_offset(slot), RECORD.size))

    def write_fields(self, slot: int, fields: tuple) -> None:
        """Every field of the slot's record but its generation (the caller holds the slot's lock
        with its generation odd, set through the slot ops)."""
        raw = RECORD.pack(*fields)
        ctypes.memmove(self.base + self.plan.record_offset(slot) + 8, raw[8:], len(raw) - 8)

    def index_words(self, dtype):
        """The index as a [slots, record words] tensor of ``dtype`` over the mapping (valid while
        the arena is attached: the store refuses every call after close)."""
        import torch

        view = (ctypes.c_char * (self.plan.slots * RECORD_BYTES)).from_address(self.base + self.plan.index_offset)
        return torch.frombuffer(view, dtype=dtype).view(self.plan.slots, -1)

    # -- namespace table -------------------------------------------------------------------------
    def _entry_addr(self, entry: int) -> int:
        return self.base + self.plan.namespace_offset + entry * NAMESPACE_BYTES

    def namespace_digest(self, entry: int) -> bytes:
        """The digest entry ``entry`` holds (zeros: free)."""
        return ctypes.string_at(self._entry_addr(entry), _DIGEST)

    def namespace_body(self, entry: int) -> bytes:
        """The entry's description bytes (NUL-padded)."""
        return ctypes.string_at(self._entry_addr(entry) + _DIGEST, NAMESPACE_BYTES - _DIGEST)

    def erase_namespace(self, entry: int) -> None:
        """Free the entry: its digest first (no lookup finds it half-cleared), then its body."""
        addr = self._entry_addr(entry)
        ctypes.memset(addr, 0, _DIGEST)
        ctypes.memset(addr + _DIGEST, 0, NAMESPACE_BYTES - _DIGEST)

    def write_namespace(self, entry: int, digest: bytes, body: bytes) -> None:
        """Fill a free entry: its body first, its digest last (a reader sees it whole)."""
        if len(digest) != _DIGEST or len(body) > NAMESPACE_BYTES - _DIGEST:
            raise ValueError(f"a namespace entry holds a {_DIGEST}-byte digest and at most "
                             f"{NAMESPACE_BYTES - _DIGEST} bytes of description")
        addr = self._entry_addr(entry)
        ctypes.memmove(addr + _DIGEST, body.ljust(NAMESPACE_BYTES - _DIGEST, b"\0"), NAMESPACE_BYTES - _DIGEST)
        ctypes.memmove(addr, digest, _DIGEST)

    # -- who writes, and when --------------------------------------------------------------------
    @staticmethod
    def writer() -> int:
        """This process's id as a record holds it (u32)."""
        return os.getpid() & 0xFFFFFFFF

    @staticmethod
    def now_ns() -> int:
        """The wall clock a record's stamp holds."""
        return time.time_ns()
