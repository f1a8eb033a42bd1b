"""SGLang's DeepSeek-V4 host-pool constructors, turned into the device-pool view hicache's V4
pools take.

Owns reading SGLang's arguments: the paged pool's ``device_buffers`` (one tensor of page rows
per layer, ``item_bytes`` each) and the state pool's ``state_pools`` (each a
``kv_score_buffer.kv_score`` tensor of slots; ``ring_size`` slots make one page row). Facts
from SGLang's memory_pool_host (see ../shared/reference/sglang-callsites.md); the checks and
the error messages are hicache's.
"""

from __future__ import annotations

from types import SimpleNamespace

from hicache.errors import LayoutError


def _rows(tensor, row_bytes: int, what: str):
    """``tensor`` as uint8 page rows of ``row_bytes`` (a view: transfers write through it)."""
    import torch

    if not tensor.is_contiguous():
        raise LayoutError(f"{what} must be contiguous")
    raw = tensor.view(torch.uint8).reshape(tensor.shape[0], -1) if tensor.dim() else tensor.view(torch.uint8)
    if raw.shape[1] != row_bytes:
        raise LayoutError(f"{what}: a row has {raw.shape[1]} bytes, expected {row_bytes}")
    return raw


def paged_device(pool_name, device_buffers, item_bytes, num_host_pages, slot_page_size, page_aligned_only=False):
    """(device-pool view, pages, page size) of SGLang's paged pool's arguments."""
    import torch

    import operator

    item_bytes, num_host_pages, slot_page_size = (operator.index(v) for v in (item_bytes, num_host_pages, slot_page_size))
    # 0.5.23's tenth argument: SGLang's pool then refuses token-granular copies; hicache's V4
    # pools move whole page rows only, whatever it says (kept for SGLang's readers)
    page_aligned_only = bool(page_aligned_only)
    buffers = list(device_buffers)
    if not buffers:
        raise LayoutError(f"{pool_name}: device_buffers is empty")
    rows = [_rows(t, item_bytes, f"{pool_name}: device_buffers[{i}]") for i, t in enumerate(buffers)]
    view = SimpleNamespace(
        kv_buffer=rows, item_bytes=item_bytes, store_dtype=torch.uint8, layer_num=len(rows), start_layer=0,
        size=rows[0].shape[0] * slot_page_size, device=str(buffers[0].device), page_size=slot_page_size,
        page_aligned_only=page_aligned_only,
    )
    return view, num_host_pages, slot_page_size


def state_device(pool_name, state_pools, num_host_pages, swa_page_size):
    """As `paged_device`, for the state pool: page rows of ``ring_size`` state slots."""
    import operator

    import torch

    num_host_pages, swa_page_size = operator.index(num_host_pages), operator.index(swa_page_size)
    pools = list(state_pools)
    if not pools or any(p is None for p in pools):
        raise LayoutError(f"{pool_name}: state_pools must be a non-empty list without None")
    ring_size = slot_bytes = None
    views = []
    for index, pool in enumerate(pools):
        state = pool.kv_score_buffer.kv_score
        if not state.is_contiguous():
            raise LayoutError(f"{pool_name}: state_pools[{index}] state tensor must be contiguous")
        ring, slot = int(pool.ring_size), state[0].numel() * state.element_size()
        if ring_size is None:
            ring_size, slot_bytes = ring, slot
        elif (ring, slot) != (ring_size, slot_bytes):
            raise LayoutError(f"{pool_name}: state pools must share ring size and slot bytes")
        usable = state.shape[0] // ring * ring
        views.append(state.view(torch.uint8).reshape(state.shape[0], -1)[:usable].reshape(-1, ring * slot))
    view = SimpleNamespace(
        state_buffer=views, state_page_bytes=ring_size * slot_bytes, store_dtype=torch.uint8,
        layer_num=len(views), start_layer=0, size=views[0].shape[0] * swa_page_size,
        device=str(pools[0].kv_score_buffer.kv_score.device), page_size=swa_page_size, ring_size=ring_size,
    )
    return view, num_host_pages, swa_page_size
