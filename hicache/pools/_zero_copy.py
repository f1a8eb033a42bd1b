"""Zero-copy page pointers of a host pool (SGLang's `get_page_buffer_meta`, `get_ksize_per_token`,
`is_stride_page_aligned`): raw ``(ptr, size)`` lists into the registered host buffers that
Mooncake, NIXL and 3FS back ends read and write at, each checked to start a page inside the pool.
`PagePointers` is the part, over the pool's geometry and state check given at construction and
its buffers handed to each call. Imports the page views and `_storage`'s index check.
"""

from __future__ import annotations

from hicache.errors import TransferError
from hicache.pools._storage import kv_axis, listed, storage_index
from hicache.pools._views import buffer_symbols, page_slice


class PagePointers:
    """A part of a host pool (issue #55 item 1): its zero-copy pointers over what it is given -
    the pool's ``geometry`` and state check (``alive``) - and the pool's ``kv_buffer`` handed to
    each call (a replaced buffer's pointers move with it: `meta_kinds` keys on the buffers)."""

    def __init__(self, name: str, geometry, alive) -> None:
        self.name, self.geometry, self.alive = name, geometry, alive
        self.kinds = None  # (key, the zero-copy blocks of a page): `meta_kinds`

    def ksize_per_token(self) -> int:
        """Bytes of one token's K (MHA: half of ``size_per_token``; others: all of it)."""
        return self.geometry.size_per_token // 2 if kv_axis(self.geometry) is not None else self.geometry.size_per_token

    def meta_kinds(self, kv_buffer) -> list:
        """``(ptr of page 0, bytes from one page to the next, bytes)`` of each contiguous block of
        a page, in SGLang's order: per layer K then V for layer_first, K then V for the page
        layouts (MLA: one block, per layer for layer_first). Derived once from pages 0 and 1."""
        # keyed on what the pointers derive from - each buffer's address, bytes, shape and strides -
        # not on id(): a replaced kv_buffer can reuse a freed one's id(), and its pointers must move
        buffers = listed(kv_buffer, self.name)
        key = tuple((t.data_ptr(), t.untyped_storage().nbytes(), tuple(t.shape), t.stride()) for t in buffers)
        kinds = self.kinds
        if kinds is not None and kinds[0] == key:
            return kinds[1]
        first = self.layer_blocks(buffers, 0)
        second = self.layer_blocks(buffers, 1) if self.geometry.page_num > 1 else first
        made = [(a.data_ptr(), b.data_ptr() - a.data_ptr(), a.numel() * a.element_size()) for a, b in zip(first, second)]
        self.kinds = (key, made)
        return made

    def layer_blocks(self, buffers: list, page: int) -> list:
        family, layout = self.geometry.family, self.geometry.layout
        symbols = buffer_symbols(family, layout)
        token = min(symbols.index(s) for s in ("S", "N") if s in symbols)
        blocks = []
        for tensor in buffers:
            part = page_slice(tensor, family, layout, page, self.geometry.page_size)
            halves = [part.select(0, 0), part.select(0, 1)] if symbols[0] == "2" else [part]
            axis_l = symbols.index("L") if "L" in symbols and symbols.index("L") < token else None
            if axis_l is None:
                blocks += halves
            else:  # layer_first: layer outer, K/V inner
                axis = axis_l - (1 if symbols[0] == "2" else 0)
                blocks += [half.select(axis, layer) for layer in range(self.geometry.layer_num) for half in halves]
        for block in blocks:
            if not block.is_contiguous():
                raise TransferError(f"{self.name} ({layout}): a page block is not contiguous; "
                                    "no zero-copy page pointers for this layout")
        return blocks

    def meta_pages(self, indices) -> list:
        """The physical page of every logical page of ``indices`` (token indices covering whole
        pages, ints or an int tensor), each checked to start a page inside the pool: a raw pointer
        past the buffer would be a wild read or write in the back end."""
        self.alive()
        values = indices.tolist() if hasattr(indices, "tolist") else list(indices)
        if isinstance(values, int):
            values = [values]
        step = self.geometry.logical_page_size
        if len(values) % step:
            raise TransferError(f"{len(values)} indices are not whole pages of {step}")
        page_size = self.geometry.page_size
        pages = []
        for value in values[::step]:  # index tensors take `meta_tensor`; this is lists and bad indices
            index = storage_index(self.geometry, value)
            if index % page_size:
                raise TransferError(f"index {value} does not start a page of {step}")
            pages.append(index // page_size)
        return pages

    def meta_tensor(self, indices, kinds):
        """`meta` for a 1-D integer tensor: its page starts read once, then plain int arithmetic
        with the same checks as `meta_pages` (a dozen torch ops per batch were a tenth of a 64
        KiB-page L3 read: issue #51); None where the plain path must answer (DCP, an empty or
        odd-length tensor, a bad index - it raises the error naming it)."""
        import torch

        step = self.geometry.logical_page_size
        if (self.geometry.dcp_size != 1 or indices.dim() != 1 or indices.numel() == 0 or indices.numel() % step
                or indices.dtype not in (torch.int64, torch.int32) or indices.device.type != "cpu"):
            return None
        starts = indices[::step].tolist()
        page_size = self.geometry.page_size
        pages = [start // page_size for start in starts]
        if min(starts) < 0 or max(starts) >= self.geometry.size or [page * page_size for page in pages] != starts:
            return None
        if len(kinds) == 1:
            ((ptr, stride, size),) = kinds
            return [ptr + page * stride for page in pages], [size] * len(pages)
        ptrs = [ptr + page * stride for page in pages for ptr, stride, _ in kinds]
        return ptrs, [size for _, _, size in kinds] * len(pages)

    def meta(self, kv_buffer, indices):
        """Zero-copy pointers, as SGLang's pools compute them: for every page of ``indices``,
        each block of the page (`meta_kinds`) as ``(ptr_list, size_list)`` of Python ints inside
        the registered host buffer. Every layout SGLang serves (layer_first: one block per layer
        and K/V)."""
        self.alive()
        kinds = self.meta_kinds(kv_buffer)
        if hasattr(indices, "dim") and hasattr(indices, "div"):
            fast = self.meta_tensor(indices, kinds)
            if fast is not None:
                return fast
        pages = self.meta_pages(indices)
        if len(kinds) == 1:
            ((ptr, step, size),) = kinds
            return [ptr + page * step for page in pages], [size] * len(pages)
        ptrs = [ptr + page * step for page in pages for ptr, step, _ in kinds]
        return ptrs, [size for _, _, size in kinds] * len(pages)

    def stride_aligned(self, kv_buffer, page_size_bytes: int) -> bool:
        """Every page's blocks start on a multiple of ``page_size_bytes``; False for layer_first."""
        if self.geometry.layout not in ("page_first", "page_first_direct", "page_head") or kv_buffer is None:
            return False
        try:
            kinds = self.meta_kinds(kv_buffer)
        except TransferError:
            return False
        return all(ptr % page_size_bytes == 0 and step % page_size_bytes == 0 for ptr, step, _ in kinds)
