"""Stand-ins that let SGLang's real code import and run on a CPU box (issue #24's test setup).

Owns the two pieces SGLang's host-pool path lacks on CPU. First `torchvision`, which
`sglang.srt.configs` imports at module level and for which PyPI has no CPU build matching
torch 2.13 (the CUDA wheel fails with ``operator torchvision::nms does not exist``). Nothing on
the host-pool paths calls it; every name it is asked for is a class that refuses to be built.
transformers' own "is torchvision installed" answer is settled (cached False) before the
stand-in exists, so it never takes the stand-in for the real package. Second, sgl-kernel's
"direct" io_backend copies and its "kernel" backend's kvcacheio ops, which SGLang binds only on
CUDA (`bind_transfers`). CUDA itself is
stood in for by `hicache.testing.fake_cuda`. `sglang_on_cpu` is the door (hicache.testing's).
Imports nothing of hicache.
"""

from __future__ import annotations

import enum
import importlib.machinery
import sys
import types

_NAMES = ("torchvision", "torchvision.transforms", "torchvision.transforms.functional")


class InterpolationMode(enum.Enum):
    """What SGLang's multimodal helpers name at import time (``torchvision.transforms``)."""

    NEAREST = "nearest"
    BILINEAR = "bilinear"
    BICUBIC = "bicubic"


def _stub(name: str, package: bool) -> types.ModuleType:
    module = types.ModuleType(name, f"hicache's CPU stand-in for {name} (see hicache/_sglang_cpu.py)")
    module.__spec__ = importlib.machinery.ModuleSpec(name, None, is_package=package)
    if package:
        module.__path__ = []

    def __getattr__(attribute: str):
        if attribute.startswith("__"):
            raise AttributeError(attribute)

        class Unavailable:
            def __init__(self, *args, **kwargs):
                raise RuntimeError(f"{name}.{attribute} is a CPU stand-in: torchvision is not installed here")

        Unavailable.__name__ = Unavailable.__qualname__ = attribute
        return Unavailable

    module.__getattr__ = __getattr__
    return module


def install() -> bool:
    """Put the torchvision stand-in in ``sys.modules`` unless a real one imports; idempotent.
    Returns True when the stand-in is (now) in place."""
    existing = sys.modules.get("torchvision")
    if existing is not None:
        return "CPU stand-in" in (getattr(existing, "__doc__", None) or "")
    try:
        import torchvision  # noqa: F401 - a working real one wins
        return False
    except Exception:  # absent, or the CUDA wheel beside a CPU torch
        sys.modules.pop("torchvision", None)
    try:
        from transformers.utils import import_utils

        import_utils.is_torchvision_available()  # settled (lru_cache) while none is importable
    except Exception:  # transformers absent or of another shape: nothing to settle
        pass
    root, transforms, functional = (_stub(name, name != _NAMES[-1]) for name in _NAMES)
    root.transforms, transforms.functional = transforms, functional
    transforms.InterpolationMode = functional.InterpolationMode = InterpolationMode
    sys.modules.update(zip(_NAMES, (root, transforms, functional)))
    return True


# -- sgl-kernel's "direct" io_backend copies, as plain torch indexing -------------------------
# SGLang binds these from sgl_kernel.kvcacheio only on CUDA/ROCm (pool_host/mha.py, mla.py), so
# on CPU the "direct" backend is a NameError. Their semantics are per-token and per-page copies
# (sgl-kernel's tests/test_kvcacheio.py states them as reference loops); here they are the same
# copies by torch indexing, which bounds-checks every index against every tensor it touches.
_POOL_MODULES = ("sglang.srt.mem_cache.pool_host.mha", "sglang.srt.mem_cache.pool_host.mla",
                 "sglang.srt.mem_cache.pool_host.mamba", "sglang.srt.mem_cache.pool_host.dsa",
                 "sglang.srt.mem_cache.memory_pool_host")


def _pages(indices, page_size: int, what: str):
    if indices.numel() % page_size:
        raise ValueError(f"{what}: {indices.numel()} indices is not a whole number of {page_size}-token pages")
    first = indices.reshape(-1, page_size)[:, 0]
    if bool((first % page_size).ne(0).any()):
        raise ValueError(f"{what}: a page's first index is not page-aligned (page_size {page_size})")
    return first // page_size


def transfer_kv_direct(*, src_layers, dst_layers, src_indices, dst_indices, page_size):
    """Each ``dst_layers[i][dst_indices] = src_layers[i][src_indices]`` (layer-first both sides)."""
    if len(src_layers) != len(dst_layers) or src_indices.numel() != dst_indices.numel():
        raise ValueError("transfer_kv_direct: layer lists or index counts differ")
    for src, dst in zip(src_layers, dst_layers):
        dst[dst_indices.to(dst.device)] = src[src_indices.to(src.device)].to(dst.device)


def transfer_kv_per_layer_direct_pf_lf(*, src_ptrs, dst_ptrs, src_indices, dst_indices, layer_id, page_size):
    """Host page-first-direct (``[page, layer, token, ...]``) to one device layer."""
    if len(src_ptrs) != len(dst_ptrs) or src_indices.numel() != dst_indices.numel():
        raise ValueError("transfer_kv_per_layer_direct_pf_lf: buffer lists or index counts differ")
    pages = _pages(src_indices, page_size, "transfer_kv_per_layer_direct_pf_lf")
    for src, dst in zip(src_ptrs, dst_ptrs):
        rows = src[pages.to(src.device), layer_id]  # [pages, page_size, ...]
        dst[dst_indices.to(dst.device)] = rows.reshape(-1, *rows.shape[2:]).to(dst.device)


def transfer_kv_all_layer_direct_lf_pf(*, src_ptrs, dst_ptrs, src_indices, dst_indices, page_size):
    """Every device layer (``src_ptrs``: the layers of each destination in turn) to host
    page-first-direct."""
    if not dst_ptrs or len(src_ptrs) % len(dst_ptrs) or src_indices.numel() != dst_indices.numel():
        raise ValueError("transfer_kv_all_layer_direct_lf_pf: buffer lists or index counts differ")
    layers = len(src_ptrs) // len(dst_ptrs)
    pages = _pages(dst_indices, page_size, "transfer_kv_all_layer_direct_lf_pf")
    for j, dst in enumerate(dst_ptrs):
        if dst.shape[1] < layers:
            raise ValueError(f"transfer_kv_all_layer_direct_lf_pf: host buffer has {dst.shape[1]} layers, not {layers}")
        where = pages.to(dst.device)
        for layer in range(layers):
            src = src_ptrs[j * layers + layer]
            rows = src[src_indices.to(src.device)]
            dst[where, layer] = rows.reshape(-1, page_size, *rows.shape[1:]).to(dst.device)


# -- sgl-kernel's "kernel" io_backend ops (kvcacheio), as item copies at computed addresses ---------
# Their contract (sgl-kernel csrc/kvcacheio/transfer.cu; ../shared/reference/sglang-0.5.23.md): int64
# index tensors of equal length, item_size % 8 == 0, item `id` of layer `l` at `base + id * item`
# (layer_first), `base + id * layout_dim + l * item` (page_first) or `table[l] + id * item` (a
# pointer table). Every address a tensor argument gives is checked inside that tensor here;
# pointer tables are SGLang's own buffers' addresses, as on CUDA.


def _base(tensor_or_table, layer: int | None = None) -> tuple[int, int | None]:
    """(address, bytes it may hold or None for a pointer table's entry) of one buffer."""
    if layer is None:
        return tensor_or_table.data_ptr(), tensor_or_table.numel() * tensor_or_table.element_size()
    return int(tensor_or_table[layer]), None


def _items(what: str, dst, dst_stride: int, dst_offset: int, src, src_stride: int, src_offset: int,
           dst_indices, src_indices, item_size: int) -> None:
    import ctypes

    if item_size % 8 or src_indices.numel() != dst_indices.numel():
        raise ValueError(f"{what}: item_size {item_size} must be a multiple of 8 and the index counts equal")
    (dst_at, dst_room), (src_at, src_room) = dst, src
    for d, s in zip(dst_indices.tolist(), src_indices.tolist()):
        to, start = d * dst_stride + dst_offset, s * src_stride + src_offset
        for room, at in ((dst_room, to), (src_room, start)):
            if at < 0 or (room is not None and at + item_size > room):
                raise IndexError(f"{what}: item at byte {at} is outside its {room}-byte buffer")
        ctypes.memmove(dst_at + to, src_at + start, item_size)


def transfer_kv_per_layer_mla(*, src, dst, src_indices, dst_indices, item_size):
    """One layer_first layer to another: ``base + id * item`` both sides."""
    _items("transfer_kv_per_layer_mla", _base(dst), item_size, 0, _base(src), item_size, 0, dst_indices, src_indices,
           item_size)


def transfer_kv_per_layer(*, src_k, dst_k, src_v, dst_v, src_indices, dst_indices, item_size):
    for src, dst in ((src_k, dst_k), (src_v, dst_v)):
        transfer_kv_per_layer_mla(src=src, dst=dst, src_indices=src_indices, dst_indices=dst_indices,
                                  item_size=item_size)


def transfer_kv_all_layer_mla(*, src_layers, dst_layers, src_indices, dst_indices, item_size, num_layers):
    """Every layer through two pointer tables."""
    if src_layers.numel() != num_layers or dst_layers.numel() != num_layers:
        raise ValueError(f"transfer_kv_all_layer_mla: tables of {src_layers.numel()} and {dst_layers.numel()} "
                         f"layers, num_layers {num_layers}")
    for layer in range(num_layers):
        _items("transfer_kv_all_layer_mla", _base(dst_layers, layer), item_size, 0, _base(src_layers, layer),
               item_size, 0, dst_indices, src_indices, item_size)


def transfer_kv_all_layer(*, src_k_layers, dst_k_layers, src_v_layers, dst_v_layers, src_indices, dst_indices,
                          item_size, num_layers):
    for src, dst in ((src_k_layers, dst_k_layers), (src_v_layers, dst_v_layers)):
        transfer_kv_all_layer_mla(src_layers=src, dst_layers=dst, src_indices=src_indices, dst_indices=dst_indices,
                                  item_size=item_size, num_layers=num_layers)


def transfer_kv_per_layer_mla_pf_lf(*, src, dst, src_indices, dst_indices, layer_id, item_size, src_layout_dim):
    """Layer ``layer_id`` of a page_first buffer to a layer_first one."""
    _items("transfer_kv_per_layer_mla_pf_lf", _base(dst), item_size, 0, _base(src), src_layout_dim,
           layer_id * item_size, dst_indices, src_indices, item_size)


def transfer_kv_per_layer_pf_lf(*, src_k, dst_k, src_v, dst_v, src_indices, dst_indices, layer_id, item_size,
                                src_layout_dim):
    for src, dst in ((src_k, dst_k), (src_v, dst_v)):
        transfer_kv_per_layer_mla_pf_lf(src=src, dst=dst, src_indices=src_indices, dst_indices=dst_indices,
                                        layer_id=layer_id, item_size=item_size, src_layout_dim=src_layout_dim)


def transfer_kv_all_layer_mla_lf_pf(*, src_layers, dst, src_indices, dst_indices, item_size, dst_layout_dim,
                                    num_layers):
    """Every layer through a pointer table into a page_first buffer."""
    if src_layers.numel() != num_layers:
        raise ValueError(f"transfer_kv_all_layer_mla_lf_pf: a table of {src_layers.numel()} layers, num_layers "
                         f"{num_layers}")
    for layer in range(num_layers):
        _items("transfer_kv_all_layer_mla_lf_pf", _base(dst), dst_layout_dim, layer * item_size,
               _base(src_layers, layer), item_size, 0, dst_indices, src_indices, item_size)


def transfer_kv_all_layer_lf_pf(*, src_k_layers, dst_k, src_v_layers, dst_v, src_indices, dst_indices, item_size,
                                dst_layout_dim, num_layers):
    for src, dst in ((src_k_layers, dst_k), (src_v_layers, dst_v)):
        transfer_kv_all_layer_mla_lf_pf(src_layers=src, dst=dst, src_indices=src_indices, dst_indices=dst_indices,
                                        item_size=item_size, dst_layout_dim=dst_layout_dim, num_layers=num_layers)


def _head_items(what: str, host, device, host_indices, device_indices, *, item_size: int, layout_dim: int,
                layer: int, page_size: int, head_num: int, to_host: bool) -> None:
    """page_head's copies, head by head: item ``id`` of layer ``l``, head ``h`` at ``base + id // P * P * ld
    + ld // H * h * P + id % P * ld // H + l * item // H`` in the host buffer and ``base + id * item + h *
    item // H`` in the layer_first one (``host``/``device``: (address, room or None)), ``item // H``
    bytes each (whole words)."""
    import ctypes

    if item_size % head_num or (item_size // head_num) % 8 or layout_dim % head_num:
        raise ValueError(f"{what}: item_size {item_size} and layout_dim {layout_dim} must split into {head_num} "
                         "heads of whole 8-byte words")
    if host_indices.numel() != device_indices.numel():
        raise ValueError(f"{what}: index counts differ")
    piece, head_dim = item_size // head_num, layout_dim // head_num
    for h, d in zip(host_indices.tolist(), device_indices.tolist()):
        for head in range(head_num):
            at_host = h // page_size * page_size * layout_dim + head_dim * head * page_size + h % page_size * head_dim \
                + layer * piece
            at_device = d * item_size + head * piece
            for (_, room), at in ((host, at_host), (device, at_device)):
                if at < 0 or (room is not None and at + piece > room):
                    raise IndexError(f"{what}: item at byte {at} is outside its {room}-byte buffer")
            dst, src = (host[0] + at_host, device[0] + at_device) if to_host else (device[0] + at_device, host[0] + at_host)
            ctypes.memmove(dst, src, piece)


def transfer_kv_per_layer_ph_lf(*, src_k, dst_k, src_v, dst_v, src_indices, dst_indices, layer_id, item_size,
                                src_layout_dim, page_size, head_num):
    """Layer ``layer_id`` of page_head K and V buffers to layer_first ones, head by head."""
    for src, dst in ((src_k, dst_k), (src_v, dst_v)):
        _head_items("transfer_kv_per_layer_ph_lf", _base(src), _base(dst), src_indices, dst_indices,
                    item_size=item_size, layout_dim=src_layout_dim, layer=layer_id, page_size=page_size,
                    head_num=head_num, to_host=False)


def transfer_kv_all_layer_lf_ph(*, src_k_layers, dst_k, src_v_layers, dst_v, src_indices, dst_indices, item_size,
                                dst_layout_dim, num_layers, page_size, head_num):
    """Every layer through pointer tables into page_head K and V buffers, head by head."""
    for table, dst in ((src_k_layers, dst_k), (src_v_layers, dst_v)):
        if table.numel() != num_layers:
            raise ValueError(f"transfer_kv_all_layer_lf_ph: a table of {table.numel()} layers, num_layers {num_layers}")
        for layer in range(num_layers):
            _head_items("transfer_kv_all_layer_lf_ph", _base(dst), _base(table, layer), dst_indices, src_indices,
                        item_size=item_size, layout_dim=dst_layout_dim, layer=layer, page_size=page_size,
                        head_num=head_num, to_host=True)


def _mamba_item(what: str, item_size: int) -> None:
    if item_size % 16:
        raise ValueError(f"{what}: item_size {item_size} must be a multiple of 16 (the JIT kernel's vector)")


def transfer_kv_mamba_pf_lf(*, src, dst, src_indices, dst_indices, layer_id, item_size, src_layout_dim):
    """SGLang's Mamba JIT load: ``src + id * ld + l * item -> dst + id * item``."""
    _mamba_item("transfer_kv_mamba_pf_lf", item_size)
    _items("transfer_kv_mamba_pf_lf", _base(dst), item_size, 0, _base(src), src_layout_dim, layer_id * item_size,
           dst_indices, src_indices, item_size)


def transfer_kv_mamba_lf_pf(*, src_ptrs, dst, src_indices, dst_indices, item_size, dst_layout_dim, num_layers):
    """SGLang's Mamba JIT backup: ``ptrs[l] + id * item -> dst + id * ld + l * item``."""
    _mamba_item("transfer_kv_mamba_lf_pf", item_size)
    if src_ptrs.numel() != num_layers:
        raise ValueError(f"transfer_kv_mamba_lf_pf: a table of {src_ptrs.numel()} layers, num_layers {num_layers}")
    for layer in range(num_layers):
        _items("transfer_kv_mamba_lf_pf", _base(dst), dst_layout_dim, layer * item_size, _base(src_ptrs, layer),
               item_size, 0, dst_indices, src_indices, item_size)


_KERNEL_OPS = (transfer_kv_per_layer, transfer_kv_all_layer, transfer_kv_per_layer_mla, transfer_kv_all_layer_mla,
               transfer_kv_per_layer_pf_lf, transfer_kv_all_layer_lf_pf, transfer_kv_per_layer_mla_pf_lf,
               transfer_kv_all_layer_mla_lf_pf, transfer_kv_per_layer_ph_lf, transfer_kv_all_layer_lf_ph,
               transfer_kv_mamba_pf_lf, transfer_kv_mamba_lf_pf)


_TRANSFERS = {f.__name__: f for f in (transfer_kv_direct, transfer_kv_per_layer_direct_pf_lf,
                                      transfer_kv_all_layer_direct_lf_pf, *_KERNEL_OPS)}


def bind_transfers() -> tuple[str, ...]:
    """Give SGLang's MHA, MLA, Mamba, DSA and DeepSeek-V4 host-pool modules the direct-backend copies and the
    kernel-backend ops (page_head's and Mamba's JIT ones included) where they have none (off CUDA); a real
    sgl-kernel binding is left alone. Returns what was bound."""
    import importlib
    import warnings

    bound = []
    for name in _POOL_MODULES:
        try:
            with warnings.catch_warnings():  # SGLang's imports warn about their own dependencies
                warnings.simplefilter("ignore")
                module = importlib.import_module(name)
        except ImportError:
            continue
        for attribute, function in _TRANSFERS.items():
            if attribute not in vars(module):
                setattr(module, attribute, function)
                bound.append(f"{name}.{attribute}")
    return tuple(bound)


def sglang_on_cpu(*, transfers: bool = True) -> bool:
    """Let SGLang's real code (0.5.23) import and copy on a CPU box: installs a `torchvision`
    stand-in (see hicache/testing/_sglang_cpu.py) unless a working torchvision imports, and -
    with ``transfers`` and SGLang installed - gives its MHA, MLA, Mamba, DSA and DeepSeek-V4 host
    pools CPU versions of sgl-kernel's ``io_backend="direct"`` copies and of its ``kernel``
    backend's kvcacheio ops (page_head's and Mamba's JIT ones included; bound there only on
    CUDA), so SGLang's own backup/load paths run with either backend. Idempotent; returns True
    when the torchvision stand-in is in place. With `fake_cuda()` around the code under test,
    SGLang's pools then build and run on CPU with hicache's plug-in loaded (its registration
    goes through the fake)."""
    stood_in = install()
    if transfers:
        bind_transfers()
    return stood_in
