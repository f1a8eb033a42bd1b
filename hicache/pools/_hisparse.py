"""`HiSparseHostPoolMixin`: per-request host slot rows that grow by whole pages.

Owns SGLang's HiSparse helpers on top of a pool's `alloc`: round up to pages, allocate k pages,
and grow a request's row of host slots when a range passes what it already holds. Running out
of host pages is an error, never a silently short answer.
"""

from __future__ import annotations

from hicache.errors import CapacityError, TransferError


class HiSparseHostPoolMixin:
    """Mix into a `HostKVCache` (needs ``page_size``, ``alloc`` and ``available_size``)."""

    def _round_up_to_page_size(self, n: int) -> int:
        """``n`` rounded up to whole pages."""
        return -(-n // self.page_size) * self.page_size

    def alloc_page(self, num_pages: int):
        """``num_pages`` whole pages of token slots; CapacityError when the pool is short."""
        slots = self.alloc(num_pages * self.page_size)
        if slots is None:
            raise CapacityError(
                f"{type(self).__name__}: out of host pages: need {num_pages}, "
                f"{self.available_size() // self.page_size} free"
            )
        return slots

    def alloc_paged_token_slots(self, req_to_host_slots, allocated_len, req_index: int, start: int, num_tokens: int):
        """Host slots for tokens ``[start, start + num_tokens)`` of request ``req_index``.

        ``req_to_host_slots`` is an int64 table (requests x max tokens) and ``allocated_len``
        an int64 vector of how many slots each request's row holds; both are updated when
        the row has to grow (by whole pages).
        """
        end = start + num_tokens
        if start < 0 or num_tokens < 0 or end > req_to_host_slots.shape[1]:
            raise TransferError(f"tokens [{start}, {end}) do not fit a row of {req_to_host_slots.shape[1]}")
        held = int(allocated_len[req_index])
        if end > held:
            grow = self._round_up_to_page_size(end) - held
            if held + grow > req_to_host_slots.shape[1]:
                raise TransferError(f"growing request {req_index} to {held + grow} slots passes its row of {req_to_host_slots.shape[1]}")
            slots = self.alloc_page(grow // self.page_size)
            req_to_host_slots[req_index, held : held + grow] = slots
            allocated_len[req_index] = held + grow
        return req_to_host_slots[req_index, start:end]

    def allocated_host_indices(self, req_to_host_slots, allocated_len, req_index: int):
        """Every host slot request ``req_index`` holds."""
        return req_to_host_slots[req_index, : int(allocated_len[req_index])]
