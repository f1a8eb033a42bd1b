"""How a host pool registered with the node store turns pages into copy segments: its page
bytes and segments per page (SGLang's `get_page_buffer_meta`, or one flat data page where a pool
has none or refuses its layout, or a marker where it holds no memory), and the checks every copy
passes first - host indices on page boundaries inside the pool, every segment inside one of the
pool's own tensors. Duck-typed over SGLang's pools and hicache's; imports hicache.errors (and
torch, lazily) only.
"""

from __future__ import annotations

import bisect
import operator
from array import array

from hicache.errors import ArenaError, TransferError
from hicache.store import PageSegments


#: a memoryless pool's page in the store (SGLang's `LogicalHostPool`, DeepSeek-V4's page anchor, holds
#: no bytes: its page says only that the page's tokens were stored, as HiCacheFile's empty file does);
#: one checksum word, so it is stored and checked like any page
MARKER = b"hicache\x00"


def _buffers(pool) -> list[tuple[int, int]]:
    """``(start, end)`` of every tensor the pool holds (its page segments must lie in one)."""
    import torch

    found = []
    for value in vars(pool).values():
        tensors = value if isinstance(value, (list, tuple)) else [value]
        for tensor in tensors:
            if isinstance(tensor, torch.Tensor) and tensor.numel():
                start = tensor.data_ptr()
                found.append((start, start + tensor.untyped_storage().nbytes() - tensor.storage_offset()
                              * tensor.element_size()))
    return sorted(found)


class PoolView:
    """One registered host pool: how its pages become segments, and its namespace."""

    def __init__(self, name: str, pool, *, zero_copy: bool, namespace_of) -> None:
        self.name, self.pool = name, pool
        self.page_size = getattr(pool, "page_size", 1) or 1
        self.bounds = _buffers(pool)
        # SGLang's `LogicalHostPool` and hicache's: no buffer, no bytes a token
        self.memoryless = getattr(pool, "kv_buffer", ()) is None and getattr(pool, "size_per_token", None) == 0
        self.zero_copy = zero_copy and hasattr(pool, "get_page_buffer_meta") and not self.memoryless
        self._starts = [start for start, _ in self.bounds]
        if self.zero_copy:
            try:
                ptrs, sizes = pool.get_page_buffer_meta(self._indices([0]))
            except (ValueError, NotImplementedError):  # SGLang's pools refuse some layouts (page_unified)
                self.zero_copy = False
        if self.zero_copy:
            self.per_page, self.page_bytes = len(ptrs), sum(sizes)
        else:  # SGLang's flat data pages, one staging copy each way
            try:
                self.per_page, self.page_bytes = 1, self.staging_page().nbytes
            except (ValueError, NotImplementedError) as error:  # SGLang's own back ends cannot store it either
                raise ArenaError(f"HiCacheNodeStore: pool {name!r} (layout {getattr(pool, 'layout', '?')!r}) gives "
                                 f"no page access for L3 - neither get_page_buffer_meta nor get_data_page ({error})"
                                 ) from None
        if self.page_bytes % 8 or not self.page_bytes:
            raise ArenaError(f"HiCacheNodeStore: pool {name!r} has pages of {self.page_bytes} bytes, "
                             "not a multiple of 8 (the store's checksum word)")
        self.namespace = namespace_of(self)

    def staging_page(self):
        """An empty flat data page of this pool, in plain host memory (SGLang's own dummy page is
        pinned: a CPU-only torch refuses it, and a host-to-host copy gains nothing from it)."""
        import torch

        if self.memoryless:
            return torch.empty(len(MARKER), dtype=torch.uint8)
        return torch.empty_like(self.pool.get_data_page(0, flat=True).contiguous())

    def flat_page(self, start: int):
        """The flat data page at host index ``start``; a memoryless pool's: its marker."""
        import torch

        if self.memoryless:
            return torch.frombuffer(bytearray(MARKER), dtype=torch.uint8)
        return self.pool.get_data_page(start, flat=True)

    def set_flat_page(self, start: int, page) -> bool:
        """Put a flat data page read from the store at host index ``start``; a memoryless pool's
        marker is checked, not put (False: not the marker, a miss)."""
        if self.memoryless:
            return bytes(page.numpy()) == MARKER
        self.pool.set_from_flat_data_page(start, page)
        return True

    def _indices(self, starts):
        import torch

        if not starts:
            return torch.empty(0, dtype=torch.int64)
        # one broadcast, not an arange per page (128 of them were a tenth of a 64 KiB-page batch_get_v1)
        return (torch.tensor(starts, dtype=torch.int64).unsqueeze(1) + torch.arange(self.page_size)).view(-1)

    def starts(self, host_indices, count: int) -> list[int]:
        """Each page's first host index, checked: ``count`` whole pages inside the pool."""
        if host_indices is None or host_indices.numel() != count * self.page_size:
            raise TransferError(f"pool {self.name!r}: {count} keys need {count * self.page_size} host indices, got "
                                f"{None if host_indices is None else host_indices.numel()}")
        starts = host_indices.reshape(count, self.page_size)[:, 0].tolist() if count else []
        size = getattr(self.pool, "size", None)
        for start in starts:
            if start < 0 or start % self.page_size or (size is not None and start + self.page_size > size):
                raise TransferError(f"pool {self.name!r}: host index {start} is not the start of a page inside "
                                    f"its {size} slots")
        return starts

    def segments(self, starts, host_indices) -> PageSegments:
        """The segments of the pages at ``starts`` (``host_indices``: the caller's indices they were
        read from by `starts`, 1-D - a pool's meta takes each page's first), flat, every one checked to lie inside one of the pool's buffers:
        at once where the batch's lowest and highest byte share one buffer (a pool's pages lie in
        one tensor: the usual case), else segment by segment. No torch.searchsorted here: it
        wakes torch's OpenMP workers, whose spinning took a core from the copy that follows
        (64 KiB-page batches 1.6x slower on 2 cores)."""
        ptrs, sizes = self.pool.get_page_buffer_meta(host_indices)
        if len(ptrs) != len(starts) * self.per_page or len(sizes) != len(ptrs):
            raise TransferError(f"pool {self.name!r}: {len(ptrs)} segments for {len(starts)} pages")
        try:
            pages = PageSegments(array("Q", ptrs), array("Q", sizes), self.per_page)
        except (OverflowError, TypeError):
            raise TransferError(f"pool {self.name!r}: get_page_buffer_meta gave a segment that is not a pointer and "
                                "a size") from None
        if ptrs and not self._inside(min(ptrs), max(map(operator.add, ptrs, sizes))):
            for ptr, size in zip(ptrs, sizes):
                if not self._inside(ptr, ptr + size):
                    raise TransferError(f"pool {self.name!r}: segment [{ptr:#x}, +{size}) lies outside its buffers")
        return pages

    def _inside(self, start: int, end: int) -> bool:
        """Whether ``[start, end)`` lies inside one of the pool's buffers."""
        at = bisect.bisect_right(self._starts, start) - 1
        return at >= 0 and start <= end <= self.bounds[at][1]


def flat_segments(tensor):
    """``([(ptr, bytes)], the contiguous tensor)`` of one flat data page (kept alive by the caller)."""
    flat = tensor.contiguous()
    return [(flat.data_ptr(), flat.nbytes)], flat
