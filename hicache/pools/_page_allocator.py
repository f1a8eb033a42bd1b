"""The host pool's page allocator: page-aligned token-slot runs, exact counts, misuse caught.

Owns which host pages are free. Frees are parked and merged lazily (one concatenation when the
free list runs short, not one per free as SGLang's original scheme did); a page handed out
twice or freed twice raises instead of corrupting the pool. Not thread-safe by itself: the
pool calls it under its lock.
"""

from __future__ import annotations

from hicache.errors import PlanError


class PageAllocator:
    """Hands out ``page_size``-token runs of ``page_num`` pages as int64 token-slot indices."""

    def __init__(self, page_num: int, page_size: int) -> None:
        import torch

        self.torch = torch
        self.page_num = page_num
        self.page_size = page_size
        self._offsets = torch.arange(page_size, dtype=torch.int64)
        self.clear()

    def clear(self) -> None:
        """Every page free again."""
        torch = self.torch
        self._free = torch.arange(self.page_num, dtype=torch.int64)
        self._head = 0  # pages before _head in _free are handed out
        self._parked: list = []
        self._parked_pages = 0
        self._allocated = torch.zeros(self.page_num, dtype=torch.bool)

    def available_size(self) -> int:
        """Free token slots, exactly."""
        return (self._free.numel() - self._head + self._parked_pages) * self.page_size

    def _merge(self) -> None:
        torch = self.torch
        self._free = torch.cat([self._free[self._head :], *self._parked])
        self._head = 0
        self._parked, self._parked_pages = [], 0

    def alloc(self, need_size: int):
        """``need_size`` token slots (a multiple of the page size) or None when short."""
        if isinstance(need_size, bool) or not isinstance(need_size, int) or need_size < 0:
            raise PlanError(f"alloc: need_size must be a non-negative int, got {need_size!r}")
        if need_size % self.page_size:
            raise PlanError(f"alloc: need_size {need_size} is not a multiple of the page size {self.page_size}")
        pages = need_size // self.page_size
        if self._free.numel() - self._head < pages:
            if self._free.numel() - self._head + self._parked_pages < pages:
                return None
            self._merge()
        taken = self._free[self._head : self._head + pages]
        if self._allocated[taken].any():
            raise RuntimeError(f"page allocator corrupted: pages {taken[self._allocated[taken]].tolist()} handed out twice")
        self._allocated[taken] = True
        self._head += pages
        return (taken[:, None] * self.page_size + self._offsets).reshape(-1)

    def pages_of(self, indices):
        """The page ids of ``indices`` (page-aligned runs of whole pages), validated."""
        torch = self.torch
        if not isinstance(indices, torch.Tensor) or indices.dtype not in (torch.int64, torch.int32) or indices.dim() != 1:
            raise PlanError(f"indices must be a 1-D int64/int32 tensor, got {getattr(indices, 'dtype', type(indices))!r}")
        if indices.numel() % self.page_size:
            raise PlanError(f"{indices.numel()} indices are not whole pages of {self.page_size}")
        runs = indices.to(torch.int64).view(-1, self.page_size)
        starts = runs[:, 0]
        if (starts % self.page_size).any() or not torch.equal(runs, starts[:, None] + self._offsets):
            raise PlanError("indices must be page-aligned runs of whole pages")
        if starts.numel() and (starts.min() < 0 or starts.max() >= self.page_num * self.page_size):
            raise PlanError(f"indices out of range [0, {self.page_num * self.page_size})")
        return starts // self.page_size

    def free(self, indices) -> int:
        """Return token slots to the pool; freeing a page that is not allocated raises."""
        pages = self.pages_of(indices)
        if pages.numel() == 0:
            return 0
        if pages.unique().numel() != pages.numel():
            raise RuntimeError("double free: the same page appears twice in one free()")
        not_held = pages[~self._allocated[pages]]
        if not_held.numel():
            raise RuntimeError(f"double free: pages {not_held.tolist()[:8]} are not allocated")
        self._allocated[pages] = False
        self._parked.append(pages.clone())
        self._parked_pages += pages.numel()
        return pages.numel() * self.page_size
