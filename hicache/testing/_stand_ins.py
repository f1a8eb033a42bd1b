"""Small CPU stand-ins for SGLang's device KV pools, one per host-pool family (for tests).

They expose the attributes SGLang's device pools do (``store_dtype``, ``size``, ``layer_num``,
``start_layer``, ``end_layer``, ``device`` and the per-family buffers), sized like SGLang's:
one padding page beyond ``size``. `randomize()` fills every buffer, `zero()` clears them.
"""

from __future__ import annotations

from types import SimpleNamespace


def _torch():
    import torch

    return torch


class _DevicePool:
    device = "cpu"

    def __init__(self, *, size: int, layer_num: int, page_size: int = 1, dtype=None, start_layer: int = 0):
        torch = _torch()
        self.size = size
        self.page_size = page_size
        self.layer_num = layer_num
        self.start_layer = start_layer
        self.end_layer = start_layer + layer_num
        self.store_dtype = dtype if dtype is not None else torch.bfloat16
        self.dtype = self.store_dtype
        self.slots = size + page_size  # SGLang keeps a padding page

    def tensors(self) -> list:
        raise NotImplementedError

    def randomize(self, seed: int = 0) -> None:
        torch = _torch()
        generator = torch.Generator().manual_seed(seed)
        for tensor in self.tensors():
            raw = tensor.view(torch.uint8) if tensor.dtype != torch.uint8 else tensor
            if raw.is_contiguous() and raw.numel() % 8 == 0 and raw.data_ptr() % 8 == 0:
                # every bit random, in 64-bit words drawn in place: 8x faster than a uint8 randint
                # and its copy (a benchmark's device pools took 17 s of them)
                raw.view(-1).view(torch.int64).random_(-2**63, None, generator=generator)
            else:
                raw.random_(0, 256, generator=generator)
            if tensor.is_floating_point():  # keep values finite so comparisons are exact
                tensor.nan_to_num_(0.0, 0.0, 0.0)

    def zero(self) -> None:
        for tensor in self.tensors():
            tensor.zero_()

    def to(self, device) -> "_DevicePool":
        """Move every buffer to ``device`` (a GPU, for the real-GPU tests and checks); returns self."""
        torch = _torch()

        def moved(value):
            if isinstance(value, torch.Tensor):
                return value.to(device)
            if isinstance(value, list):
                return [moved(item) for item in value]
            if isinstance(value, SimpleNamespace):
                return SimpleNamespace(**{name: moved(item) for name, item in vars(value).items()})
            return value

        for name, value in list(vars(self).items()):
            setattr(self, name, moved(value))
        self.device = str(device)
        return self


class MHADevicePool(_DevicePool):
    def __init__(self, *, head_num: int, head_dim: int, k_only: bool = False, **kw):
        super().__init__(**kw)
        torch = _torch()
        self.head_num, self.head_dim = head_num, head_dim
        shape = (self.slots, head_num, head_dim)
        self.k_buffer = [torch.zeros(shape, dtype=self.store_dtype) for _ in range(self.layer_num)]
        self.v_buffer = [] if k_only else [torch.zeros(shape, dtype=self.store_dtype) for _ in range(self.layer_num)]

    def tensors(self):
        return [*self.k_buffer, *self.v_buffer]


class AsymmetricMHADevicePool(_DevicePool):
    def __init__(self, *, head_num: int, k_head_dim: int, v_head_dim: int, **kw):
        super().__init__(**kw)
        torch = _torch()
        self.head_num, self.k_head_dim, self.v_head_dim = head_num, k_head_dim, v_head_dim
        self.k_buffer = [torch.zeros((self.slots, head_num, k_head_dim), dtype=self.store_dtype) for _ in range(self.layer_num)]
        self.v_buffer = [torch.zeros((self.slots, head_num, v_head_dim), dtype=self.store_dtype) for _ in range(self.layer_num)]

    def tensors(self):
        return [*self.k_buffer, *self.v_buffer]


class MLADevicePool(_DevicePool):
    def __init__(self, *, kv_lora_rank: int, qk_rope_head_dim: int, **kw):
        super().__init__(**kw)
        torch = _torch()
        self.kv_lora_rank, self.qk_rope_head_dim = kv_lora_rank, qk_rope_head_dim
        dim = kv_lora_rank + qk_rope_head_dim
        self.kv_buffer = [torch.zeros((self.slots, 1, dim), dtype=self.store_dtype) for _ in range(self.layer_num)]

    def tensors(self):
        return list(self.kv_buffer)


class DSAIndexerDevicePool(_DevicePool):
    def __init__(self, *, index_head_dim: int, quant_block_size: int = 128, **kw):
        super().__init__(**kw)
        torch = _torch()
        self.index_head_dim, self.quant_block_size = index_head_dim, quant_block_size
        row = self.page_size * (index_head_dim + index_head_dim // quant_block_size * 4)
        pages = self.slots // self.page_size
        self.index_k_with_scale_buffer = [torch.zeros((pages, row), dtype=torch.uint8) for _ in range(self.layer_num)]

    def tensors(self):
        return list(self.index_k_with_scale_buffer)


class MambaDevicePool(_DevicePool):
    def __init__(self, *, temporal_shape, conv_shapes, conv_dtype=None, **kw):
        super().__init__(**kw)
        torch = _torch()
        conv_dtype = conv_dtype or torch.bfloat16
        self.mamba_cache = SimpleNamespace(
            temporal=torch.zeros((self.layer_num, self.size + 1, *temporal_shape), dtype=torch.float32),
            conv=[torch.zeros((self.layer_num, self.size + 1, *s), dtype=conv_dtype) for s in conv_shapes],
        )
        self.store_dtype = torch.float32

    def tensors(self):
        return [self.mamba_cache.temporal, *self.mamba_cache.conv]


class DeepSeekV4DevicePool(_DevicePool):
    def __init__(self, *, item_bytes: int | None = None, state_page_bytes: int | None = None, **kw):
        super().__init__(**kw)
        torch = _torch()
        pages = self.slots // self.page_size
        if state_page_bytes is not None:
            self.state_page_bytes = state_page_bytes
            self.state_buffer = [torch.zeros((pages, state_page_bytes), dtype=torch.uint8) for _ in range(self.layer_num)]
        else:
            self.item_bytes = item_bytes
            self.kv_buffer = [torch.zeros((pages, item_bytes), dtype=torch.uint8) for _ in range(self.layer_num)]
        self.store_dtype = torch.uint8

    def tensors(self):
        return list(getattr(self, "state_buffer", None) or self.kv_buffer)
