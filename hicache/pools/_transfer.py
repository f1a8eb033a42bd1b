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


def _unit_contiguous(blocks) -> bool:
    """True when each ``blocks[i]`` is one contiguous run of memory."""
    if blocks.shape[0] == 0 or blocks.dim() < 2:
        return True
    return blocks[0].is_contiguous()


def block_unit(dst, src) -> int | None:
    """Bytes per dim-0 block when blocks are contiguous, equally sized and typed on both sides."""
    unit = dst[0].numel() * dst.element_size() if dst.shape[0] else 0
    if (
        dst.dtype != src.dtype or src.shape[0] == 0 or src[0].numel() * src.element_size() != unit
        or not _unit_contiguous(dst) or not _unit_contiguous(src)
    ):
        return None
    return unit


class BlockPattern(NamedTuple):
    """Coalesced block copies as byte offsets from the two tensors' base addresses."""

    dst: object  # int64 tensors
    src: object
    sizes: object


def block_pattern(dst_ids, dst_step: int, src_ids, src_step: int, unit: int) -> BlockPattern:
    """Copies ``dst[dst_ids[i]] = src[src_ids[i]]`` of ``unit``-byte blocks, consecutive ones merged."""
    import torch

    dst_offsets, src_offsets = dst_ids * dst_step, src_ids * src_step
    order = torch.argsort(dst_offsets)  # walk the destination in address order: runs coalesce,
    dst_offsets, src_offsets = dst_offsets[order], src_offsets[order]  # and writes stream forward
    joins = (dst_offsets[1:] - dst_offsets[:-1] == unit) & (src_offsets[1:] - src_offsets[:-1] == unit)
    if not joins.any():
        return BlockPattern(dst_offsets, src_offsets, torch.full_like(dst_offsets, unit))
    starts = torch.nonzero(torch.cat([joins.new_ones(1), ~joins])).flatten()
    ends = torch.cat([starts[1:], starts.new_tensor([dst_offsets.numel()])])
    return BlockPattern(dst_offsets[starts], src_offsets[starts], (ends - starts) * unit)


class Descriptors:
    """(dst, src, bytes) copies collected over layers and streams, issued in one go."""

    def __init__(self, engine=None) -> None:
        self.engine = engine  # a CopyEngine; None: a default one when first needed
        self.parts: list[tuple] = []  # (dst_addrs, src_addrs, sizes) int64 tensors
        self.cuda = None  # the CUDA device when either side of a copy is on one
        self.keep: list = []  # the tensors the addresses point into, alive until issued

    def add(self, dst, src, pattern: BlockPattern, *, where: str = "") -> None:
        """Queue ``pattern``'s copies from tensor ``src`` into tensor ``dst``, after checking
        that every block lies inside both tensors."""
        if pattern.sizes.numel():
            for side, tensor, offsets in (("destination", dst, pattern.dst), ("source", src, pattern.src)):
                reach = int((offsets + pattern.sizes).max())
                if reach > extent_bytes(tensor) or int(offsets.min()) < 0:
                    raise TransferError(
                        f"{where or 'copy'}: a block reaches byte {reach} of the {side} tensor, "
                        f"which holds {extent_bytes(tensor)} bytes (shape {tuple(tensor.shape)}): an index "
                        "past the end of a shorter layer or K/V tensor; nothing was copied"
                    )
        self.parts.append((pattern.dst + dst.data_ptr(), pattern.src + src.data_ptr(), pattern.sizes))
        for tensor in (dst, src):
            if tensor.device.type == "cuda":
                self.cuda = tensor.device
        self.keep += [dst, src]

    def prepare(self):
        """The collected copies as one `PreparedCopy` (None when there are none)."""
        import torch

        if not self.parts:
            return None
        dsts, srcs, sizes = (torch.cat(column) if len(column) > 1 else column[0] for column in zip(*self.parts))
        if self.engine is None:
            from hicache.effects import CopyEngine

            self.engine = CopyEngine()
        return self.engine.prepare(dsts, srcs, sizes, device=self.cuda)

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
