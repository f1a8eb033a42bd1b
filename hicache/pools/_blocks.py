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
