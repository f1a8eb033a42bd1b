"""Small flat L3 pages copied between a pool and a flat tensor by the C copy helper, in one call on
the calling thread: written into the pool with streaming stores (`page_writer`) and read out by
one gather (`page_reader`), where torch's per-call set-up costs more than the copy. Pages over
`HELPER_MAX_BYTES` go by torch's copy, on all its threads, in both directions - as SGLang's own
pool copies them.

A page of most layouts is a few strided blocks of the pool's buffer (MHA layer_first: K and V of
every layer, 2 x layers blocks). A page written from L3 is not read by this CPU again soon - it
goes to the GPU, or back to L3 - so the writer's non-temporal stores skip the read-for-ownership
of every destination line that torch's assignment does. Small pages: K-only's 32 KiB page
(issue #35 item 3, bench_sglang_pools: get + set 1.3-1.5x SGLang's pool).

The blocks of page 0 are derived once per buffer from torch's own view of the page (`runs`, in
the row-major order `flatten` reads), and proved inside the buffer for its last page;
page p is those blocks moved by p pages' worth of the cut axis's stride. A pool of several
buffers (Mamba's states) has one such pattern per buffer, all written in one call. A source is
copied this way only when it is a contiguous CPU tensor of the page's dtype and element count - its bytes
are then exactly the flat page - and everything else takes torch's path, which reshapes or
refuses (`StoragePagesMixin.set_from_flat_data_page`). Without the helper (no compiler), or
with ``HICACHE_HOST_COPY=python``, there is no writer and torch's assignment copies every page.

Reading a page out (`get_data_page(flat=True)`) is torch's ``flatten()`` - a view where the page
is one block, else a copy - except for a small page of one buffer in several blocks: there torch's
per-call set-up costs more than the copy, and the helper gathers the same blocks (the same proof)
into a new tensor in one call. The flat page is read again at once (written to a file, a store),
so these are plain stores. Nothing else is read this way (no writer, no reader: torch copies).
"""

from __future__ import annotations

from typing import Callable, NamedTuple

from hicache.errors import TransferError

MAX_RUNS = 4096  # a page in more blocks than this is not a layout SGLang serves: torch copies it
# (blocks under 256 bytes go by memcpy in the helper, not streamed: still one call, not torch's per-page set-up)
#: The largest flat page the helper copies, either way, not torch: below it torch's per-call set-up
#: dominates (a 32 KiB page in 8 blocks, K-only layer_first: read in 2.0 vs 3.9 us on 2 cores).
#: From 144 KiB torch's copy - on all its threads - is as fast or faster read alone (9.6 vs 10.1
#: us; 512 KiB: 22.3 vs 25.2 us), and a large page written by the helper's one thread read at
#: 0.50-0.57x SGLang's pool in some processes (MHA's 512 KiB pages, Mamba's slots; bench_sglang_pools'
#: get + set): the flat page had just been made by torch's copy on two cores, half of its lines
#: dirty in the other core's cache - with torch on one thread the same row read 1.17x, and by
#: torch's assignment (its threads read back what they wrote) 0.96-1.05x in every process.
HELPER_MAX_BYTES = 64 * 2**10


class PageWriter(NamedTuple):
    write: Callable  # (start, src_base) -> None: the page starting `start` units along the cut axis
    dtype: object  # of a flat page this writer takes (uint8 where the buffers' dtypes differ)
    numel: int  # elements of a flat page


def runs(shape, strides) -> list[tuple[int, int]]:
    """``[(offset, length)]`` in elements: the contiguous runs of a strided view, in the
    row-major order its ``flatten()`` reads them (one run for a contiguous view; an empty list
    for an empty one). Trailing dims are merged while each steps by the next one's extent."""
    dims = [(size, stride) for size, stride in zip(shape, strides) if size != 1]
    if any(size == 0 for size, _ in dims):
        return []
    length, inner = 1, len(dims)
    while inner and dims[inner - 1][1] == length:  # the contiguous tail: one run per outer index
        length *= dims[inner - 1][0]
        inner -= 1
    offsets = [0]
    for size, stride in dims[:inner]:
        offsets = [base + i * stride for base in offsets for i in range(size)]
    return [(offset, length) for offset in offsets]


def _blocks(buffers, firsts, lasts, last_start: int, axis: int, *, dtype, numel: int):
    """Per buffer ``(dst_offsets, src_offsets, sizes, base, step)``: page 0's blocks in the
    buffer (bytes from ``base``, page p ``p * step`` further on) and where each sits in a flat
    page of ``dtype`` x ``numel``; None for a page in no block or too many. Raises `TransferError`
    if the views are not what the pattern assumes (a page further on is not page 0 moved along
    the axis, or leaves its buffer, or the flat page is not the pages' bytes)."""
    import torch

    parts, src_start = [], 0
    for buffer, first, last in zip(buffers, firsts, lasts):
        element = buffer.element_size()
        pattern = runs(first.shape, first.stride())
        if not pattern or len(pattern) > MAX_RUNS:
            return None
        step = buffer.stride(axis) * element
        base = first.data_ptr()
        # the buffer's own span, not its storage's: buffers carved from one mapping share a storage
        lowest = buffer.data_ptr()
        highest = lowest + (sum((size - 1) * stride for size, stride in zip(buffer.shape, buffer.stride())) + 1) * element
        end = base + last_start * step + max(offset + length for offset, length in pattern) * element
        if last.data_ptr() != base + last_start * step or base < lowest or end > highest:
            raise TransferError(f"{type(buffer).__name__} pages are not page 0's blocks moved along the buffer "
                                f"(last page at {last.data_ptr():#x}, expected {base + last_start * step:#x}; "
                                f"buffer [{lowest:#x}, {highest:#x}), last block ends {end:#x})")
        dst = torch.tensor([offset * element for offset, _ in pattern], dtype=torch.int64)
        sizes = torch.tensor([length * element for _, length in pattern], dtype=torch.int64)
        src = torch.cumsum(sizes, 0) - sizes + src_start  # the flat page: the runs back to back
        parts.append((dst, src, sizes, base, step))
        src_start += int(sizes.sum())
    if src_start != numel * dtype.itemsize:
        raise TransferError(f"a flat page is {numel} {dtype} elements; the buffers' pages hold {src_start} bytes")
    return parts


def page_writer(buffers, firsts, lasts, last_start: int, axis: int, copy_engine, *, dtype, numel: int):
    """The writer of the pages of ``buffers`` - ``firsts`` are page 0's views (one per buffer),
    ``lasts`` the last page's, which starts ``last_start`` units along the cut ``axis`` - taking
    flat pages of ``dtype`` and ``numel`` elements (each buffer's part back to back, as
    `get_data_page` builds them), or None where torch's assignment is the way: a page over
    `HELPER_MAX_BYTES`, no streaming copier in ``copy_engine``, or a page in too many blocks.
    Raises `TransferError` as `_blocks`."""
    if numel * dtype.itemsize > HELPER_MAX_BYTES:
        return None
    parts = _blocks(buffers, firsts, lasts, last_start, axis, dtype=dtype, numel=numel)
    if parts is None:
        return None
    write = copy_engine.streaming_copier(parts)
    return None if write is None else PageWriter(write, dtype, numel)


def page_reader(buffer, first, last, last_start: int, axis: int, copy_engine):
    """``read(start)``: a new flat page (contiguous, ``first``'s dtype and elements) holding
    the page of ``buffer`` that starts ``start`` units along ``axis`` - gathered by the C helper
    in one call - or None where torch's ``flatten()`` is the way: a page in one block (it is a
    view then, as SGLang's), a page over `HELPER_MAX_BYTES`, no helper (``python`` mode).
    ``start`` must be a page start in range (the caller's index check): the pattern is proved
    inside the buffer for the last page (``last``, at ``last_start``), as the writer's."""
    numel = first.numel()
    pattern = runs(first.shape, first.stride())
    if len(pattern) < 2 or numel * first.element_size() > HELPER_MAX_BYTES:
        return None
    parts = _blocks([buffer], [first], [last], last_start, axis, dtype=first.dtype, numel=numel)
    gather = None if parts is None else copy_engine.gathering_copier(parts[0])
    if gather is None:
        return None
    import torch

    empty, dtype = torch.empty, first.dtype

    def read(start: int):
        page = empty(numel, dtype=dtype)
        gather(start, page.data_ptr())
        return page

    return read
