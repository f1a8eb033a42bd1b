"""The host pool's page allocator: page-aligned token-slot runs, exact counts, misuse caught.

Owns which host pages are free. With the optional C helper (`_pagestack`) the free pages are a
stack and alloc / free are one call each whatever the occupancy (~a few us a pair); without it,
frees are parked and merged lazily with torch operations (one concatenation when the free list
runs short). Either way a page handed out twice or freed twice raises instead of corrupting
the pool, and a refused free changes nothing. Not thread-safe by itself: the pool calls it
under its lock.
"""

from __future__ import annotations

import operator

from hicache.errors import PlanError
from hicache.plan.checks import MAX_BYTES, check_bool, check_int, is_integer

try:
    from hicache.pools import _pagestack as _native
except ImportError:  # built without a C compiler: the torch path below
    _native = None

_FREE_ERRORS = {
    -1: "indices are not whole pages of {page_size}",
    -2: "indices must be page-aligned runs of whole pages",
    -3: "indices out of range [0, {slots})",
}


def _check_need(need_size, page_size: int) -> int:
    if not is_integer(need_size):
        raise PlanError(f"alloc: need_size must be a non-negative int, got {need_size!r}")
    try:
        need_size = operator.index(need_size)  # numpy / 0-d tensor integers, as Python ints
    except TypeError:  # a tensor of several elements
        raise PlanError(f"alloc: need_size must be a non-negative int, got {need_size!r}") from None
    if need_size < 0:
        raise PlanError(f"alloc: need_size must be a non-negative int, got {need_size!r}")
    if need_size % page_size:
        raise PlanError(f"alloc: need_size {need_size} is not a multiple of the page size {page_size}")
    return need_size // page_size


class PageAllocator:
    """Hands out ``page_size``-token runs of ``page_num`` pages as int64 token-slot indices.

    ``native``: use the C helper (default: when it was built).
    """

    def __init__(self, page_num: int, page_size: int, *, native: bool | None = None) -> None:
        # checked before any tensor: a page size of 0 divided by zero at the first alloc or free
        page_size = check_int(PlanError, "PageAllocator", "page_size", page_size)
        page_num = check_int(PlanError, "PageAllocator", "page_num", page_num, minimum=0,
                             maximum=MAX_BYTES // page_size)  # every token slot an int64 index
        native = None if native is None else check_bool(PlanError, "PageAllocator", "native", native)
        import torch

        self.torch = torch
        self.page_num = page_num
        self.page_size = page_size
        self.native = _native is not None if native is None else native
        if self.native and _native is None:
            raise PlanError("PageAllocator(native=True) but hicache.pools._pagestack was not built")
        self._offsets = torch.arange(page_size, dtype=torch.int64)
        self.clear()

    # -- state -------------------------------------------------------------------------------
    def clear(self) -> None:
        """Every page free again."""
        torch = self.torch
        if self.native:
            self._stack = torch.arange(self.page_num - 1, -1, -1, dtype=torch.int64)  # page 0 on top
            self._top = self.page_num
            self._marks = torch.zeros(self.page_num, dtype=torch.uint8)
            self._stack_ptr, self._marks_ptr = self._stack.data_ptr(), self._marks.data_ptr()
            return
        self._free = torch.arange(self.page_num, dtype=torch.int64)
        self._head = 0  # pages before _head in _free are handed out
        self._parked: list = []
        self._parked_pages = 0
        self._allocated = torch.zeros(self.page_num, dtype=torch.bool)

    def available_size(self) -> int:
        """Free token slots, exactly."""
        if self.native:
            return self._top * self.page_size
        return (self._free.numel() - self._head + self._parked_pages) * self.page_size

    # -- alloc -------------------------------------------------------------------------------
    def alloc(self, need_size: int):
        """``need_size`` token slots (a multiple of the page size) or None when short."""
        pages = _check_need(need_size, self.page_size)
        if self.native:
            if pages > self._top:
                return None
            out = self.torch.empty(pages * self.page_size, dtype=self.torch.int64)
            top = _native.alloc(self._stack_ptr, self._top, self._marks_ptr, pages, self.page_size, out.data_ptr())
            if top < 0:
                raise RuntimeError("page allocator corrupted: a free page is marked handed out")
            self._top = top
            return out
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

    def _merge(self) -> None:
        torch = self.torch
        self._free = torch.cat([self._free[self._head :], *self._parked])
        self._head = 0
        self._parked, self._parked_pages = [], 0

    # -- free --------------------------------------------------------------------------------
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
        """Return token slots to the pool; freeing a page that is not allocated raises (and
        frees nothing)."""
        torch = self.torch
        if self.native and isinstance(indices, torch.Tensor) and indices.dim() == 1 and indices.device.type == "cpu" \
                and indices.dtype in (torch.int64, torch.int32):
            return self._free_native(indices.contiguous())
        pages = self.pages_of(indices)
        if pages.numel() == 0:
            return 0
        if pages.unique().numel() != pages.numel():
            raise RuntimeError("double free: the same page appears twice in one free()")
        if self.native:
            return self._free_native(pages[:, None] * self.page_size + self._offsets)
        not_held = pages[~self._allocated[pages]]
        if not_held.numel():
            raise RuntimeError(f"double free: pages {not_held.tolist()[:8]} are not allocated")
        self._allocated[pages] = False
        self._parked.append(pages.clone())
        self._parked_pages += pages.numel()
        return pages.numel() * self.page_size

    def _free_native(self, indices) -> int:
        count = indices.numel()
        top = _native.free(self._stack_ptr, self._top, self.page_num, self._marks_ptr, indices.data_ptr(), count,
                           indices.element_size(), self.page_size, self.page_num)
        if top >= 0:
            self._top = top
            return count
        if top in _FREE_ERRORS:
            raise PlanError(_FREE_ERRORS[top].format(page_size=self.page_size, slots=self.page_num * self.page_size))
        if top == -5:
            raise RuntimeError("double free: the same page appears twice in one free()")
        if top == -4:
            pages = (indices.view(-1, self.page_size)[:, 0] // self.page_size).tolist()
            not_held = [p for p in pages if not self._marks[p]]
            raise RuntimeError(f"double free: pages {not_held[:8]} are not allocated")
        raise RuntimeError(f"page allocator corrupted: freeing {count} slots would overflow the free stack")
