"""The slots a host pool hands out, in one place (issue #34 item 4: one allocator-only pool):
SGLang's controller calls `alloc`, `free`, `clear` and `available_size` under the pool's lock over
a `PageAllocator`. `LogicalHostPool` (DeepSeek-V4's memoryless anchor) is this and no more; every
`HostKVCache` - an ``is_dummy`` one too, which holds no memory - is this over its checked
allocator (`_slot_allocator`). Imports only the page allocator's type.
"""

from __future__ import annotations

from hicache.pools._page_allocator import PageAllocator


class SlotsMixin:
    """SGLang's slot calls over ``self._slot_allocator()`` under ``self.lock`` (an RLock)."""

    #: the pool's live state this part reads (tests/test_import_rules.py)
    NEEDS = ("_pages", "lock")

    def _slot_allocator(self) -> PageAllocator:
        return self._pages

    def alloc(self, need_size: int):
        """``need_size`` token slots (a multiple of page_size) as an int64 tensor, or None when short."""
        with self.lock:
            return self._slot_allocator().alloc(need_size)

    def free(self, indices) -> int:
        """Return slots; double frees and unaligned runs raise."""
        with self.lock:
            return self._slot_allocator().free(indices)

    def clear(self) -> None:
        """Every page free again."""
        with self.lock:
            self._slot_allocator().clear()

    def available_size(self) -> int:
        """Free token slots, exactly."""
        with self.lock:
            return self._slot_allocator().available_size()
