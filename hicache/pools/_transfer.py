"""Page transfers between a host pool and a device pool: `Transfers`, the descriptors, the links.

Owns one pool's transfer state (`Transfers`: the index memo, host views, links, prepared
copies, and how a copy is named in errors) and the descriptors. Where one page of one layer is
a contiguous block on both sides (layer_first, page_first_direct, Mamba slots, DSA/V4 rows), a
transfer is a list of (dst, src, bytes) descriptors, kept as int64 tensors: consecutive pages
are coalesced, then handed to `hicache.effects.CopyEngine` in one batch (a host copy, or
cudaMemcpyBatchAsync on the current CUDA stream - this module makes no CUDA call). Other
layouts go through torch index operations.
"""

from __future__ import annotations

import math
from typing import NamedTuple

from hicache.errors import TransferError
from hicache.pools._blocks import (  # noqa: F401 - block_pattern: the tests reach it here
    BlockPattern, _pattern, block_pattern, block_unit, copy_blocks, copy_tokens, extent_bytes, strided_pieces,
)
from hicache.pools._indices import IndexMemo, check_indices

#: SGLang 0.5.23's io backends: both move the same bytes in every layout (sgl-kernel's `kernel` and
#: `direct` ops differ only in how); which engine moves them is hicache.plan._transfer's table's
IO_BACKENDS = ("direct", "kernel")


def check_backend(io_backend, layout: str, supported_layouts, *, error=TransferError, owner: str = "") -> None:
    """Refuse a backend/layout pair we do not implement, naming what is supported (``error``:
    a `LayoutError` when a pool is built, a `TransferError` at a transfer)."""
    if io_backend not in IO_BACKENDS or layout not in supported_layouts:
        pairs = ", ".join(f"{b}/{l}" for b in IO_BACKENDS for l in supported_layouts)
        raise error(
            f"{owner + ': ' if owner else ''}io_backend {io_backend!r} with layout {layout!r} is not supported; "
            f"supported: {pairs} "
            "(--hicache-io-backend kernel or direct)"
        )


class Descriptors:
    """(dst, src, bytes) copies collected over layers and streams, issued in one go. Each part
    is a block pattern (offsets) at a destination and a source base address: patterns are
    shared by every layer, so a layer costs no tensor arithmetic."""

    def __init__(self, engine=None, *, direction: str | None = None, registered=None) -> None:
        self.engine = engine  # a CopyEngine; None: a default one when first needed
        self.registered = registered  # () -> the host ranges registered now (a gather checks every piece)
        self.direction = direction  # "load" (host -> device) or "backup": the engine table's row
        self.parts: list[tuple] = []  # (pattern, dst base address, src base address)
        self.cuda = None  # the CUDA device when either side of a copy is on one
        self.keep: list = []  # the tensors the addresses point into, alive until issued
        self.total = 0  # bytes queued

    def add(self, dst, src, pattern: BlockPattern, *, where: str = "") -> None:
        """Queue ``pattern``'s copies from tensor ``src`` into tensor ``dst``, after checking
        that every block lies inside both tensors."""
        if not pattern.sizes.numel():
            return
        if pattern.total == 0 and pattern.dst_reach == 0:  # built elsewhere: measure it now
            pattern = _pattern(pattern.dst, pattern.src, pattern.sizes)
        for side, tensor, reach in (("destination", dst, pattern.dst_reach), ("source", src, pattern.src_reach)):
            if reach > extent_bytes(tensor):  # offsets are >= 0: ids are checked non-negative
                raise TransferError(
                    f"{where or 'copy'}: a block reaches byte {reach} of the {side} tensor, "
                    f"which holds {extent_bytes(tensor)} bytes (shape {tuple(tensor.shape)}): an index "
                    "past the end of a shorter layer or K/V tensor; nothing was copied"
                )
        self.total += pattern.total
        self.parts.append((pattern, dst.data_ptr(), src.data_ptr()))
        for tensor in (dst, src):
            if tensor.device.type == "cuda":
                self.cuda = tensor.device
        self.keep += [dst, src]

    def add_checked(self, pattern: BlockPattern, link: Link, where: "Where") -> None:
        """`add` for a link whose extents are known: two comparisons, one append."""
        if not pattern.total:
            return
        if pattern.dst_reach > link.dst_extent or pattern.src_reach > link.src_extent:
            self.add(link.dst, link.src, pattern, where=str(where))  # raises, naming it
        self.total += pattern.total
        self.parts.append((pattern, link.dst_ptr, link.src_ptr))
        if self.cuda is None and link.device.device.type == "cuda":
            self.cuda = link.device.device
        self.keep.append(link)

    def prepare(self):
        """The collected copies as one `PreparedCopy` (None when there are none)."""
        if not self.parts:
            return None
        if self.engine is None:
            from hicache.effects import CopyEngine

            self.engine = CopyEngine()
        parts = [(p.dst, p.src, p.sizes, p.total, dst_base, src_base) for p, dst_base, src_base in self.parts]
        return self.engine.prepare_parts(parts, device=self.cuda, direction=self.direction, registered=self.registered)


class Link:
    """One layer of one stream, both ways: the block views, the unit, the steps, how far each
    side reaches - all fixed while the device tensor is the same object at the same address
    and shape, so a fresh batch costs a pattern lookup and one descriptor part per layer."""

    __slots__ = ("host_view", "device", "device_ptr", "device_shape", "dst", "src", "unit", "dst_step",
                 "src_step", "dst_extent", "src_extent", "dst_ptr", "src_ptr", "whole_pages", "token_rows", "pieces")

    def fits(self, device) -> bool:
        return self.device is device and self.device_ptr == device.data_ptr() and self.device_shape == device.shape

    def copy(self, dst_ids, src_ids, descriptors: "Descriptors", patterns: dict, *, where, later: list) -> bool:
        """Queue ``dst[dst_ids[i]] = src[src_ids[i]]`` as descriptors (True), or - blocks not
        contiguous - as a torch-indexing copy appended to ``later`` (False): nothing is copied
        until every part of the transfer passed its bounds checks."""
        if dst_ids.numel() == 0:
            return True
        if self.unit is None:  # torch indexing: bounds-checked here, never an IndexError midway
            for side, tensor, ids in (("destination", self.dst, dst_ids), ("source", self.src, src_ids)):
                if int(ids.max()) >= tensor.shape[0]:
                    raise TransferError(
                        f"{where}: block {int(ids.max())} is past the end of the {side} "
                        f"tensor ({tensor.shape[0]} blocks); nothing was copied"
                    )
            later.append(lambda dst=self.dst, src=self.src: copy_blocks(dst, dst_ids, src, src_ids))
            return False
        key = (id(dst_ids), id(src_ids), self.dst_step, self.src_step, self.unit)
        pattern = patterns.get(key)
        if pattern is None:
            pattern = patterns[key] = block_pattern(dst_ids, self.dst_step, src_ids, self.src_step, self.unit)
        descriptors.add_checked(pattern, self, where)
        return True


def token_rows(host_view):
    """A ``(pages, page_size, *item)`` host view as ``(slots, *item)`` token rows, when the pages
    are evenly spaced token runs (every layout's are; None otherwise)."""
    if host_view.dim() < 2 or host_view.stride(0) != host_view.shape[1] * host_view.stride(1):
        return None
    return host_view.flatten(0, 1)


def make_link(host_view, device, page_size: int, *, rows: bool, to_host: bool, split_rows: bool = True) -> Link:
    link = Link()
    link.host_view, link.device = host_view, device
    link.device_ptr, link.device_shape = device.data_ptr(), device.shape
    link.whole_pages = rows or device.shape[0] % page_size == 0
    blocks = device if rows or not link.whole_pages else device.unflatten(0, (-1, page_size))
    link.dst, link.src = (host_view, blocks) if to_host else (blocks, host_view)
    link.unit = block_unit(link.dst, link.src)
    link.token_rows, link.pieces = False, None
    if link.unit is None and not rows and split_rows:  # a page is not one run (page_first: a token's layers are
        tokens = token_rows(host_view)  # together): copy token rows instead of indexing with torch
        if tokens is not None:
            dst, src = (tokens, device) if to_host else (device, tokens)
            unit = block_unit(dst, src)
            if unit is not None:
                link.dst, link.src, link.unit, link.token_rows = dst, src, unit, True
        if not link.token_rows:  # a token's row is several runs on the host (page_head): pieces of them
            link.pieces = strided_pieces(host_view, device, page_size)
    link.dst_step = link.dst.stride(0) * link.dst.element_size() if link.dst.dim() else 0
    link.src_step = link.src.stride(0) * link.src.element_size() if link.src.dim() else 0
    link.dst_extent, link.src_extent = extent_bytes(link.dst), extent_bytes(link.src)
    link.dst_ptr, link.src_ptr = link.dst.data_ptr(), link.src.data_ptr()
    return link


def piece_numbers(link: Link) -> tuple[int, ...]:
    """What every piece of ``link``'s copies is a sum or a multiple of - both base addresses, the
    steps, the piece sizes, per-head offsets - so the widest word dividing them all is the
    gather's word for any batch over it; () where torch indexing copies it (no gather)."""
    pieces = link.pieces
    if pieces is not None:
        return (link.dst_ptr, link.src_ptr, pieces.host_page, pieces.host_token, pieces.device_row, pieces.piece,
                *pieces.host_outer.tolist(), *pieces.device_outer.tolist())
    if link.unit is None:
        return ()
    return link.dst_ptr, link.src_ptr, link.dst_step, link.src_step, link.unit


class ReadyCopy(NamedTuple):
    """A transfer's checked, prepared copies, and the device tensors they were built from
    (kept alive, so their addresses stay valid; reused only while the pool hands out the very
    same tensors at the same addresses)."""

    device_tensors: tuple
    addresses: tuple
    prepared: object  # PreparedCopy or None

    def matches(self, tensors) -> bool:
        return all(a is b for a, b in zip(self.device_tensors, tensors)) and len(tensors) == len(self.device_tensors) and all(
            t.data_ptr() == address for t, address in zip(tensors, self.addresses)
        )


class Where(NamedTuple):
    """Names a copy in errors - layer (as SGLang numbers it), buffer, K or V - formatted only
    when an error needs it (a transfer names one per layer and stream)."""

    layer: int
    buffer: int
    kv: int | None

    def __str__(self) -> str:
        return f"layer {self.layer}, buffer {self.buffer}" + ("" if self.kv is None else f", {'KV'[self.kv]}")


class Transfers:
    """One pool's transfers: every check made before any byte moves, then one batch.

    ``host_view(stream, layer)``: the host side of one stream's layer; ``streams``: the pool's
    copy streams (``buffer``, ``kv``, ``device(device_pool, layer)``, ``rows``);
    ``host_slots``: the pool's token slots. Caches (views, links, prepared copies, the last
    indices) live here and go with `forget`.
    """

    def __init__(self, host_view, streams, *, page_size: int, host_slots: int, copy_engine, name: str,
                 ready_slots=None, registered=None) -> None:
        self.host_view = host_view
        self.ready_slots = ready_slots  # () -> the leading host slots registered now (a progressive pool)
        self.registered = registered  # () -> the (ptr, size) ranges the pool's handle holds registered
        self.streams = list(streams)
        self.page_size = page_size
        self.host_slots = host_slots
        self.copy_engine = copy_engine
        self.name = name
        self.memo = IndexMemo()  # indices of the last transfer, checked
        self._views: dict = {}  # (buffer, kv, layer) -> host view
        self._links: dict = {}  # (buffer, kv, layer, direction, device tensor) -> Link

    def forget(self) -> None:
        """Drop every cached view and copy (the pool's memory is going)."""
        self.memo.forget()
        self._views = {}
        self._links = {}

    def run(self, device_pool, host_indices, device_indices, layers, *, to_host: bool) -> None:
        """Copy the given slots of ``layers`` between the host buffers and ``device_pool``."""
        streams = self.streams
        first = self._device(device_pool, streams[0], 0)
        device_slots = first.shape[0] * (self.page_size if streams[0].rows else 1)
        host_slots = self.host_slots if self.ready_slots is None else self.ready_slots()
        try:
            checked = self.memo.check(
                host_indices, device_indices, host_slots=host_slots, device_slots=device_slots, page_size=self.page_size
            )
        except TransferError:
            if host_slots < self.host_slots:
                self._refuse_unready(host_indices, device_indices, host_slots, device_slots)
            raise
        device_tensors = tuple(self._device(device_pool, stream, layer) for layer in layers for stream in streams)
        key = (to_host, tuple(layers), id(device_pool))
        ready = checked.ready.get(key)
        if ready is not None and ready.matches(device_tensors):  # the same copies as last time
            if ready.prepared is not None:
                ready.prepared.run()
            return
        ready = self._build(checked, layers, device_tensors, to_host=to_host)
        if ready is not None:
            checked.ready[key] = ready

    def warm(self, device_pool):
        """At the pool's build, with the device pool it was given: the copy engine compiles the
        gather kernel for the word sizes this pool's batches will use, in the background
        (`CopyEngine.warm_gather`), so no transfer pays Triton's compile and a kernel that cannot
        build here shows now. Best effort: a device pool this one cannot copy with warms
        nothing (its first transfer says why). Returns the engine's thread, or None."""
        if device_pool is None:
            return None
        groups, device = [], None
        try:
            for stream in self.streams:  # layer 0 stands for every layer: the same steps and alignment
                dv = self._device(device_pool, stream, 0)
                for to_host in (False, True):
                    link = self._link(stream, 0, dv, to_host=to_host, where=Where(0, stream.buffer, stream.kv))
                    groups.append(piece_numbers(link))
                device = dv.device if dv.device.type == "cuda" else device
            return self.copy_engine.warm_gather(device, groups)
        except Exception:  # noqa: BLE001 - warming is an optimization; the transfer raises what is wrong
            return None

    def _refuse_unready(self, host_indices, device_indices, ready: int, device_slots: int) -> None:
        """Indices valid in the whole pool but past its registered slots: say so (a GPU must
        never read or write a range not yet registered; the DMA path would copy it unpinned)."""
        hidx, _ = check_indices(host_indices, device_indices, host_slots=self.host_slots, device_slots=device_slots)
        raise TransferError(
            f"{self.name}: host slot {int(hidx.max())} is not registered yet (progressive registration: slots "
            f"[0, {ready}) of {self.host_slots} are; pages come from alloc() only once ready, or wait_ready()); "
            "nothing was copied"
        )

    def _device(self, device_pool, stream, layer: int):
        """The device tensor of ``stream``'s ``layer``, or a TransferError naming what the device
        pool lacks (fewer layers, another family) - before anything is copied."""
        try:
            tensor = stream.device(device_pool, layer)
        except (AttributeError, IndexError, KeyError, TypeError) as error:
            raise TransferError(
                f"{self.name}: the device pool ({type(device_pool).__name__}) has no {Where(layer, stream.buffer, stream.kv)} "
                f"tensor this host pool copies ({type(error).__name__}: {error}); nothing was copied"
            ) from None
        if not hasattr(tensor, "dtype") or not hasattr(tensor, "shape") or tensor.dim() < 1:
            raise TransferError(f"{self.name}: {Where(layer, stream.buffer, stream.kv)} of the device pool is not a "
                                f"tensor of slots: {type(tensor).__name__}; nothing was copied")
        return tensor

    @staticmethod
    def _check_matches(where, hv, dv, *, rows: bool) -> None:
        """The device tensor holds what the host view holds: the dtype, and as many elements per
        slot (row) - checked for every layer before the first byte moves (a later layer of
        another dtype once left the earlier ones copied)."""
        item = tuple(hv.shape[1:] if rows else hv.shape[2:])
        if dv.dtype != hv.dtype:
            raise TransferError(f"{where}: the device tensor is {dv.dtype}, the host pool holds {hv.dtype}; "
                                "nothing was copied")
        if math.prod(dv.shape[1:]) != math.prod(item):
            raise TransferError(
                f"{where}: a device {'row' if rows else 'slot'} holds {math.prod(dv.shape[1:])} elements "
                f"{tuple(dv.shape[1:])}, the host pool's {math.prod(item)} {item} (more heads, another "
                "model?); nothing was copied"
            )

    def _link(self, stream, layer: int, dv, *, to_host: bool, where) -> Link:
        """How one layer of one stream copies (block views, unit, steps, extents), cached per
        host view and device tensor - rebuilt, and the device tensor checked against the host
        view (`_check_matches`), when it is new, moved or changed shape."""
        hv = self._views.get((stream.buffer, stream.kv, layer))
        if hv is None:  # views of the pool's own buffers: made once, dropped by forget()
            hv = self._views[(stream.buffer, stream.kv, layer)] = self.host_view(stream, layer)
        key = (stream.buffer, stream.kv, layer, to_host, id(dv))
        link = self._links.get(key)
        if link is None or not link.fits(dv):
            self._check_matches(where, hv, dv, rows=stream.rows)  # before any copy of this transfer
            engine = self.copy_engine  # per-row memmove (no C helper, on CPU) is slower than torch indexing
            split = dv.device.type == "cuda" or engine.host_copy_mode == "native" or engine.transfer == "gather"
            link = self._links[key] = make_link(hv, dv, self.page_size, rows=stream.rows, to_host=to_host,
                                                split_rows=split)
        return link

    def _build(self, checked, layers, device_tensors, *, to_host: bool):
        """Check and issue one transfer; return it prepared for reuse (None when part of it
        went through torch indexing, which is not reusable)."""
        hidx, didx, hpages, dpages = checked.hidx, checked.didx, checked.hpages, checked.dpages
        patterns = checked.patterns
        batch = Descriptors(self.copy_engine, direction="backup" if to_host else "load",
                            registered=self.registered)  # issued together
        later: list = []  # torch-indexing copies: run only once every part passed its checks
        reusable = True
        tensors = iter(device_tensors)
        for layer in layers:
            for stream in self.streams:
                dv = next(tensors)
                where = Where(layer, stream.buffer, stream.kv)
                link = self._link(stream, layer, dv, to_host=to_host, where=where)
                if link.token_rows:  # one descriptor per token row (coalesced where rows are adjacent)
                    dst_ids, src_ids = (hidx, didx) if to_host else (didx, hidx)
                    reusable &= link.copy(dst_ids, src_ids, batch, patterns, where=where, later=later)
                elif link.pieces is not None:  # each token's runs as descriptors (page_head)
                    key = (id(hidx), id(didx), to_host, link.pieces.signature)
                    pattern = patterns.get(key)
                    if pattern is None:
                        pattern = patterns[key] = link.pieces.pattern(hidx, didx, to_host=to_host)
                    batch.add_checked(pattern, link, where)
                elif stream.rows or (hpages is not None and dpages is not None and link.whole_pages):
                    if hpages is None or dpages is None:
                        raise TransferError(f"{self.name} moves whole pages: indices must be page-aligned runs")
                    dst_ids, src_ids = (hpages, dpages) if to_host else (dpages, hpages)
                    reusable &= link.copy(dst_ids, src_ids, batch, patterns, where=where, later=later)
                else:
                    if didx.numel() and int(didx.max()) >= dv.shape[0]:
                        raise TransferError(
                            f"{where}: device index {int(didx.max())} is past the end of "
                            f"that tensor ({dv.shape[0]} slots); nothing was copied"
                        )
                    later.append(lambda hv=link.host_view, dv=dv: copy_tokens(hv, hidx, dv, didx, self.page_size,
                                                                              to_host=to_host))
                    reusable = False
        for copy in later:
            copy()
        prepared = batch.prepare()
        if prepared is not None:
            prepared.run()
        if not reusable:
            return None
        return ReadyCopy(device_tensors, tuple(t.data_ptr() for t in device_tensors), prepared)
