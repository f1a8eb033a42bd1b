"""Block arithmetic of page transfers: which runs are contiguous on both sides, the coalesced
(dst, src, bytes) pattern of a batch of block ids, how far a tensor reaches, and the two
torch-indexing copies for what is not a run of blocks (hicache.pools._transfer uses them).
"""

from __future__ import annotations

from typing import NamedTuple


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
    return coalesced(dst_ids * dst_step, src_ids * src_step, unit)


def coalesced(dst_offsets, src_offsets, unit: int) -> BlockPattern:
    """``unit``-byte blocks at the given offsets, in destination order, runs that are adjacent
    on both sides merged."""
    import torch

    order = torch.argsort(dst_offsets)  # walk the destination in address order: runs coalesce,
    dst_offsets, src_offsets = dst_offsets[order], src_offsets[order]  # and writes stream forward
    joins = (dst_offsets[1:] - dst_offsets[:-1] == unit) & (src_offsets[1:] - src_offsets[:-1] == unit)
    if not joins.any():
        return _pattern(dst_offsets, src_offsets, torch.full_like(dst_offsets, unit))
    starts = torch.nonzero(torch.cat([joins.new_ones(1), ~joins])).flatten()
    ends = torch.cat([starts[1:], starts.new_tensor([dst_offsets.numel()])])
    return _pattern(dst_offsets[starts], src_offsets[starts], (ends - starts) * unit)


def copy_blocks(dst, dst_ids, src, src_ids) -> None:
    """``dst[dst_ids[i]] = src[src_ids[i]]`` for whole blocks along dim 0 by torch indexing
    (blocks not contiguous on both sides); the caller checked every id against both tensors."""
    if dst_ids.numel() == 0:
        return
    values = src[src_ids.to(src.device)]
    dst[dst_ids.to(dst.device)] = values.to(dst.device).reshape((values.shape[0], *dst.shape[1:]))


def extent_bytes(tensor) -> int:
    """Bytes from ``tensor.data_ptr()`` to one past its last element (0 when empty)."""
    if tensor.numel() == 0:
        return 0
    last = sum((size - 1) * stride for size, stride in zip(tensor.shape, tensor.stride()))
    return (last + 1) * tensor.element_size()


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


class StridedPieces(NamedTuple):
    """How one layer's token rows split into pieces contiguous on both sides, where a token's
    row is not one run on the host (page_head: a token's heads lie a page of one head apart).
    Host byte offset of piece ``j`` of token ``t``: ``t // page_size * host_page + t % page_size *
    host_token + host_outer[j]``; on the device ``d * device_row + device_outer[j]``."""

    page_size: int
    host_page: int
    host_token: int
    device_row: int
    host_outer: object  # int64 tensors, one offset per piece of a token
    device_outer: object
    piece: int  # bytes of every piece
    signature: tuple  # the numbers above, outer offsets included: equal for every layer of a pool

    def pattern(self, host_ids, device_ids, *, to_host: bool) -> BlockPattern:
        host = (host_ids // self.page_size * self.host_page + host_ids % self.page_size * self.host_token)
        host = (host[:, None] + self.host_outer[None, :]).reshape(-1)
        device = ((device_ids * self.device_row)[:, None] + self.device_outer[None, :]).reshape(-1)
        return coalesced(host, device, self.piece) if to_host else coalesced(device, host, self.piece)


def strided_pieces(host_view, device, page_size: int) -> StridedPieces | None:
    """The pieces of a ``(pages, page_size, *item)`` host view against a ``(slots, *...)`` device
    tensor of the same elements per slot, split at the widest trailing run contiguous on both
    sides; None where even the last axis is not contiguous on both."""
    import torch

    item = tuple(host_view.shape[2:])
    if host_view.dim() < 3 or device.dtype != host_view.dtype or not item:
        return None
    try:
        rows = device.view(device.shape[0], *item)
    except RuntimeError:
        return None
    run, axis = 1, len(item)
    while axis and host_view.stride(axis + 1) == run and rows.stride(axis) == run:
        axis -= 1
        run *= item[axis]
    if run == 1 and item[-1] != 1:
        return None
    size = host_view.element_size()
    host_outer, device_outer = torch.zeros(1, dtype=torch.int64), torch.zeros(1, dtype=torch.int64)
    for dim in range(axis):  # every index of the axes before the run, in order
        steps = torch.arange(item[dim], dtype=torch.int64)
        host_outer = (host_outer[:, None] + steps[None, :] * host_view.stride(dim + 2) * size).reshape(-1)
        device_outer = (device_outer[:, None] + steps[None, :] * rows.stride(dim + 1) * size).reshape(-1)
    steps = (page_size, host_view.stride(0) * size, host_view.stride(1) * size, rows.stride(0) * size)
    signature = (*steps, run * size, tuple(host_outer.tolist()), tuple(device_outer.tolist()))
    return StridedPieces(*steps, host_outer, device_outer, run * size, signature)
