"""Page transfers between a host pool and a device pool: validation and the copy engine.

Owns the checks on indices and layer ids, and the descriptors. Where one page of one layer is
a contiguous block on both sides (layer_first, page_first_direct, Mamba slots, DSA/V4 rows), a
transfer is a list of (dst, src, bytes) descriptors, kept as int64 tensors: consecutive pages
are coalesced, then handed to `hicache.effects.CopyEngine` in one batch (a host copy, or
cudaMemcpyBatchAsync on the current CUDA stream - this module makes no CUDA call). Other
layouts go through torch index operations.
"""

from __future__ import annotations

from typing import NamedTuple

from hicache.errors import TransferError

IO_BACKENDS = ("direct",)


def check_backend(io_backend: str, layout: str, supported_layouts) -> None:
    """Refuse a backend/layout pair we do not implement, naming what is supported."""
    if io_backend not in IO_BACKENDS or layout not in supported_layouts:
        pairs = ", ".join(f"{b}/{l}" for b in IO_BACKENDS for l in supported_layouts)
        raise TransferError(
            f"io_backend {io_backend!r} with layout {layout!r} is not supported; supported: {pairs}"
            " (the 'kernel' backend needs sgl-kernel's UVA kernels, which hicache does not ship)"
        )


def check_indices(host_indices, device_indices, *, host_slots: int, device_slots: int):
    """Both index tensors as int64 CPU tensors, after checking dtype, shape and range."""
    import torch

    out = []
    for name, value, bound in (("host_indices", host_indices, host_slots), ("device_indices", device_indices, device_slots)):
        if not isinstance(value, torch.Tensor):
            raise TransferError(f"{name} must be a torch tensor, got {type(value).__name__}")
        if value.dtype not in (torch.int64, torch.int32) or value.dim() != 1:
            raise TransferError(f"{name} must be a 1-D int64 or int32 tensor, got {value.dtype} of shape {tuple(value.shape)}")
        value = value.to(device="cpu", dtype=torch.int64)
        if value.numel() and (int(value.min()) < 0 or int(value.max()) >= bound):
            raise TransferError(f"{name} out of range [0, {bound}): min {int(value.min())}, max {int(value.max())}")
        out.append(value)
    if out[0].numel() != out[1].numel():
        raise TransferError(f"host_indices has {out[0].numel()} entries but device_indices has {out[1].numel()}")
    return out


def aligned_pages(indices, page_size: int):
    """Page ids when ``indices`` are page-aligned runs of whole pages, else None."""
    import torch

    if page_size == 1:
        return indices
    if indices.numel() % page_size:
        return None
    runs = indices.view(-1, page_size)
    starts = runs[:, 0]
    if (starts % page_size).any() or not torch.equal(runs - starts[:, None], torch.arange(page_size).expand_as(runs)):
        return None
    return starts // page_size


def _block_bytes(tensor) -> int | None:
    """Bytes of one dim-0 block when each block is one contiguous run, else None (shape and
    stride arithmetic only: no view is made)."""
    shape, stride = tensor.shape, tensor.stride()
    expected = 1
    for size, step in zip(reversed(shape[1:]), reversed(stride[1:])):
        if size != 1 and step != expected:
            return None
        expected *= size
    return expected * tensor.element_size()


def block_unit(dst, src) -> int | None:
    """Bytes per dim-0 block when blocks are contiguous, equally sized and typed on both sides."""
    if dst.dtype != src.dtype or not dst.shape or not src.shape or src.shape[0] == 0:
        return None
    unit = _block_bytes(dst)
    if unit is None or _block_bytes(src) != unit:
        return None
    return unit


class BlockPattern(NamedTuple):
    """Coalesced block copies as byte offsets from the two tensors' base addresses, and how far
    they reach into each tensor (checked against every tensor they are used on)."""

    dst: object  # int64 tensors
    src: object
    sizes: object
    dst_reach: int = 0  # one past the last byte written, from the destination's base
    src_reach: int = 0
    total: int = 0  # bytes copied


def _pattern(dst_offsets, src_offsets, sizes) -> BlockPattern:
    if not sizes.numel():
        return BlockPattern(dst_offsets, src_offsets, sizes)
    return BlockPattern(dst_offsets, src_offsets, sizes, int((dst_offsets + sizes).max()),
                        int((src_offsets + sizes).max()), int(sizes.sum()))


def block_pattern(dst_ids, dst_step: int, src_ids, src_step: int, unit: int) -> BlockPattern:
    """Copies ``dst[dst_ids[i]] = src[src_ids[i]]`` of ``unit``-byte blocks, consecutive ones merged."""
    import torch

    dst_offsets, src_offsets = dst_ids * dst_step, src_ids * src_step
    order = torch.argsort(dst_offsets)  # walk the destination in address order: runs coalesce,
    dst_offsets, src_offsets = dst_offsets[order], src_offsets[order]  # and writes stream forward
    joins = (dst_offsets[1:] - dst_offsets[:-1] == unit) & (src_offsets[1:] - src_offsets[:-1] == unit)
    if not joins.any():
        return _pattern(dst_offsets, src_offsets, torch.full_like(dst_offsets, unit))
    starts = torch.nonzero(torch.cat([joins.new_ones(1), ~joins])).flatten()
    ends = torch.cat([starts[1:], starts.new_tensor([dst_offsets.numel()])])
    return _pattern(dst_offsets[starts], src_offsets[starts], (ends - starts) * unit)


class Descriptors:
    """(dst, src, bytes) copies collected over layers and streams, issued in one go. Each part
    is a block pattern (offsets) at a destination and a source base address: patterns are
    shared by every layer, so a layer costs no tensor arithmetic."""

    def __init__(self, engine=None) -> None:
        self.engine = engine  # a CopyEngine; None: a default one when first needed
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

    def add_checked(self, pattern: BlockPattern, link: Link, where) -> None:
        """`add` for a link whose extents are known: two comparisons, one append."""
        if not pattern.total:
            return
        if pattern.dst_reach > link.dst_extent or pattern.src_reach > link.src_extent:
            pool, layer, stream = where
            self.add(link.dst, link.src, pattern, where=pool._where(layer, stream))  # raises, naming it
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
        return self.engine.prepare_parts(parts, device=self.cuda)

    def run(self) -> None:
        prepared = self.prepare()
        if prepared is not None:
            prepared.run()
        self.parts, self.keep = [], []


def copy_blocks(dst, dst_ids, src, src_ids, descriptors: Descriptors | None = None, patterns: dict | None = None,
                where: str = "") -> bool:
    """``dst[dst_ids[i]] = src[src_ids[i]]`` for whole blocks along dim 0 (pages or slots).

    When every block is contiguous on both sides the copies are added to ``descriptors``
    (issued by the caller, batched with other layers) or issued now; otherwise torch indexing.
    ``patterns`` (a dict owned by the caller, for these very id tensors) keeps the coalesced
    pattern for the next layer or call with the same strides. Returns True when the copies went
    into descriptors (reusable), False when torch indexing did them. Every block must lie
    inside both tensors (`TransferError` naming ``where`` otherwise): never a wild copy.
    """
    if dst_ids.numel() == 0:
        return True
    unit = block_unit(dst, src)
    if unit is None:
        values = src[src_ids.to(src.device)]
        dst[dst_ids.to(dst.device)] = values.to(dst.device).reshape((values.shape[0], *dst.shape[1:]))
        return False
    steps = (dst.stride(0) * dst.element_size(), src.stride(0) * src.element_size())
    key = (id(dst_ids), id(src_ids), *steps, unit)
    pattern = patterns.get(key) if patterns is not None else None
    if pattern is None:
        pattern = block_pattern(dst_ids, steps[0], src_ids, steps[1], unit)
        if patterns is not None:
            patterns[key] = pattern
    batch = descriptors if descriptors is not None else Descriptors()
    batch.add(dst, src, pattern, where=where)
    if descriptors is None:
        batch.run()
    return True


def extent_bytes(tensor) -> int:
    """Bytes from ``tensor.data_ptr()`` to one past its last element (0 when empty)."""
    if tensor.numel() == 0:
        return 0
    last = sum((size - 1) * stride for size, stride in zip(tensor.shape, tensor.stride()))
    return (last + 1) * tensor.element_size()


class Link:
    """One layer of one stream, both ways: the block views, the unit, the steps, how far each
    side reaches - all fixed while the device tensor is the same object at the same address
    and shape, so a fresh batch costs a pattern lookup and one descriptor part per layer."""

    __slots__ = ("host_view", "device", "device_ptr", "device_shape", "dst", "src", "unit", "dst_step",
                 "src_step", "dst_extent", "src_extent", "dst_ptr", "src_ptr", "whole_pages")

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
                    pool, layer, stream = where
                    raise TransferError(
                        f"{pool._where(layer, stream)}: block {int(ids.max())} is past the end of the {side} "
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


def make_link(host_view, device, page_size: int, *, rows: bool, to_host: bool) -> Link:
    link = Link()
    link.host_view, link.device = host_view, device
    link.device_ptr, link.device_shape = device.data_ptr(), device.shape
    link.whole_pages = rows or device.shape[0] % page_size == 0
    blocks = device if rows or not link.whole_pages else device.unflatten(0, (-1, page_size))
    link.dst, link.src = (host_view, blocks) if to_host else (blocks, host_view)
    link.unit = block_unit(link.dst, link.src)
    link.dst_step = link.dst.stride(0) * link.dst.element_size() if link.dst.dim() else 0
    link.src_step = link.src.stride(0) * link.src.element_size() if link.src.dim() else 0
    link.dst_extent, link.src_extent = extent_bytes(link.dst), extent_bytes(link.src)
    link.dst_ptr, link.src_ptr = link.dst.data_ptr(), link.src.data_ptr()
    return link


class CheckedIndices(NamedTuple):
    """One transfer's indices after `check_indices`, and the block patterns found for them."""

    host: object  # the caller's tensors, as given (cloned)
    device: object
    bounds: tuple
    hidx: object  # int64 CPU tensors
    didx: object
    hpages: object  # page ids, or None when not whole aligned pages
    dpages: object
    patterns: dict
    ready: dict  # (direction, layers, device pool) -> ReadyCopy: descriptors built and checked
    seen: tuple  # weak references to the tensor objects given, with their versions


def _seen(host_indices, device_indices) -> tuple:
    import weakref

    return (weakref.ref(host_indices), host_indices._version, weakref.ref(device_indices), device_indices._version)


def _same_objects(seen: tuple, host_indices, device_indices) -> bool:
    """The very tensors of the last call, not modified in place since (their version counter)."""
    host_ref, host_version, device_ref, device_version = seen
    return (
        host_ref() is host_indices and device_ref() is device_indices
        and host_indices._version == host_version and device_indices._version == device_version
    )


def _same(saved, given) -> bool:
    import torch

    return (
        isinstance(given, torch.Tensor) and given.dtype == saved.dtype and given.device == saved.device
        and given.shape == saved.shape and torch.equal(given, saved)
    )


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


class IndexMemo:
    """The last transfer's checked indices and block patterns, reused while the indices are equal.

    SGLang loads layer by layer with the same two index tensors; checking them, finding the
    pages and coalescing cost ~0.4 ms a call in Python - a tenth of a 64 MiB layer's copy.
    A hit is the same tensor objects unchanged since (their version counter), or equal values;
    a tensor changed in place misses.
    """

    def __init__(self) -> None:
        self._last: CheckedIndices | None = None

    def check(self, host_indices, device_indices, *, host_slots: int, device_slots: int, page_size: int) -> CheckedIndices:
        bounds = (host_slots, device_slots, page_size)
        last = self._last  # one read: another thread may replace it meanwhile
        if last is not None and last.bounds == bounds:
            try:
                if _same_objects(last.seen, host_indices, device_indices):
                    return last  # the common case: the same tensors, layer after layer
            except (AttributeError, TypeError):
                pass  # not tensors: checked (and refused) below
            if _same(last.host, host_indices) and _same(last.device, device_indices):
                return last
        hidx, didx = check_indices(host_indices, device_indices, host_slots=host_slots, device_slots=device_slots)
        entry = CheckedIndices(
            host_indices.clone(), device_indices.clone(), bounds, hidx, didx,
            aligned_pages(hidx, page_size), aligned_pages(didx, page_size), {}, {},
            _seen(host_indices, device_indices),
        )
        self._last = entry
        return entry

    def forget(self) -> None:
        self._last = None


def copy_tokens(hv, hidx, dv, didx, page_size: int, *, to_host: bool) -> None:
    """Token-by-token path for runs that are not whole aligned pages.

    ``hv`` is a host view ``(pages, page_size, *item)``, ``dv`` a device view ``(slots, *item)``.
    """
    pages, offsets = hidx // page_size, hidx % page_size
    if to_host:
        values = dv[didx.to(dv.device)].to(hv.device)
        hv[pages, offsets] = values.reshape((values.shape[0], *hv.shape[2:]))
    else:
        values = hv[pages, offsets].to(dv.device)
        dv[didx.to(dv.device)] = values.reshape((values.shape[0], *dv.shape[1:]))
