"""`LogicalHostPool`: SGLang 0.5.23's pure-logical anchor (DeepSeek-V4's FULL pool on the host).

It hands out page-aligned token slots and holds no tensor: V4's compressed side pools use its
indices as stable page anchors. Every transfer and page call is a no-op with SGLang's return
values (an empty uint8 page, no meta), so a `HostPoolGroup` can make it its anchor. The slots
come from hicache's `PageAllocator` through `SlotsMixin`, the slot calls every pool shares (a page
handed out twice or freed twice raises).
"""

from __future__ import annotations

import threading

from hicache.errors import PlanError
from hicache.pools._page_allocator import PageAllocator
from hicache.pools._slots import SlotsMixin
from hicache.plan.checks import check_int


class LogicalHostPool(SlotsMixin):
    """``LogicalHostPool(size, page_size, layout="layer_first")`` - ``size`` token slots in
    pages of ``page_size`` (``size`` a multiple of it), no memory behind them."""

    shared_allocation_domain = None
    stores_page_envelope = False
    storage_format_tag = None
    dcp_size = 1
    dcp_rank = 0

    def __init__(self, size: int, page_size: int, layout: str = "layer_first") -> None:
        size = check_int(PlanError, "LogicalHostPool", "size", size, minimum=0)
        page_size = check_int(PlanError, "LogicalHostPool", "page_size", page_size)
        if size % page_size:
            raise PlanError(f"LogicalHostPool size must be page-aligned, got size={size}, page_size={page_size}")
        import torch

        self.size = self.logical_size = size  # DCP never widens it
        self.page_size = self.logical_page_size = page_size
        self.page_num = size // page_size
        self.device = "cpu"
        self.layout = layout
        self.dtype = torch.uint8
        self.layer_num = self.start_layer = self.end_layer = 0
        self.kv_buffer = None
        self.size_per_token = 0
        self.allocator = None
        self.can_use_write_back_jit = True  # nothing to stage: keeps HostPoolGroup's AND for its siblings
        self.lock = threading.RLock()
        self._pages = PageAllocator(self.page_num, page_size)

    def destroy(self) -> None:
        """Nothing to release: no buffer, no registration."""

    # -- what a host pool does, with nothing behind it -------------------------------------
    def prepare_transfer_indices(self, host_indices, device_indices, io_backend):
        return host_indices, device_indices

    def backup_from_device_all_layer(self, device_pool, host_indices, device_indices, io_backend) -> None:
        pass

    def backup_from_device_all_layer_physical(self, device_pool, host_indices, device_indices, io_backend) -> None:
        pass

    def load_to_device_per_layer(self, device_pool, host_indices, device_indices, layer_id, io_backend, *,
                                 is_draft: bool = False) -> None:
        pass

    def load_to_device_per_layer_physical(self, device_pool, host_indices, device_indices, layer_id, io_backend, *,
                                          is_draft: bool = False) -> None:
        pass

    def get_data_page(self, index, flat: bool = True):
        import torch

        return torch.empty(0, dtype=torch.uint8)

    def get_dummy_flat_data_page(self):
        import torch

        return torch.empty(0, dtype=torch.uint8)

    def set_from_flat_data_page(self, index, data_page) -> None:
        pass

    def get_page_buffer_meta(self, indices):
        return None

    def get_page_buffer_element_size(self, split_factor: int = 1):
        return None

    def get_ksize_per_token(self) -> int:
        return 0

    def __repr__(self) -> str:
        return f"<LogicalHostPool {self.page_num} pages x {self.page_size}, no memory>"
