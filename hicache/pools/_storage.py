"""Host pages for L3 storage back ends (SGLang's file, mooncake, nixl, hf3fs, ... back ends).

Owns what those back ends call on a host pool: flat pages (`get_data_page`,
`set_from_flat_data_page`, `get_dummy_flat_data_page`) in the bytes order of SGLang's own pools
(a page slice of the buffer, flattened in the buffer's dims), so an L3 store is shared with stock
SGLang; and zero-copy page pointers (`get_page_buffer_meta`, `get_ksize_per_token`,
`is_stride_page_aligned`). Indices may be ints or 0-d integer tensors, as SGLang passes them.
"""

from __future__ import annotations

import operator

from hicache.errors import TransferError
from hicache.pools._views import buffer_symbols, page_slice

#: Imported by name from SGLang's pool modules: host memory kept back from the pool budget.
HICACHE_HOST_MEMORY_RESERVE_BYTES = 10 * 1024**3


def as_index(value, what: str) -> int:
    """An int, or a 0-d integer tensor / numpy integer (SGLang passes ``host_indices[i]``)."""
    if isinstance(value, bool):
        raise TransferError(f"{what} must be an integer, got {value!r}")
    try:
        return operator.index(value)
    except TypeError:
        raise TransferError(f"{what} must be an integer or a 0-d integer tensor, got {value!r}") from None


class StoragePagesMixin:
    """Mixed into `HostKVCache` (needs ``buffers``, ``descriptor``, ``layout``, ``page_size``,
    ``size``, ``dtype``, ``size_per_token`` and ``_alive()``)."""

    def _page_parts(self, index):
        self._alive()
        index = as_index(index, "page index")
        if not 0 <= index < self.size:
            raise TransferError(f"page index {index!r} out of range [0, {self.size})")
        page = index // self.page_size
        family, layout = self.descriptor.family, self.layout
        return [page_slice(t, family, layout, page, self.page_size) for t in self.buffers]

    def get_data_page(self, index, flat: bool = True):
        """The page holding token ``index`` (all layers, K and V); flat: one 1-D tensor."""
        import torch

        parts = self._page_parts(index)
        if not flat:
            return parts[0] if len(parts) == 1 else parts
        if len({p.dtype for p in parts}) > 1:  # mixed dtypes (Mamba): raw bytes
            return torch.cat([p.contiguous().view(-1).view(torch.uint8) for p in parts])
        return torch.cat([p.flatten() for p in parts])

    def get_dummy_flat_data_page(self):
        """A contiguous 1-D tensor shaped like one flat page (zeros), for back ends that read
        into a buffer before `set_from_flat_data_page`."""
        import torch

        parts = self._page_parts(0)
        if len({p.dtype for p in parts}) > 1:
            return torch.zeros(sum(p.numel() * p.element_size() for p in parts), dtype=torch.uint8)
        return torch.zeros(sum(p.numel() for p in parts), dtype=parts[0].dtype)

    def set_from_flat_data_page(self, index, data_page) -> None:
        """Write a page produced by `get_data_page` back at token ``index``."""
        import torch

        parts = self._page_parts(index)
        mixed = len({p.dtype for p in parts}) > 1
        sizes = [p.numel() * (p.element_size() if mixed else 1) for p in parts]
        if data_page.numel() != sum(sizes):
            raise TransferError(f"data_page has {data_page.numel()} elements; a page has {sum(sizes)}")
        offset = 0
        for part, size in zip(parts, sizes):
            chunk = data_page[offset : offset + size]
            if mixed:
                chunk = chunk.view(torch.uint8).view(part.dtype)
            part.copy_(chunk.view(part.shape) if chunk.is_contiguous() else chunk.reshape(part.shape))
            offset += size

    # -- zero-copy --------------------------------------------------------------------------
    def get_ksize_per_token(self) -> int:
        """Bytes of one token's K (MHA: half of ``size_per_token``; others: all of it)."""
        return self.size_per_token // 2 if self._kv_axis() is not None else self.size_per_token

    def _kv_axis(self):
        symbols = buffer_symbols(self.descriptor.family, self.layout)
        return symbols.index("2") if "2" in symbols else None

    def _page_blocks(self, index) -> list:
        """The contiguous byte blocks of one page: K and V for MHA, one for MLA."""
        blocks = []
        axis = self._kv_axis()
        for part in self._page_parts(index):
            halves = [part.select(axis, 0), part.select(axis, 1)] if axis is not None else [part]
            for half in halves:
                if not half.is_contiguous():
                    raise TransferError(
                        f"{type(self).__name__} ({self.layout}): a page is not one contiguous block per "
                        "K/V; zero-copy page pointers need layout page_first or page_first_direct"
                    )
                blocks.append(half)
        return blocks

    def get_page_buffer_meta(self, indices):
        """Zero-copy pointers: for every page of ``indices`` (token indices, whole pages, ints
        or an int tensor), its K and V block (MHA) or its one block (MLA) as ``(ptr_list,
        size_list)`` of Python ints inside the registered host buffer."""
        values = indices.tolist() if hasattr(indices, "tolist") else list(indices)
        if isinstance(values, int):
            values = [values]
        ptrs, sizes = [], []
        for i in range(0, len(values), self.page_size):
            first = as_index(values[i], "index")
            if first % self.page_size:
                raise TransferError(f"index {first} does not start a page of {self.page_size}")
            for block in self._page_blocks(first):
                ptrs.append(block.data_ptr())
                sizes.append(block.numel() * block.element_size())
        return ptrs, sizes

    def is_stride_page_aligned(self, alignment: int) -> bool:
        """True when every page's blocks start on a multiple of ``alignment`` bytes (what RDMA
        back ends need for zero-copy); always False for layer_first."""
        if self.layout not in ("page_first", "page_first_direct"):
            return False
        try:
            blocks = self._page_blocks(0) + (self._page_blocks(self.page_size) if self.size > self.page_size else [])
        except TransferError:
            return False
        return all(block.data_ptr() % alignment == 0 for block in blocks)
