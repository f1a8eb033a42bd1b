"""`HiSparseHostPoolMixin`: per-request host slot rows that grow by whole pages (SGLang's
HiSparse coordinator calls these).

Owns SGLang's HiSparse helpers on top of a pool's `alloc`, with SGLang's signatures: round up
to pages, allocate k pages (`alloc_page`: None when short), grow a request's row of host slots
when a range passes what it holds (`RuntimeError` when host pages run out), and list the
slots a request holds (`-1` entries dropped).
"""

from __future__ import annotations

from hicache.errors import HostPagesExhaustedError, TransferError



class HiSparseHostPoolMixin:
    """A part of a `HostKVCache`: over the pool's ``geometry`` (its page) and its slot calls."""

    #: the pool's calls this part makes beyond its ``geometry`` (tests/test_import_rules.py)
    NEEDS = ("alloc", "available_size")

    def _round_up_to_page_size(self, n: int) -> int:
        """``n`` rounded up to whole pages."""
        return -(-n // self.geometry.page_size) * self.geometry.page_size

    def alloc_page(self, num_pages: int):
        """``num_pages`` whole pages of token slots, or None when the pool is short."""
        return self.alloc(num_pages * self.geometry.page_size)

    def alloc_paged_token_slots(self, req_to_host_pool, req_to_host_pool_allocated_len, req_pool_idx, start_pos,
                                num_tokens):
        """Host slots for tokens ``[start_pos, start_pos + num_tokens)`` of request ``req_pool_idx``.

        ``req_to_host_pool`` is an int64 table (requests x max tokens) and
        ``req_to_host_pool_allocated_len`` an int64 vector of how many slots each row holds;
        both are updated when the row has to grow (by whole pages, up to the page holding the
        last token). An empty int64 tensor for ``num_tokens <= 0``; `HostPagesExhaustedError`
        (a RuntimeError) when the host pool is out of pages.
        """
        import torch

        start, count = int(start_pos), int(num_tokens)
        if count <= 0:
            return torch.empty(0, dtype=torch.int64, device=req_to_host_pool.device)
        end = start + count
        width = req_to_host_pool.shape[1]
        if start < 0 or end > width:
            raise TransferError(f"tokens [{start}, {end}) do not fit a row of {width}")
        held = int(req_to_host_pool_allocated_len[req_pool_idx])
        want = self._round_up_to_page_size(end)
        if want > held:
            if want > width:
                raise TransferError(f"growing request {int(req_pool_idx)} to {want} slots passes its row of {width}")
            pages = (want - held) // self.geometry.page_size
            slots = self.alloc_page(pages)
            if slots is None:
                raise HostPagesExhaustedError(
                    f"{type(self).__name__}: out of host pages: request {int(req_pool_idx)} needs {pages}, "
                    f"{self.available_size() // self.geometry.page_size} free"
                )
            req_to_host_pool[req_pool_idx, held:want] = slots.to(req_to_host_pool.device)
            req_to_host_pool_allocated_len[req_pool_idx] = want
        return req_to_host_pool[req_pool_idx, start:end]

    def allocated_host_indices(self, req_to_host_pool, req_pool_idx, allocated_len):
        """The host slots request ``req_pool_idx`` holds: its row up to
        ``min(round_up(allocated_len), width)``, unset (negative) entries dropped."""
        row = req_to_host_pool[req_pool_idx]
        end = min(self._round_up_to_page_size(int(allocated_len)), row.shape[0])
        held = row[:end]
        return held[held >= 0]
