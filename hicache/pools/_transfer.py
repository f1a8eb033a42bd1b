"""Page transfers between a host pool and a device pool: validation and the copy engine.

Owns the checks on indices and layer ids, and the copy itself. Where one page of one layer is
a contiguous block on both sides (layer_first, page_first_direct, Mamba slots, DSA/V4 rows), a
transfer is a list of (dst, src, bytes) descriptors: consecutive pages are coalesced, then
copied with memmove from a few threads on the CPU (ctypes releases the GIL) or with
cudaMemcpyBatchAsync on CUDA (falling back to per-page copies on cudaErrorNotSupported).
Other layouts go through torch index operations.
"""

from __future__ import annotations

import ctypes
import os
from concurrent.futures import ThreadPoolExecutor

from hicache.errors import CudaCallError, TransferError

IO_BACKENDS = ("direct",)
_PARALLEL_BYTES = 4 * 2**20  # below this one thread is faster than handing work out
_pool: ThreadPoolExecutor | None = None


def _threads() -> ThreadPoolExecutor:
    global _pool
    if _pool is None:
        _pool = ThreadPoolExecutor(max_workers=min(os.cpu_count() or 1, 8), thread_name_prefix="hicache-copy")
    return _pool


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


def _coalesce(dst_addrs, src_addrs, unit: int):
    """Merge consecutive descriptors: (dst, src, size) lists with as few entries as possible."""
    import torch

    if dst_addrs.numel() == 0:
        return [], [], []
    order = torch.argsort(dst_addrs)  # walk the destination in address order: runs coalesce,
    dst_addrs, src_addrs = dst_addrs[order], src_addrs[order]  # and writes stream forward
    step_d = dst_addrs[1:] - dst_addrs[:-1]
    step_s = src_addrs[1:] - src_addrs[:-1]
    breaks = torch.nonzero((step_d != unit) | (step_s != unit)).flatten() + 1
    starts = torch.cat([torch.zeros(1, dtype=torch.int64), breaks])
    ends = torch.cat([breaks, torch.tensor([dst_addrs.numel()])])
    return dst_addrs[starts].tolist(), src_addrs[starts].tolist(), ((ends - starts) * unit).tolist()


def _memmove_all(dsts, srcs, sizes) -> None:
    move = ctypes.memmove
    for dst, src, size in zip(dsts, srcs, sizes):
        move(dst, src, size)


def _cpu_copy(dsts, srcs, sizes) -> None:
    total = sum(sizes)
    workers = min(os.cpu_count() or 1, 8)
    if total < _PARALLEL_BYTES or workers == 1 or len(sizes) < 2:
        _memmove_all(dsts, srcs, sizes)
        return
    workers = min(workers, len(sizes))
    futures = [  # interleaved shares: every thread walks the whole range, in step with the rest
        _threads().submit(_memmove_all, dsts[i::workers], srcs[i::workers], sizes[i::workers])
        for i in range(workers)
    ]
    for future in futures:
        future.result()


def _cuda_copy(dsts, srcs, sizes, binding=None) -> str:
    """Issue the copies with cudaMemcpyBatchAsync, per page on an old driver; wait for them.

    Returns ``"batched"`` or ``"per-page"``.
    """
    if binding is None:
        from cuda.bindings import runtime as binding

    from hicache.effects._copies import FALLBACK_CODES, memcpy, memcpy_batch

    how = "batched"
    try:
        memcpy_batch(dsts, srcs, sizes, binding=binding)
    except CudaCallError as error:
        if error.code not in FALLBACK_CODES:
            raise
        how = "per-page"
        for dst, src, size in zip(dsts, srcs, sizes):  # old driver: one copy per page
            memcpy(dst, src, size, binding=binding)
    status = binding.cudaStreamSynchronize(0)
    code = int(status[0] if isinstance(status, tuple) else status)
    if code:
        from hicache.effects._codes import NAMES, cuda_error

        raise cuda_error("cudaStreamSynchronize", code, NAMES.get(code, str(code)), "waiting for copies")
    return how


class Descriptors:
    """(dst, src, bytes) copies collected over layers and streams, issued in one go."""

    def __init__(self) -> None:
        self.dsts: list[int] = []
        self.srcs: list[int] = []
        self.sizes: list[int] = []
        self.cuda = False
        self.keep: list = []  # the tensors the addresses point into, alive until issued

    def run(self) -> None:
        if not self.sizes:
            return
        if self.cuda:
            _cuda_copy(self.dsts, self.srcs, self.sizes)
        else:
            _cpu_copy(self.dsts, self.srcs, self.sizes)
        self.dsts, self.srcs, self.sizes, self.keep = [], [], [], []


def copy_blocks(dst, dst_ids, src, src_ids, descriptors: Descriptors | None = None) -> None:
    """``dst[dst_ids[i]] = src[src_ids[i]]`` for whole blocks along dim 0 (pages or slots).

    When every block is contiguous on both sides the copies are added to ``descriptors``
    (issued by the caller, batched with other layers) or issued now; otherwise torch indexing.
    """
    if dst_ids.numel() == 0:
        return
    item = dst.element_size()
    unit = dst[0].numel() * item
    direct = (
        _unit_contiguous(dst) and _unit_contiguous(src) and src[0].numel() * src.element_size() == unit
        and dst.dtype == src.dtype
    )
    if not direct:
        values = src[src_ids.to(src.device)]
        dst[dst_ids.to(dst.device)] = values.to(dst.device).reshape((values.shape[0], *dst.shape[1:]))
        return
    batch = descriptors if descriptors is not None else Descriptors()
    dst_addrs = dst_ids * (dst.stride(0) * item) + dst.data_ptr()
    src_addrs = src_ids * (src.stride(0) * item) + src.data_ptr()
    dsts, srcs, sizes = _coalesce(dst_addrs, src_addrs, unit)
    batch.dsts += dsts
    batch.srcs += srcs
    batch.sizes += sizes
    batch.cuda = batch.cuda or dst.device.type == "cuda" or src.device.type == "cuda"
    batch.keep += [dst, src]
    if descriptors is None:
        batch.run()


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
