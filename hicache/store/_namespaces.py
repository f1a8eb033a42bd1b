"""The node store's namespace table (256 entries in the arena): claiming an entry for a
namespace, holding it while pages go under it, freeing it when its last page has gone. Part of
`SlotIndex` (whose arena, records, plan, columns and writer mutex it uses); its record format
is hicache.plan's, its memory and locks hicache.effects' arena room's.

An entry is held while its namespace has pages: a writer holds it shared (an OFD read lock,
counted across this process's threads) from its check of the entry's digest to its last
publish; freeing takes it exclusively and re-counts the entry's slots under that lock, so a
page is never filed under a freed entry (issue #51).
"""

from __future__ import annotations

from hicache.effects import arena as _arena
from hicache.errors import NamespaceTableFullError
from hicache.plan.store_format import NAMESPACE_BYTES, NAMESPACE_ENTRIES
from hicache.store._keys import DIGEST_BYTES

ZERO_KEY = bytes(DIGEST_BYTES)
NO_NAMESPACE = 0xFFFF
BUSY = -1  # register_namespace: the entry is being freed by another process at every look


class NamespaceEntries:
    """The namespace-table half of `SlotIndex`."""

    def _namespace_range(self, entry: int) -> tuple[int, int]:
        return self.plan.namespace_offset + entry * NAMESPACE_BYTES, NAMESPACE_BYTES

    def entry_of(self, digest: bytes) -> int:
        """The table entry holding ``digest`` now, or `NO_NAMESPACE` (a lookup: claims nothing)."""
        for entry in range(NAMESPACE_ENTRIES):
            if self.records.namespace_digest(entry) == digest:
                return entry
        return NO_NAMESPACE

    def hold_entry(self, entry: int, digest: bytes) -> bool:
        """Hold ``entry`` shared while writing pages under it: True when it still holds
        ``digest`` (release with `release_entry`), False when it was freed or reused meanwhile.
        One OFD lock serves this process's threads (it is the file's, not a thread's): a count
        says when the last of them lets it go, and this process frees no entry it holds."""
        with self._holding:
            if not self._held.get(entry) and not _arena.try_read_lock(self.arena.fd, *self._namespace_range(entry)):
                return False  # another process is freeing it right now
            self._held[entry] = self._held.get(entry, 0) + 1
        if self.records.namespace_digest(entry) == digest:
            return True
        self.release_entry(entry)
        return False

    def release_entry(self, entry: int) -> None:
        with self._holding:
            self._held[entry] -= 1
            if not self._held[entry]:
                del self._held[entry]
                _arena.unlock(self.arena.fd, *self._namespace_range(entry))

    def register_namespace(self, digest: bytes, description: str) -> int:
        """The namespace table entry for ``digest``, claimed when new, and held (as `hold_entry`:
        release it with `release_entry`) - claimed and held in one step, so a peer's clear()
        cannot free it between the two (a writer racing a clearing loop lost three times in a
        row); when the table is full, entries without a page are freed first. `BUSY` when
        another process was freeing the entry at each of 8 looks (nothing is held then).
        `NamespaceTableFullError` when every entry holds pages (or is being written or claimed by
        another process right now)."""
        raw = description.encode()[:NAMESPACE_BYTES - DIGEST_BYTES]
        with self._writing:
            entry = self._register(digest, raw)
            if entry == BUSY:
                return BUSY
            if entry == NO_NAMESPACE and self.free_entries():
                entry = self._register(digest, raw)
        if entry == NO_NAMESPACE:
            raise NamespaceTableFullError(
                f"node store {self.arena.path}: all {NAMESPACE_ENTRIES} namespace entries hold pages; a page of "
                f"{description!r} is not stored (clear() an engine's namespaces, or drop and recreate the arena)"
            )
        return entry

    def _slots_of(self, entries):
        """Per entry of ``entries``, how many slots name it with a key (published, or torn)."""
        import torch

        columns = self._columns()
        named = (columns[:, 1] != 0) | (columns[:, 2] != 0)
        wanted = torch.tensor(sorted(entries), dtype=torch.int64)
        ns = columns[:, 6][named] & 0xFFFF
        return (ns.unsqueeze(1) == wanted.unsqueeze(0)).sum(dim=0)

    def free_entries(self, entries=None) -> int:
        """Free the table entries (default: all) that no slot names and no writer holds; returns
        how many. Each is re-counted under its exclusive lock, then its digest zeroed first."""
        held = [e for e in (range(NAMESPACE_ENTRIES) if entries is None else entries) if e != NO_NAMESPACE
                and self.records.namespace_digest(e) != ZERO_KEY]
        if not held:
            return 0
        empty = [e for e, count in zip(sorted(held), self._slots_of(held).tolist()) if not count]
        freed = 0
        for entry in empty:
            with self._holding:  # all along: a writer of this process holds no entry half-freed
                if entry in self._held or not _arena.try_lock(self.arena.fd, *self._namespace_range(entry)):
                    continue  # a writer holds it, here or elsewhere (or another process frees it)
                try:
                    if int(self._slots_of([entry])[0]):
                        continue  # pages landed under it since the count
                    self.records.erase_namespace(entry)  # its digest first: no lookup finds it half-cleared
                    freed += 1
                finally:
                    _arena.unlock(self.arena.fd, *self._namespace_range(entry))
        return freed

    def _register(self, digest: bytes, raw: bytes) -> int:
        """The entry holding ``digest`` (held), or a free one claimed for it (held), or
        `NO_NAMESPACE` (the table is full). An entry another process is freeing right now sends
        the scan round again, 8 times at most: then `BUSY` (a peer clearing in a loop holds it
        most of the time; the writer does not wait for it)."""
        for _ in range(8):
            entry, retry = self._scan(digest, raw)
            if not retry:
                return entry
        return BUSY

    def _scan(self, digest: bytes, raw: bytes) -> tuple[int, bool]:
        for entry in range(NAMESPACE_ENTRIES):
            held = self.records.namespace_digest(entry)
            if held == digest:
                return (entry, False) if self.hold_entry(entry, digest) else (NO_NAMESPACE, True)
            if held != ZERO_KEY:
                continue
            offset, length = self._namespace_range(entry)
            if not _arena.try_lock(self.arena.fd, offset, length):
                continue
            kept = False
            try:
                if self.records.namespace_digest(entry) != ZERO_KEY:
                    continue
                claimed = self.entry_of(digest)
                if claimed != NO_NAMESPACE:  # another process claimed it in a later entry meanwhile
                    return (claimed, False) if self.hold_entry(claimed, digest) else (NO_NAMESPACE, True)
                self.records.write_namespace(entry, digest, raw)  # its digest last: a reader sees it whole
                with self._holding:  # the exclusive lock becomes the shared hold in one step (a lock
                    kept = _arena.try_read_lock(self.arena.fd, offset, length)  # conversion: never unlocked)
                    if kept:
                        self._held[entry] = self._held.get(entry, 0) + 1
                return (entry, False) if kept else (NO_NAMESPACE, True)
            finally:
                if not kept:
                    _arena.unlock(self.arena.fd, offset, length)
        return NO_NAMESPACE, False

    def namespaces(self) -> dict[int, str]:
        out = {}
        for entry in range(NAMESPACE_ENTRIES):
            if self.records.namespace_digest(entry) != ZERO_KEY:
                raw = self.records.namespace_body(entry)
                out[entry] = raw.rstrip(b"\0").decode(errors="replace")
        return out
