"""Host pages for L3 storage back ends (SGLang's file, mooncake, nixl, hf3fs, ... back ends).

Owns what those back ends call on a host pool: flat pages (`get_data_page`,
`set_from_flat_data_page`, `get_dummy_flat_data_page`) in the bytes order of SGLang's own pools
(a page slice of the buffer, flattened in the buffer's dims), so an L3 store is shared with stock
SGLang; and zero-copy page pointers (`get_page_buffer_meta`, `get_ksize_per_token`,
`is_stride_page_aligned`). Indices may be ints or 0-d integer tensors, as SGLang passes them.
"""

from __future__ import annotations

import operator
from typing import NamedTuple

from hicache.errors import TransferError
from hicache.pools._page_writes import page_reader, page_writer
from hicache.pools._views import buffer_symbols, page_axis, page_slice
from hicache.plan.checks import is_integer

#: Imported by name from SGLang's pool modules: host memory kept back from the pool budget.
HICACHE_HOST_MEMORY_RESERVE_BYTES = 10 * 1024**3


def as_index(value, what: str) -> int:
    """An int, or a 0-d integer tensor / numpy integer (SGLang passes ``host_indices[i]``)."""
    if not is_integer(value):
        raise TransferError(f"{what} must be an integer or a 0-d integer tensor, got {value!r}")
    try:
        return operator.index(value)
    except TypeError:
        raise TransferError(f"{what} must be an integer or a 0-d integer tensor, got {value!r}") from None


class _PageGeometry(NamedTuple):
    key: object  # the kv_buffer it was derived from (the same object, or the geometry is stale)
    tensors: tuple  # those buffers
    lead: tuple  # full slices before the axis a page is cut on (the same in every buffer)
    by_page: bool  # that axis counts pages (True) or tokens (False)
    mixed: bool  # buffers of several dtypes: flat pages are raw bytes
    sizes: tuple  # per buffer: elements (bytes when mixed) of one page
    total: int
    dtype: object  # of a flat page (None when mixed: uint8)
    shapes: tuple
    page_size: int  # the pool's, and its token slots: an int index in [0, size) needs no more checks
    size: int
    direct: bool  # no DCP: a token index is this rank's own
    writer: object  # a `PageWriter` (_page_writes: the streaming page write), or None: torch's assignment
    reader: object  # start -> a new flat page (_page_writes: the small pages' gather), or None: torch's flatten


class StoragePagesMixin:
    """A part of `HostKVCache`: the L3 pages over the pool's ``geometry`` (every fact read from
    it) and the live state in `NEEDS`; the pool's ``destroy`` calls `_close_pages` before
    releasing anything."""

    #: the pool's live state this part reads beyond its ``geometry`` (tests/test_import_rules.py);
    #: ``get_split_heads_page_buffer_meta``: MHA's, for a split factor other than 1
    NEEDS = ("buffers", "kv_buffer", "copy_engine", "_alive", "get_split_heads_page_buffer_meta")

    _page_geometry: _PageGeometry | None = None  # set by _derive_page_geometry() on a live pool only

    def get_page_buffer_element_size(self, split_factor: int = 1):
        """Bytes of one storage element (SGLang's: the first size of the page meta of page 0),
        or None when the pool has no zero-copy elements."""
        import torch

        indices = torch.zeros(self.geometry.logical_page_size, dtype=torch.int64)
        meta = (self.get_split_heads_page_buffer_meta(indices, split_factor) if split_factor != 1
                else self.get_page_buffer_meta(indices))
        sizes = meta[1] if meta else None
        return int(sizes[0]) if sizes else None

    def get_hybrid_pool_buffer(self) -> list:
        """The host tensors a zero-copy back end registers (mooncake, nixl, umbp linkers)."""
        return list(self.buffers)

    def _storage_index(self, index) -> int:
        """A token index of the pool's logical space -> this rank's physical token index
        (SGLang's DCP rule: a logical page start / ``dcp_size``), checked against the pool."""
        if type(index) is not int:
            index = as_index(index, "page index")
        dcp = self.geometry.dcp_size
        if dcp > 1:
            if index < 0 or index % self.geometry.logical_page_size:
                raise TransferError(f"page index {index} is not a logical page start (DCP pages of "
                                    f"{self.geometry.logical_page_size})")
            index //= dcp
        if not 0 <= index < self.geometry.size:
            raise TransferError(f"page index {index!r} out of range [0, {self.geometry.size})")
        return index

    def _derive_page_geometry(self) -> _PageGeometry:
        """How a page sits in each buffer and what its flat form is, derived once per set of
        buffers (a page is read and written per L3 page: this is on the hot path)."""
        cached = self._page_geometry
        if cached is not None and cached.key is self.kv_buffer:
            return cached
        self._alive()  # the one check of the pool's state: a destroyed or leaked pool has no geometry
        if self.kv_buffer is None:
            raise TransferError(f"{type(self).__name__} is allocator-only (is_dummy): it holds no pages")
        pool = self.geometry
        family, layout, page_size = pool.family, pool.layout, pool.page_size
        axes = [page_axis(t, family, layout) for t in self.buffers]
        parts = [page_slice(t, family, layout, 0, page_size) for t in self.buffers]
        mixed = len({p.dtype for p in parts}) > 1
        sizes = tuple(p.numel() * (p.element_size() if mixed else 1) for p in parts)
        if len(set(axes)) != 1:
            raise TransferError(f"{type(self).__name__}: its buffers cut pages on different axes {axes}")
        (axis, by_page), = set(axes)
        writer = reader = None
        engine = getattr(self, "copy_engine", None)
        pages, tail = divmod(pool.size, page_size)
        if engine is not None and pages and not tail:  # every index in range is in a whole page
            import torch

            lasts = [page_slice(t, family, layout, pages - 1, page_size) for t in self.buffers]
            last_start = pages - 1 if by_page else (pages - 1) * page_size
            writer = page_writer(self.buffers, parts, lasts, last_start, axis, engine,
                                 dtype=torch.uint8 if mixed else parts[0].dtype, numel=sum(sizes))
            if len(self.buffers) == 1:
                reader = page_reader(self.buffers[0], parts[0], lasts[0], last_start, axis, engine)
        made = _PageGeometry(self.kv_buffer, tuple(self.buffers), (slice(None),) * axis, by_page, mixed, sizes,
                             sum(sizes), None if mixed else parts[0].dtype, tuple(tuple(p.shape) for p in parts),
                             page_size, pool.size, pool.dcp_size == 1, writer, reader)
        self._page_geometry = made
        return made

    def _close_pages(self) -> None:
        """No page access from here on without `_alive()`'s check (destroy calls it first): the
        cached geometry, the page path's proof that the pool was live, is dropped."""
        self._page_geometry = None

    def _page_at(self, index):
        """(geometry, key) of the page holding token ``index`` - the key is the index into each
        buffer that selects it: the L3 page path's one entry, called per page (one function, no
        further calls in the common case). A cached geometry exists only while the pool is live
        (`_derive_page_geometry` checks, `_close_pages` drops it), so the common case - a live pool, an int
        index in range - is two tests; a refused pool or a bad index takes the long way, which
        raises naming why."""
        geometry = self._page_geometry
        if geometry is None or geometry.key is not self.kv_buffer:
            geometry = self._derive_page_geometry()
        page_size = geometry.page_size
        if type(index) is int and 0 <= index < geometry.size and geometry.direct:  # the common case
            page = index // page_size
        else:
            page = self._storage_index(index) // page_size
        cut = slice(page, page + 1) if geometry.by_page else slice(page * page_size, (page + 1) * page_size)
        # basic slicing, torch's fast path: a bare slice on axis 0 (a 1-tuple, or narrow(), costs
        # half as much again per page); fewer slices than SGLang's [:, :, a:b, :, :] cost less
        lead = geometry.lead
        return geometry, (lead + (cut,) if lead else cut)

    def _page_parts(self, index):
        geometry, key = self._page_at(index)
        return [t[key] for t in geometry.tensors]

    def get_data_page(self, index, flat: bool = True):
        """The page holding token ``index`` (all layers, K and V); flat: one 1-D tensor (a view
        where the page is contiguous - MLA page-first - as SGLang's)."""
        geometry, key = self._page_at(index)
        if len(geometry.tensors) == 1:  # the common case, on every L3 page: no list, no import
            if flat and geometry.reader is not None:  # a small page in several blocks: one gather
                return geometry.reader((key[-1] if geometry.lead else key).start)
            part = geometry.tensors[0][key]
            return part.flatten() if flat else part
        parts = [t[key] for t in geometry.tensors]
        if not flat:
            return parts
        import torch  # here, not above: an import statement costs the common case ~60 ns a page

        if geometry.mixed:  # mixed dtypes (Mamba): raw bytes
            return torch.cat([p.contiguous().view(-1).view(torch.uint8) for p in parts])
        return torch.cat([p.flatten() for p in parts])

    def get_dummy_flat_data_page(self):
        """A contiguous 1-D tensor shaped like one flat page (zeros), for back ends that read
        into a buffer before `set_from_flat_data_page`."""
        import torch

        geometry = self._derive_page_geometry()
        return torch.zeros(geometry.total, dtype=torch.uint8 if geometry.mixed else geometry.dtype)

    def set_from_flat_data_page(self, index, data_page) -> None:
        """Write a page produced by `get_data_page` back at token ``index``."""
        geometry, key = self._page_at(index)
        if geometry.writer is not None and self._written(geometry, key, data_page):
            return
        if len(geometry.tensors) == 1 and not geometry.mixed:
            # view(*ints): torch's fast path (a torch.Size argument costs about three times more)
            # and assignment, not [key].copy_(): torch copies in place without a Python view object.
            # The view is the size check too: it fails for a wrong element count (and for strides
            # it cannot view), both told apart below - never a partial copy.
            shape = geometry.shapes[0]
            try:
                source = data_page.view(*shape)
            except (RuntimeError, AttributeError, TypeError):  # a wrong size or strides; no tensor at all
                source = self._reshaped_page(data_page, geometry, shape)
            if source.dtype is not geometry.dtype:  # the assignment would convert it value by value
                self._reshaped_page(data_page, geometry, shape)  # raises, naming both dtypes
            geometry.tensors[0][key] = source
            return
        import torch  # not in the single-buffer case above (per page: see get_data_page)

        flat = self._reshaped_page(data_page, geometry, (-1,))  # cut by element counts: a view where it can be
        parts = [t[key] for t in geometry.tensors]
        offset = 0
        for part, size, shape in zip(parts, geometry.sizes, geometry.shapes):
            chunk = flat[offset : offset + size]
            if geometry.mixed:  # raw bytes: viewed as the part's dtype once contiguous and aligned to it
                if not chunk.is_contiguous() or chunk.storage_offset() % part.element_size():
                    chunk = chunk.clone()  # a broadcast page, or a part after one of another dtype
                chunk = chunk.view(part.dtype)
            part.copy_(chunk.view(*shape) if chunk.is_contiguous() else chunk.reshape(*shape))
            offset += size

    @staticmethod
    def _written(geometry, key, data_page) -> bool:
        """Whether ``data_page`` went into the page at ``key`` by the geometry's streaming writer
        (_page_writes): only a contiguous CPU tensor of exactly a flat page's dtype and elements,
        whose bytes are then the page's; anything else is left to torch's path (False)."""
        writer = geometry.writer
        try:
            plain = (data_page.dtype is writer.dtype and data_page.is_cpu and data_page.is_contiguous()
                     and data_page.numel() == writer.numel)
        except (AttributeError, RuntimeError):  # not a tensor, or one without strides (sparse)
            return False
        if plain:
            writer.write((key[-1] if geometry.lead else key).start, data_page.data_ptr())
        return plain

    @staticmethod
    def _reshaped_page(data_page, geometry, shape):
        """``data_page`` reshaped to ``shape`` (a view where its strides allow, else a copy, as
        SGLang's reshape): refused unless it is a tensor of exactly a page's elements, of the
        page's dtype (`get_dummy_flat_data_page`'s: raw bytes where the buffers' dtypes differ).
        Another dtype would be converted value by value - the page's bytes lost - where SGLang's
        pool converts it silently (docs/sglang.md); every SGLang back end passes the pool's own."""
        numel = getattr(data_page, "numel", None)
        if numel is None:
            raise TransferError(f"data_page must be a tensor, got {type(data_page).__name__}")
        import torch

        dtype = torch.uint8 if geometry.mixed else geometry.dtype
        if data_page.dtype != dtype:
            raise TransferError(f"data_page is {data_page.dtype}; a page of this pool is {dtype} (its bytes "
                                "would be converted value by value, not copied)")
        if numel() != geometry.total:
            raise TransferError(f"data_page has {numel()} elements; a page has {geometry.total}")
        return data_page.reshape(*shape)

    # -- zero-copy --------------------------------------------------------------------------
    def get_ksize_per_token(self) -> int:
        """Bytes of one token's K (MHA: half of ``size_per_token``; others: all of it)."""
        return self.geometry.size_per_token // 2 if self._kv_axis() is not None else self.geometry.size_per_token

    def _kv_axis(self):
        symbols = buffer_symbols(self.geometry.family, self.geometry.layout)
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
                        f"{type(self).__name__} ({self.geometry.layout}): a page is not one contiguous block per "
                        "K/V; zero-copy page pointers need layout page_first or page_first_direct"
                    )
                blocks.append(half)
        return blocks

    def _meta_kinds(self) -> list:
        """``(ptr of page 0, bytes from one page to the next, bytes)`` of each contiguous block of
        a page, in SGLang's order: per layer K then V for layer_first, K then V for the page
        layouts (MLA: one block, per layer for layer_first). Derived once from pages 0 and 1."""
        # keyed on what the pointers derive from - each buffer's address, bytes, shape and strides -
        # not on id(): a replaced kv_buffer can reuse a freed one's id(), and its pointers must move
        key = tuple((t.data_ptr(), t.untyped_storage().nbytes(), tuple(t.shape), t.stride()) for t in self.buffers)
        kinds = getattr(self, "_kinds", None)
        if kinds is not None and kinds[0] == key:
            return kinds[1]
        first = self._layer_blocks(0)
        second = self._layer_blocks(1) if self.geometry.page_num > 1 else first
        made = [(a.data_ptr(), b.data_ptr() - a.data_ptr(), a.numel() * a.element_size()) for a, b in zip(first, second)]
        self._kinds = (key, made)
        return made

    def _layer_blocks(self, page: int) -> list:
        family, layout = self.geometry.family, self.geometry.layout
        symbols = buffer_symbols(family, layout)
        token = min(symbols.index(s) for s in ("S", "N") if s in symbols)
        blocks = []
        for tensor in self.buffers:
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
                raise TransferError(f"{type(self).__name__} ({layout}): a page block is not contiguous; "
                                    "no zero-copy page pointers for this layout")
        return blocks

    def _meta_pages(self, indices) -> list:
        """The physical page of every logical page of ``indices`` (token indices covering whole
        pages, ints or an int tensor), each checked to start a page inside the pool: a raw pointer
        past the buffer would be a wild read or write in the back end."""
        self._alive()
        values = indices.tolist() if hasattr(indices, "tolist") else list(indices)
        if isinstance(values, int):
            values = [values]
        step = self.geometry.logical_page_size
        if len(values) % step:
            raise TransferError(f"{len(values)} indices are not whole pages of {step}")
        page_size = self.geometry.page_size
        pages = []
        for value in values[::step]:  # index tensors take `_meta_tensor`; this is lists and bad indices
            index = self._storage_index(value)
            if index % page_size:
                raise TransferError(f"index {value} does not start a page of {step}")
            pages.append(index // page_size)
        return pages

    def _meta_tensor(self, indices, kinds):
        """`get_page_buffer_meta` for a 1-D integer tensor: its page starts read once, then plain
        int arithmetic with the same checks as `_meta_pages` (a dozen torch ops per batch were a
        tenth of a 64 KiB-page L3 read: issue #51); None where the plain path must answer (DCP,
        an empty or odd-length tensor, a bad index - it raises the error naming it)."""
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

    def get_page_buffer_meta(self, indices):
        """Zero-copy pointers, as SGLang's pools compute them: for every page of ``indices``,
        each block of the page (`_meta_kinds`) as ``(ptr_list, size_list)`` of Python ints
        inside the registered host buffer. Every layout SGLang serves (layer_first: one block
        per layer and K/V)."""
        self._alive()
        kinds = self._meta_kinds()
        if hasattr(indices, "dim") and hasattr(indices, "div"):
            fast = self._meta_tensor(indices, kinds)
            if fast is not None:
                return fast
        pages = self._meta_pages(indices)
        if len(kinds) == 1:
            ((ptr, step, size),) = kinds
            return [ptr + page * step for page in pages], [size] * len(pages)
        ptrs = [ptr + page * step for page in pages for ptr, step, _ in kinds]
        return ptrs, [size for _, _, size in kinds] * len(pages)

    def is_stride_page_aligned(self, page_size_bytes: int = 4096, *, alignment: int | None = None) -> bool:
        """True when every page's blocks start on a multiple of ``page_size_bytes`` (what
        O_DIRECT and RDMA back ends need for zero-copy); always False for layer_first, as
        SGLang's. ``alignment``: the older keyword for the same number."""
        if alignment is not None:
            page_size_bytes = alignment
        if self.geometry.layout not in ("page_first", "page_first_direct", "page_head") or self.kv_buffer is None:
            return False
        try:
            kinds = self._meta_kinds()
        except TransferError:
            return False
        return all(ptr % page_size_bytes == 0 and step % page_size_bytes == 0 for ptr, step, _ in kinds)
