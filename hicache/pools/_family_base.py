"""What every host-pool family shares: the element size of a dtype and the first argument as
the family's device view (SGLang 0.5.23's description, or the older device pool itself).
Each family lives in its own module (`_mha`, `_mla`, `_mamba`, `_v4_pools`); `_families` lists them.
"""

from __future__ import annotations


def _itemsize(dtype) -> int:
    import torch

    return torch.empty((), dtype=dtype).element_size()


def _first(pool, buffer_info, device_pool):
    """The first argument: 0.5.23's ``buffer_info`` or the older SGLang's ``device_pool`` (either
    may come by keyword, as SGLang's HiSparse coordinator passes them), exactly one of them."""
    if (buffer_info is None) == (device_pool is None):
        raise TypeError(f"{type(pool).__name__}() takes a device-buffer description (buffer_info, SGLang 0.5.23) or a "
                        "device pool (device_pool, older SGLang) first - exactly one")
    return buffer_info if buffer_info is not None else device_pool
