"""Small flat L3 pages written by the C helper's streaming stores and read by its gather
(hicache/pools/_page_writes.py, issue #35 item 3): the blocks it derives are what torch's flatten
reads, every pool layout writes and reads the same bytes through it as through torch, pages over
HELPER_MAX_BYTES go by torch both ways, and a source or a buffer it cannot prove is left to
torch's path or refused - never a wild copy."""

from __future__ import annotations

import contextlib

import pytest
from hypothesis import example, given

from hicache.effects import CopyEngine
from hicache.effects._copy import _host_copy
from hicache.errors import TransferError
from hicache.pools._page_writes import HELPER_MAX_BYTES, page_reader, page_writer, runs

from strategies import strided_views
from test_pools import CASES, P, make

torch = pytest.importorskip("torch")


@given(strided_views())
@example(((2, 3, 4), [(0, 2), (1, 1), (0, 4)], (0, 1, 2)))  # a layer_first page: one token run per K/V
@example(((2, 0, 4), [(0, 2), (0, 0), (0, 4)], (0, 1, 2)))  # an empty view: no runs
@example(((3, 4), [(0, 3), (0, 4)], (1, 0)))  # a transposed view: runs of one element
def test_the_runs_of_a_view_are_what_its_flatten_reads(view):
    """`runs`: the elements at the runs' offsets (from the view's first element), back to back,
    are ``view.flatten()`` - for views narrowed on any dims and permuted (torch is the oracle)."""
    shape, narrows, order = view
    buffer = torch.arange(torch.Size(shape).numel(), dtype=torch.int64).view(shape)
    viewed = buffer
    for axis, (start, length) in enumerate(narrows):
        viewed = viewed.narrow(axis, start, length)
    viewed = viewed.permute(*order)
    flat = buffer.reshape(-1)
    got = [flat[viewed.storage_offset() + offset: viewed.storage_offset() + offset + length]
           for offset, length in runs(viewed.shape, viewed.stride())]
    assert torch.equal(torch.cat(got) if got else torch.empty(0, dtype=torch.int64), viewed.flatten())
    assert all(length > 0 for _, length in runs(viewed.shape, viewed.stride()))


def _random_bytes(tensor, seed: int) -> None:
    tensor.view(torch.uint8).random_(0, 256, generator=torch.Generator().manual_seed(seed))


def _same(a, b) -> bool:
    return torch.equal(a.view(torch.uint8), b.view(torch.uint8))


@contextlib.contextmanager
def _helper_and_torch(name, layout):
    """Two pools of one case holding the same random bytes: one copying through the C helper
    where it is built, one through torch (``HICACHE_HOST_COPY=python``'s engine)."""
    helper, _ = make(name, layout)
    plain, _ = make(name, layout, copy_engine=CopyEngine(host_copy_mode="python"))
    try:
        for pool in (helper, plain):
            for seed, buffer in enumerate(pool.buffers):
                _random_bytes(buffer, seed)
        yield helper, plain
    finally:
        helper.destroy()
        plain.destroy()


@pytest.mark.parametrize("name, layout", CASES, ids=[f"{n}-{l}" for n, l in CASES])
def test_every_layout_writes_the_bytes_torchs_assignment_writes(name, layout):
    """Pages written where the helper is built (the streaming writer) and through torch's
    assignment (``HICACHE_HOST_COPY=python``'s engine) leave every buffer byte-identical: the
    first, a middle and the last page, from a flat page and from a 2-D one of its elements;
    the writer is in place exactly where the helper is built and the page is at most
    HELPER_MAX_BYTES."""
    with _helper_and_torch(name, layout) as (streamed, plain):
        page_bytes = streamed.get_dummy_flat_data_page().numel() * streamed.get_dummy_flat_data_page().element_size()
        writes = _host_copy._native is not None and page_bytes <= HELPER_MAX_BYTES
        assert (streamed._l3.derive(streamed.kv_buffer).writer is not None) == writes
        assert plain._l3.derive(plain.kv_buffer).writer is None
        last = (streamed.size // streamed.page_size - 1) * streamed.page_size
        for seed, index in enumerate((0, (streamed.size // 2) // streamed.page_size * streamed.page_size, last)):
            page = streamed.get_dummy_flat_data_page()
            _random_bytes(page, 100 + seed)
            for source in (page, page.view(2, -1) if page.numel() % 2 == 0 else page):
                for pool in (streamed, plain):
                    pool.set_from_flat_data_page(index, source)
                assert all(_same(a, b) for a, b in zip(streamed.buffers, plain.buffers)), (index, source.shape)
                assert _same(streamed.get_data_page(index), page)


@pytest.mark.parametrize("name, layout", CASES, ids=[f"{n}-{l}" for n, l in CASES])
def test_every_layout_reads_the_bytes_torchs_flatten_reads(name, layout):
    """``get_data_page(flat=True)`` where the helper is built and through torch (the python
    engine) give the same bytes for the first, a middle and the last page; the gather reads
    exactly where a page is one buffer's, in several blocks and at most HELPER_MAX_BYTES (else
    torch: a view for a one-block page, as SGLang's); its page is a new contiguous tensor - a
    write to it leaves the pool as it was."""
    with _helper_and_torch(name, layout) as (read, plain):
        view = read.get_data_page(0, flat=False)
        gathers = (_host_copy._native is not None and not isinstance(view, list) and not view.is_contiguous()
                   and view.numel() * view.element_size() <= HELPER_MAX_BYTES)
        assert (read._l3.derive(read.kv_buffer).reader is not None) == gathers
        assert plain._l3.derive(plain.kv_buffer).reader is None
        last = (read.size // read.page_size - 1) * read.page_size
        for index in (0, (read.size // 2) // read.page_size * read.page_size, last, last + read.page_size - 1):
            page = read.get_data_page(index, flat=True)
            assert page.is_contiguous() and _same(page, plain.get_data_page(index, flat=True)), index
            if gathers:
                before = [b.clone() for b in read.buffers]
                page.view(torch.uint8).fill_(0xA5)
                assert all(_same(a, b) for a, b in zip(before, read.buffers)), "the gathered page shares the pool"


@pytest.mark.parametrize("name, layout", [("mha", "layer_first"), ("mla", "page_first"), ("mamba", "page_first")])
def test_a_source_the_writer_cannot_prove_is_copied_by_torch_or_refused_with_nothing_written(name, layout):
    """Only a contiguous CPU tensor of a page's dtype and elements is streamed: a meta tensor
    (no CPU bytes; its data pointer is not memory) is refused by torch's path, the pool's bytes
    unchanged; a broadcast view (stride 0, the right count) is copied by torch as SGLang's
    reshape would, element order kept; a page one element short is the TransferError naming it."""
    pool, _ = make(name, layout)
    try:
        for seed, buffer in enumerate(pool.buffers):
            _random_bytes(buffer, seed)
        before = [b.clone() for b in pool.buffers]
        dummy = pool.get_dummy_flat_data_page()
        with pytest.raises((TransferError, NotImplementedError, RuntimeError)):
            pool.set_from_flat_data_page(P, torch.empty(dummy.shape, dtype=dummy.dtype, device="meta"))
        with pytest.raises(TransferError, match=f"data_page has {dummy.numel() - 1} elements"):
            pool.set_from_flat_data_page(P, dummy[1:])
        assert all(_same(a, b) for a, b in zip(before, pool.buffers)), "a refused page was written"
        one = dummy[:1].clone()
        _random_bytes(one, 9)
        broadcast = one.expand(dummy.numel())
        assert not broadcast.is_contiguous()
        pool.set_from_flat_data_page(P, broadcast)
        assert _same(pool.get_data_page(P), broadcast.contiguous())
    finally:
        pool.destroy()


def test_the_writer_refuses_pages_that_are_not_page_zero_moved_along_the_buffer():
    """`page_writer` proves its pattern for the last page before any write: a last page that is
    not page 0 moved by the axis's stride, or whose blocks would end past the buffer (a view of
    a larger storage included), is a TransferError naming the addresses (whether or not the
    helper is built)."""
    buffer = torch.zeros(2, 8, 4, 3, dtype=torch.bfloat16)  # K/V x tokens x heads x dims, pages of 2 tokens
    first, last = buffer[:, 0:2], buffer[:, 6:8]
    engine = CopyEngine()
    kw = dict(dtype=torch.bfloat16, numel=first.numel())
    writer = page_writer([buffer], [first], [last], 6, 1, engine, **kw)
    assert (writer is not None) == (_host_copy._native is not None)
    with pytest.raises(TransferError, match="expected"):
        page_writer([buffer], [first], [buffer[:, 4:6]], 6, 1, engine, **kw)  # last page where page 2 is
    short = buffer[:, :7]  # the pattern steps to token 6, whose page would run past token 7
    with pytest.raises(TransferError, match="last block ends"):
        page_writer([short], [short[:, 0:2]], [buffer[:, 6:8]], 6, 1, engine, **kw)
    with pytest.raises(TransferError, match="flat page is"):
        page_writer([buffer], [first], [last], 6, 1, engine, dtype=torch.bfloat16, numel=first.numel() + 1)


def test_a_page_over_the_helpers_cap_is_written_by_torch():
    """A page of more than HELPER_MAX_BYTES gets no writer (torch's assignment, on all its
    threads, writes it: the helper's one thread read a flat page torch had just made on two cores
    at 0.50-0.57x); one of exactly the cap gets the helper's where it is built."""
    tokens = HELPER_MAX_BYTES // (2 * 4 * 3 * 2)  # the most tokens of 2 (K/V) x 4 heads x 3 dims of bf16 within the cap
    for page, writes in ((tokens, _host_copy._native is not None), (tokens + 1, False)):
        buffer = torch.zeros(2, 4 * page, 4, 3, dtype=torch.bfloat16)
        first, last = buffer[:, 0:page], buffer[:, 3 * page:4 * page]
        writer = page_writer([buffer], [first], [last], 3 * page, 1, CopyEngine(), dtype=torch.bfloat16,
                             numel=first.numel())
        assert (writer is not None) == writes, page


def test_the_reader_proves_its_pattern_and_leaves_one_block_and_large_pages_to_torch():
    """`page_reader` proves its blocks as the writer does (a last page that is not page 0 moved
    along the axis, or that runs past the buffer, is a TransferError naming the addresses); a
    page in one block (a view) or over HELPER_MAX_BYTES gets no reader; a page it reads is the
    flatten of that page."""
    buffer = torch.arange(2 * 8 * 4 * 3, dtype=torch.float32).view(2, 8, 4, 3)  # K/V x tokens x heads x dims
    first, last = buffer[:, 0:2], buffer[:, 6:8]
    engine = CopyEngine()
    reader = page_reader(buffer, first, last, 6, 1, engine)
    assert (reader is not None) == (_host_copy._native is not None)
    if reader is not None:
        assert torch.equal(reader(4), buffer[:, 4:6].flatten())
    assert page_reader(buffer, first, last, 6, 1, CopyEngine(host_copy_mode="python")) is None
    with pytest.raises(TransferError, match="expected"):
        page_reader(buffer, first, buffer[:, 4:6], 6, 1, engine)
    short = buffer[:, :7]
    with pytest.raises(TransferError, match="last block ends"):
        page_reader(short, short[:, 0:2], buffer[:, 6:8], 6, 1, engine)
    whole = buffer.view(16, 4, 3)  # pages of 2 tokens in one block each: torch's view
    assert page_reader(whole, whole[0:2], whole[14:16], 14, 0, engine) is None
    large = torch.zeros(2, 4, HELPER_MAX_BYTES // 8 + 1, dtype=torch.float32)  # a 2-token page > the cap
    assert page_reader(large, large[:, 0:2], large[:, 2:4], 2, 1, engine) is None
