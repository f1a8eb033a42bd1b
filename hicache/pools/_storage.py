"""Host pages for L3 storage back ends (SGLang's file, mooncake, nixl, hf3fs, ... back ends).

Owns what those back ends call on a host pool: flat pages (`get_data_page`,
`set_from_flat_data_page`, `get_dummy_flat_data_page`) in the bytes order of SGLang's own pools
(a page slice of the buffer, flattened in the buffer's dims), so an L3 store is shared with stock
SGLang; and zero-copy page pointers (`get_page_buffer_meta`, `get_ksize_per_token`,
`is_stride_page_aligned`). Indices may be ints or 0-d integer tensors, as SGLang passes them.
`L3Pages` is the part that does the flat pages (`_zero_copy.PagePointers` the pointers), over the
pool's geometry, copy engine and state check given at construction and the pool's buffers handed
to each call (a pool's ``kv_buffer`` may be replaced: the pages follow it); `StoragePagesMixin`
is SGLang's names for them on the pool.
"""

from __future__ import annotations

import operator
from typing import NamedTuple

from hicache.errors import RegistrationStateError, TransferError
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


def storage_index(geometry, index) -> int:
    """A token index of the pool's logical space -> this rank's physical token index (SGLang's
    DCP rule: a logical page start / ``dcp_size``), checked against the pool (``geometry``)."""
    if type(index) is not int:
        index = as_index(index, "page index")
    dcp = geometry.dcp_size
    if dcp > 1:
        if index < 0 or index % geometry.logical_page_size:
            raise TransferError(f"page index {index} is not a logical page start (DCP pages of "
                                f"{geometry.logical_page_size})")
        index //= dcp
    if not 0 <= index < geometry.size:
        raise TransferError(f"page index {index!r} out of range [0, {geometry.size})")
    return index


def kv_axis(geometry):
    """The axis of a page's K/V halves in the pool's buffers (MHA's), or None (one block)."""
    symbols = buffer_symbols(geometry.family, geometry.layout)
    return symbols.index("2") if "2" in symbols else None


def listed(kv_buffer, name: str) -> list:
    """A pool's ``kv_buffer`` (one tensor or a list) as a list; None: the pool ``name`` was destroyed."""
    if kv_buffer is None:
        raise RegistrationStateError(f"{name} was destroyed")
    return kv_buffer if isinstance(kv_buffer, list) else [kv_buffer]


class L3Pages:
    """A part of a host pool (issue #55 item 1): its L3 pages and zero-copy pointers over what it
    is given - the pool's ``geometry`` (family, layout, page, sizes, DCP), its ``copy_engine``
    (the streaming page write and small pages' gather) and its state check (``alive``) - and
    the pool's ``kv_buffer`` handed to each call. How a page sits in the buffers is derived once
    per buffer (`derive`, on the hot path: a page is read and written per L3 page) and dropped
    when the pool is destroyed (`close`)."""

    def __init__(self, name: str, geometry, copy_engine, alive) -> None:
        self.name, self.geometry, self.copy_engine, self.alive = name, geometry, copy_engine, alive
        self.derived: _PageGeometry | None = None  # a live pool's only (`derive` checks, `close` drops)

    def derive(self, kv_buffer) -> _PageGeometry:
        """How a page sits in each buffer of ``kv_buffer`` and what its flat form is, derived once
        per set of buffers (a page is read and written per L3 page: this is on the hot path)."""
        cached = self.derived
        if cached is not None and cached.key is kv_buffer:
            return cached
        self.alive()  # the one check of the pool's state: a destroyed or leaked pool has no geometry
        if kv_buffer is None:
            raise TransferError(f"{self.name} is allocator-only (is_dummy): it holds no pages")
        buffers = listed(kv_buffer, self.name)
        pool = self.geometry
        family, layout, page_size = pool.family, pool.layout, pool.page_size
        axes = [page_axis(t, family, layout) for t in buffers]
        parts = [page_slice(t, family, layout, 0, page_size) for t in buffers]
        mixed = len({p.dtype for p in parts}) > 1
        sizes = tuple(p.numel() * (p.element_size() if mixed else 1) for p in parts)
        if len(set(axes)) != 1:
            raise TransferError(f"{self.name}: its buffers cut pages on different axes {axes}")
        (axis, by_page), = set(axes)
        writer = reader = None
        engine = self.copy_engine
        pages, tail = divmod(pool.size, page_size)
        if engine is not None and pages and not tail:  # every index in range is in a whole page
            import torch

            lasts = [page_slice(t, family, layout, pages - 1, page_size) for t in buffers]
            last_start = pages - 1 if by_page else (pages - 1) * page_size
            writer = page_writer(buffers, parts, lasts, last_start, axis, engine,
                                 dtype=torch.uint8 if mixed else parts[0].dtype, numel=sum(sizes))
            if len(buffers) == 1:
                reader = page_reader(buffers[0], parts[0], lasts[0], last_start, axis, engine)
        made = _PageGeometry(kv_buffer, tuple(buffers), (slice(None),) * axis, by_page, mixed, sizes,
                             sum(sizes), None if mixed else parts[0].dtype, tuple(tuple(p.shape) for p in parts),
                             page_size, pool.size, pool.dcp_size == 1, writer, reader)
        self.derived = made
        return made

    def close(self) -> None:
        """No page access from here on without `alive()`'s check (destroy calls it first): the
        derived geometry, the page path's proof that the pool was live, is dropped."""
        self.derived = None

    def page_at(self, kv_buffer, index):
        """(geometry, key) of the page holding token ``index`` - the key is the index into each
        buffer that selects it: the L3 page path's one entry, called per page (one function, no
        further calls in the common case). A derived geometry exists only while the pool is live
        (`derive` checks, `close` drops it), so the common case - a live pool, an int index in
        range - is two tests; a refused pool or a bad index takes the long way, which raises
        naming why."""
        geometry = self.derived
        if geometry is None or geometry.key is not kv_buffer:
            geometry = self.derive(kv_buffer)
        page_size = geometry.page_size
        if type(index) is int and 0 <= index < geometry.size and geometry.direct:  # the common case
            page = index // page_size
        else:
            page = storage_index(self.geometry, index) // page_size
        cut = slice(page, page + 1) if geometry.by_page else slice(page * page_size, (page + 1) * page_size)
        # basic slicing, torch's fast path: a bare slice on axis 0 (a 1-tuple, or narrow(), costs
        # half as much again per page); fewer slices than SGLang's [:, :, a:b, :, :] cost less
        lead = geometry.lead
        return geometry, (lead + (cut,) if lead else cut)

    def page_parts(self, kv_buffer, index) -> list:
        geometry, key = self.page_at(kv_buffer, index)
        return [t[key] for t in geometry.tensors]

    def get(self, kv_buffer, index, flat: bool = True):
        """The page holding token ``index`` (all layers, K and V); flat: one 1-D tensor (a view
        where the page is contiguous - MLA page-first - as SGLang's)."""
        geometry, key = self.page_at(kv_buffer, index)
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

    def dummy(self, kv_buffer):
        """A contiguous 1-D tensor shaped like one flat page (zeros)."""
        import torch

        geometry = self.derive(kv_buffer)
        return torch.zeros(geometry.total, dtype=torch.uint8 if geometry.mixed else geometry.dtype)

    def put(self, kv_buffer, index, data_page) -> None:
        """Write a page produced by `get` back at token ``index``."""
        geometry, key = self.page_at(kv_buffer, index)
        if geometry.writer is not None and written(geometry, key, data_page):
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
                source = _reshaped_page(data_page, geometry, shape)
            if source.dtype is not geometry.dtype:  # the assignment would convert it value by value
                _reshaped_page(data_page, geometry, shape)  # raises, naming both dtypes
            geometry.tensors[0][key] = source
            return
        flat = _reshaped_page(data_page, geometry, (-1,))  # cut by element counts: a view where it can be
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

    def page_blocks(self, kv_buffer, index) -> list:
        """The contiguous byte blocks of one page: K and V for MHA, one for MLA."""
        blocks = []
        axis = kv_axis(self.geometry)
        for part in self.page_parts(kv_buffer, index):
            halves = [part.select(axis, 0), part.select(axis, 1)] if axis is not None else [part]
            for half in halves:
                if not half.is_contiguous():
                    raise TransferError(
                        f"{self.name} ({self.geometry.layout}): a page is not one contiguous block per "
                        "K/V; zero-copy page pointers need layout page_first or page_first_direct"
                    )
                blocks.append(half)
        return blocks


def written(geometry, key, data_page) -> bool:
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


def _reshaped_page(data_page, geometry, shape):
    """``data_page`` reshaped to ``shape`` (a view where its strides allow, else a copy, as
    SGLang's reshape): refused unless it is a tensor of exactly a page's elements, of the page's
    dtype (`L3Pages.dummy`'s: raw bytes where the buffers' dtypes differ). Another dtype would be
    converted value by value - the page's bytes lost - where SGLang's pool converts it silently
    (docs/sglang.md); every SGLang back end passes the pool's own."""
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


class StoragePagesMixin:
    """SGLang's L3 page calls on a `HostKVCache`, each handed to its part - `L3Pages` for flat
    pages, `_zero_copy.PagePointers` for zero-copy pointers - with the pool's ``kv_buffer`` as it
    is now."""

    #: the pool's state these calls read (tests/test_import_rules.py): the part, the buffers it
    #: is handed, and MHA's split-heads meta for a split factor other than 1
    NEEDS = ("_l3", "_pointers", "kv_buffer", "buffers", "get_split_heads_page_buffer_meta")

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

    def get_data_page(self, index, flat: bool = True):
        """The page holding token ``index`` (all layers, K and V); flat: one 1-D tensor (a view
        where the page is contiguous - MLA page-first - as SGLang's)."""
        return self._l3.get(self.kv_buffer, index, flat)

    def get_dummy_flat_data_page(self):
        """A contiguous 1-D tensor shaped like one flat page (zeros), for back ends that read
        into a buffer before `set_from_flat_data_page`."""
        return self._l3.dummy(self.kv_buffer)

    def set_from_flat_data_page(self, index, data_page) -> None:
        """Write a page produced by `get_data_page` back at token ``index``."""
        self._l3.put(self.kv_buffer, index, data_page)

    def get_ksize_per_token(self) -> int:
        """Bytes of one token's K (MHA: half of ``size_per_token``; others: all of it)."""
        return self._pointers.ksize_per_token()

    def get_page_buffer_meta(self, indices):
        """Zero-copy pointers, as SGLang's pools compute them: for every page of ``indices``,
        each block of the page as ``(ptr_list, size_list)`` of Python ints inside the registered
        host buffer. Every layout SGLang serves (layer_first: one block per layer and K/V)."""
        return self._pointers.meta(self.kv_buffer, indices)

    def is_stride_page_aligned(self, page_size_bytes: int = 4096, *, alignment: int | None = None) -> bool:
        """True when every page's blocks start on a multiple of ``page_size_bytes`` (what
        O_DIRECT and RDMA back ends need for zero-copy); always False for layer_first, as
        SGLang's. ``alignment``: the older keyword for the same number."""
        return self._pointers.stride_aligned(self.kv_buffer, page_size_bytes if alignment is None else alignment)
