"""A batch's pages as copy segments, and the checks every segment passes before the store copies
to or from it.

`PageSegments` holds a batch flat - page i's segments are ``ptrs[i*k:(i+1)*k]`` with
``sizes[i*k:(i+1)*k]``, k segments per page - in u64 arrays the C helper reads as they are, and
checks them in one vectorized pass (a per-segment Python loop was a tenth of a 64 KiB-page
`batch_get_v1`, issue #51). `NodeStore` also takes SGLang-style lists of ``[(ptr, bytes), ...]``
per page; `PageSegments.of` turns them into one. Imports hicache.errors and the arena room (whose
slot ops run the checks: the C helper, or the fallback's torch).
"""

from __future__ import annotations

from array import array

import attrs

from hicache.effects import arena as _arena
from hicache.errors import TransferError

_TOP = 2**63  # pointers at or above read negative as int64: outside every user address space anyway


@attrs.frozen
class PageSegments:
    """One batch's page segments, flat: ``ptrs`` and ``sizes`` (u64 arrays), ``per_page`` each."""

    ptrs: array
    sizes: array
    per_page: int

    @classmethod
    def of(cls, pages) -> PageSegments:
        """``pages`` as given (a `PageSegments`), or from a list of ``[(ptr, bytes), ...]`` per page:
        every page with as many segments as the first."""
        if isinstance(pages, PageSegments):
            return pages
        if hasattr(pages, "data_ptr"):
            raise TransferError(f"pages must be a list of [(ptr, bytes), ...] per page, got a {type(pages).__name__}"
                                f"{_TENSOR_HINT}")
        try:
            pages = list(pages)
        except TypeError:
            raise TransferError(f"pages must be a list of [(ptr, bytes), ...] per page, got {pages!r}") from None
        per_page = _segment_count(pages[0], 0) if pages else 1
        for i, segments in enumerate(pages):
            if _segment_count(segments, i) != per_page:
                raise TransferError(f"page {i} has {len(segments)} segments, page 0 has {per_page}")
        if not per_page:
            raise TransferError("page 0 has no segments")
        try:
            ptrs = array("Q", [ptr for segments in pages for ptr, _ in segments])
            sizes = array("Q", [size for segments in pages for _, size in segments])
        except (OverflowError, TypeError, ValueError):  # a segment that is no pair, or no pointer and size: name it
            for i, segments in enumerate(pages):
                for segment in segments:
                    try:
                        ptr, size = segment
                    except (TypeError, ValueError):
                        raise TransferError(f"page {i}: a segment must be a (ptr, bytes) pair, got "
                                            f"{_brief(segment)}{_TENSOR_HINT}") from None
                    if (not isinstance(ptr, int) or not isinstance(size, int) or ptr <= 0 or size <= 0 or ptr >= _TOP
                            or size >= _TOP):
                        raise TransferError(f"page {i}: segment {_brief(ptr)} + {_brief(size)} bytes is not a "
                                            "pointer and a size inside the address space") from None
            raise
        return cls(ptrs, sizes, per_page)

    @property
    def count(self) -> int:
        return len(self.ptrs) // self.per_page

    def page(self, i: int) -> list[tuple[int, int]]:
        k = self.per_page
        return list(zip(self.ptrs[i * k:(i + 1) * k], self.sizes[i * k:(i + 1) * k]))

    def take(self, picked) -> PageSegments:
        """The pages at the indices ``picked``, in that order."""
        k = self.per_page
        ptrs, sizes = array("Q"), array("Q")
        for i in picked:
            ptrs.extend(self.ptrs[i * k:(i + 1) * k])
            sizes.extend(self.sizes[i * k:(i + 1) * k])
        return PageSegments(ptrs, sizes, k)


#: pages are raw memory, never tensors: the store copies between the arena and the caller's buffers
_TENSOR_HINT = " (a page is a list of [(ptr, bytes), ...]: a tensor's data_ptr() and nbytes, not the tensor)"


def _segment_count(segments, i: int) -> int:
    """How many segments page ``i`` has; a `TransferError` for what is no list of them."""
    if hasattr(segments, "data_ptr"):  # a tensor has a length too: its elements are no segments
        raise TransferError(f"page {i} is a {type(segments).__name__}{_TENSOR_HINT}")
    try:
        return len(segments)
    except TypeError:
        raise TransferError(f"page {i} must be a list of (ptr, bytes) segments, got {_brief(segments)}"
                            f"{_TENSOR_HINT}") from None


def _brief(value) -> str:
    """``value`` for an error message: its type, and its repr when short."""
    text = repr(value)
    return f"{type(value).__name__} {text}" if len(text) <= 60 else f"a {type(value).__name__}"


def check_pages(pages: PageSegments, *, count: int, page_bytes: int, arena: tuple[int, int], where: str,
                ops=None) -> None:
    """``count`` pages, each of whole 8-byte words adding up to ``page_bytes``, every segment
    inside the address space and outside ``arena`` (``[start, end)``: the store's own mapping,
    whose index a stray segment would overwrite for every attached engine). One pass by the
    arena's slot ``ops`` (the C helper's, or the fallback's vectorized torch; the fallback's by
    default); the first failure, in page order, is a `TransferError` naming page, segment and ``where``."""
    if pages.count != count or len(pages.ptrs) != len(pages.sizes):
        raise TransferError(f"{count} keys but {pages.count} pages")
    if not count:
        return
    first = (ops or _arena.PythonSlotOps).first_bad_page(pages.ptrs, pages.sizes, pages.per_page, page_bytes, *arena)
    if first >= 0:
        _first_failure(pages, page_bytes, arena, where, first)


def _first_failure(pages: PageSegments, page_bytes: int, arena: tuple[int, int], where: str, first: int) -> None:
    """The error of page ``first``, the first failing one (a slow pass, taken only when one fails)."""
    start_arena, end_arena = arena
    for i in range(first, pages.count):
        segments = pages.page(i)
        for ptr, size in segments:
            if size <= 0 or size % 8 or size >= _TOP:
                raise TransferError(f"page {i}: a segment of {size} bytes is not whole 8-byte words")
            if ptr <= 0 or ptr >= _TOP or ptr + size >= _TOP:
                raise TransferError(f"page {i}: segment {ptr:#x} + {size} bytes is outside the address space")
            if ptr < end_arena and start_arena < ptr + size:
                raise TransferError(f"page {i}: segment {ptr:#x} + {size} bytes lies in the arena's own mapping "
                                    f"[{start_arena:#x}, {end_arena:#x}) ({where})")
        if sum(size for _, size in segments) != page_bytes:
            raise TransferError(f"page {i}: segments of {[s for _, s in segments]} bytes are not one page of "
                                f"{page_bytes} bytes")
    raise AssertionError("check_pages: a failure the slow pass did not find")  # the two passes disagree: a bug
