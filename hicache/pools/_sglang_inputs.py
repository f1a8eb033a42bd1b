"""SGLang 0.5.23's device-buffer descriptions, read into what hicache's pool families copy with.

0.5.23 builds a host pool from a description of the device buffers (`MHABufferInfo`,
`MLABufferInfo`, `MLAHostAllocation`; sglang/srt/mem_cache/device_pool_info.py) instead of the
device pool itself. This module recognizes them by their fields (no SGLang import: hicache runs
without SGLang) and turns one, with its packed draft descriptions, into a typed `DeviceView` of its family: the
device side a pool copies to and from, indexed by *host* layer (targets first, then drafts, as
SGLang's pools order ``device_k_buffers``), plus the controller-layer -> host-layer map SGLang's
pools use. Bad descriptions get SGLang's own ValueError messages' facts, naming the field.
"""

from __future__ import annotations

import attrs

from hicache.errors import LayoutError, NotServedError

#: KVBufferLayout values whose per-layer tensors are token rows (what hicache's copies address)
_TOKEN_ROW_LAYOUTS = ("nhd",)


def is_mha_info(obj) -> bool:
    """An `MHABufferInfo` (0.5.23): ``buffers`` with per-layer ``k``/``v`` and the head geometry."""
    buffers = getattr(obj, "buffers", None)
    return hasattr(buffers, "k") and hasattr(buffers, "v") and hasattr(obj, "head_num") and hasattr(obj, "v_head_dim")


def is_mamba_info(obj) -> bool:
    """A `MambaStateBufferInfo` (0.5.23): ``temporal`` and ``conv`` device tensors, layer first."""
    return hasattr(obj, "temporal") and hasattr(obj, "conv") and not hasattr(obj, "mamba_cache")


def is_mla_info(obj) -> bool:
    """An `MLABufferInfo` (device rows per layer slot) or `MLAHostAllocation` (geometry only)."""
    return hasattr(obj, "kv_lora_rank") and hasattr(obj, "kv_cache_dim") and (
        hasattr(obj, "layer_indices") or hasattr(obj, "size_per_token"))


def is_mla_allocation(obj) -> bool:
    """`MLAHostAllocation`: allocator-only geometry, no device buffers (SGLang's dummy MLA pool)."""
    return is_mla_info(obj) and not hasattr(obj, "buffers") and hasattr(obj, "size_per_token")


def older_device_pool(pool, first, description: str, needs: tuple[str, ...]):
    """``first`` as the older form's device pool, refused by name when it lacks what that form
    reads (``needs``) - another family's 0.5.23 description above all, the likeliest mix-up,
    which otherwise failed deep in the geometry as a bare AttributeError."""
    missing = [name for name in needs if not hasattr(first, name)]
    if missing:
        raise LayoutError(f"{type(pool).__name__}: the first argument must be {description} (SGLang 0.5.23) or a "
                          f"device pool (older SGLang), got {type(first).__name__} (no {', '.join(missing)})")
    return first


@attrs.define
class DeviceView:
    """The device side of a 0.5.23 host pool, as hicache's families read a device pool: one typed
    view per family (`MHADeviceView`, `MLADeviceView`, `MambaDeviceView`, `DSADeviceView`), each
    with only its family's fields. ``size`` is the device capacity in tokens, ``layer_num`` the
    host layers (targets + drafts); ``host_layer``: controller layer id -> host layer for target
    layers; ``draft_base``: the controller id of the first draft layer (drafts come with
    ``is_draft=True``)."""

    dtype: object
    device: object
    size: int
    layer_num: int
    target_layer_num: int
    host_layer: dict
    draft_base: int
    start_layer: int = 0

    @property
    def store_dtype(self):
        return self.dtype

    def resolve(self, layer_id, *, is_draft: bool) -> int | None:
        """The host layer of a controller layer id, or None where SGLang's pool copies nothing
        (a target call for a layer this pool does not hold)."""
        if is_draft:
            host = self.target_layer_num + (layer_id - self.draft_base)
            return host if self.target_layer_num <= host < self.layer_num else None
        return self.host_layer.get(layer_id)


@attrs.define
class MHADeviceView(DeviceView):
    """MHA: ``k_buffer``/``v_buffer`` (per host layer), ``head_num``, ``head_dim`` (K), ``v_head_dim``."""

    k_buffer: tuple = ()
    v_buffer: tuple = ()
    head_num: int | None = None
    head_dim: int | None = None
    v_head_dim: int | None = None

    @property
    def k_head_dim(self):
        return self.head_dim


@attrs.define
class MLADeviceView(DeviceView):
    """MLA: ``kv_buffer`` (per host layer; none for an allocator-only pool), ``kv_lora_rank``,
    ``qk_rope_head_dim``."""

    kv_buffer: tuple = ()
    kv_lora_rank: int | None = None
    qk_rope_head_dim: int | None = None


@attrs.define
class MambaDeviceView(DeviceView):
    """Mamba: ``mamba_cache`` (``.temporal`` per layer, ``.conv`` per conv state, per layer) and
    ``mamba_facts`` (``((state shape, dtype), ...)``, temporal first)."""

    mamba_cache: object = None
    mamba_facts: tuple = ()

    @property
    def num_mamba_layers(self):
        return self.layer_num

    def resolve(self, layer_id, *, is_draft: bool) -> int | None:
        """Mamba's drafts are plain layer ids (SGLang's too)."""
        return self.host_layer.get(layer_id)


@attrs.define
class DSADeviceView(DeviceView):
    """The DSA indexer: ``index_k_with_scale_buffer`` (per host layer, page rows), ``index_head_dim``,
    ``quant_block_size``."""

    index_k_with_scale_buffer: tuple = ()
    index_head_dim: int | None = None
    quant_block_size: int | None = None


def _checked(owner: str, infos, drafts_field: str, kind: str, is_kind):
    """``(index, field name, description)`` of the target (index 0) and each packed draft, each
    checked to be ``kind`` (``is_kind``) and then by its own ``validate()`` - SGLang's checks."""
    for index, item in enumerate(infos):
        name = "buffer_info" if index == 0 else f"{drafts_field}[{index - 1}]"
        if not is_kind(item):
            raise LayoutError(f"{owner}: {name} must be {kind}, got {type(item).__name__}")
        validate = getattr(item, "validate", None)
        if validate is not None:
            validate()
        yield index, name, item


def _check_token_rows(owner: str, info, name: str) -> None:
    layout = getattr(getattr(info.buffers, "layout", None), "value", "nhd")
    if layout not in _TOKEN_ROW_LAYOUTS:
        raise NotServedError(f"{owner}: {name}.buffers.layout={layout!r} is not supported; hicache copies token rows "
                             f"(KVBufferLayout {', '.join(_TOKEN_ROW_LAYOUTS)})")


def _check_mha_scales(owner: str, info, name: str) -> None:
    """KV scales: MXFP8's interleaved ones SGLang's MXFP8 host pool serves (its assembler builds
    that class for them, pools mode or not); SGLang's MHA host pool refuses any other layout."""
    scales = getattr(info, "scales", None)
    if scales is None:
        return
    layout = getattr(getattr(scales, "layout", None), "value", None)
    if layout == "mxfp8_interleaved":
        raise NotServedError(f"{owner}: {name}.scales is set (MXFP8): hicache's MHA host pool does not copy KV "
                             "scales; SGLang's MHATokenToKVPoolMXFP8Host serves them")
    raise LayoutError(f"{owner}: {name}.scales has layout {layout!r}: no host pool of SGLang 0.5.23 copies KV scales "
                      "of that layout (its MHA host pool refuses them too)")


def mha_device(owner: str, info, drafts, *, device_capacity_tokens: int, start_layer: int) -> DeviceView:
    """A device view from an `MHABufferInfo` and its packed drafts (one layer each, same
    heads, widths, dtype and device), checked as SGLang's MHA host pool checks them."""
    infos = (info, *drafts)
    for index, name, item in _checked(owner, infos, "draft_buffer_infos", "an MHABufferInfo", is_mha_info):
        _check_mha_scales(owner, item, name)
        _check_token_rows(owner, item, name)
        if index:
            if len(item.buffers.k) != 1:
                raise LayoutError(f"{owner}: packed {name} has {len(item.buffers.k)} layers; expected 1")
            geometry = (item.head_num, item.head_dim, item.v_head_dim, item.dtype, item.device)
            expected = (info.head_num, info.head_dim, info.v_head_dim, info.dtype, info.device)
            if geometry != expected:
                raise LayoutError(f"{owner}: packed {name} (heads, K width, V width, dtype, device)={geometry}, "
                                  f"expected {expected}")
    transfer = getattr(info, "transfer_buffers", None)
    if transfer is not None:
        raise NotServedError(f"{owner}: buffer_info.transfer_buffers (a relocatable device pool) is not supported; "
                             "hicache copies the per-layer buffers")
    targets = len(info.buffers.k)
    return MHADeviceView(
        dtype=info.dtype, device=info.device, size=int(device_capacity_tokens), start_layer=start_layer,
        layer_num=targets + len(drafts), target_layer_num=targets, host_layer={i: i for i in range(targets)},
        draft_base=targets, k_buffer=tuple(t for item in infos for t in item.buffers.k),
        v_buffer=tuple(t for item in infos for t in item.buffers.v), head_num=info.head_num,
        head_dim=info.head_dim, v_head_dim=info.v_head_dim,
    )


def mla_device(owner: str, info, drafts, *, device_capacity_tokens: int, start_layer: int, target_layer_num: int,
               layer_shard_enabled: bool) -> DeviceView:
    """A device view from an `MLABufferInfo` (or `MLAHostAllocation`: no buffers) and its
    packed drafts: host layer i holds the device slot ``layer_indices[i]``; drafts follow every
    device layer (controller ids ``device_layer_num + i``), as SGLang's MLA host pool maps them."""
    if layer_shard_enabled:
        raise NotServedError(f"{owner}: layer_shard_enabled=True (layer-sharded MLA device pools) is not supported by "
                             "hicache's MLA host pool; SGLang's own pool serves it")
    if is_mla_allocation(info):
        if drafts:
            raise LayoutError(f"{owner}: an allocator-only MLAHostAllocation takes no draft_buffer_infos")
        layers = target_layer_num + int(getattr(info, "draft_layer_num", 0))
        return MLADeviceView(dtype=info.dtype, device=None, size=int(device_capacity_tokens), start_layer=start_layer,
                            layer_num=layers, target_layer_num=target_layer_num, host_layer={}, draft_base=0,
                            kv_lora_rank=info.kv_lora_rank, qk_rope_head_dim=info.qk_rope_head_dim)
    infos = (info, *drafts)
    checked = _checked(owner, infos, "draft_buffer_infos", "an MLABufferInfo with a tuple of per-layer buffers "
                       "(split NPU buffers are not supported)",
                       lambda item: is_mla_info(item) and isinstance(getattr(item, "buffers", None), tuple))
    for index, name, item in checked:
        if getattr(item, "scales", None) is not None:  # SGLang's MLA host pool refuses them too
            raise LayoutError(f"{owner}: {name}.scales is set (FP4 KV): packed FP4 payload and block scales cannot be "
                              "restored; no host pool of SGLang 0.5.23 serves it")
        if index and ((item.kv_cache_dim, item.dtype) != (info.kv_cache_dim, info.dtype) or len(item.layer_indices) != 1):
            raise LayoutError(f"{owner}: packed {name} must hold one layer of the target's row "
                              f"{(info.kv_cache_dim, info.dtype)}, got {len(item.layer_indices)} of "
                              f"{(item.kv_cache_dim, item.dtype)}")
    if len(info.layer_indices) != target_layer_num:
        raise NotServedError(f"{owner}: buffer_info has {len(info.layer_indices)} layer slots but target_layer_num="
                             f"{target_layer_num}; hicache's MLA host pool maps them one to one without layer "
                             "sharding (SGLang's accepts them)")
    host_layer = {slot: i for i, slot in enumerate(info.layer_indices)}
    return MLADeviceView(
        dtype=info.dtype, device=info.device, size=int(device_capacity_tokens), start_layer=start_layer,
        layer_num=target_layer_num + len(drafts), target_layer_num=target_layer_num, host_layer=host_layer,
        draft_base=int(info.device_layer_num), kv_buffer=tuple(t for item in infos for t in item.buffers),
        kv_lora_rank=info.kv_lora_rank, qk_rope_head_dim=info.qk_rope_head_dim,
    )


@attrs.frozen
class _MambaLayers:
    temporal: tuple
    conv: tuple


def mamba_device(owner: str, info, drafts, *, device_capacity: int) -> DeviceView:
    """A device view from a `MambaStateBufferInfo` and its MTP drafts (one layer each, same
    state shapes and dtypes): per-layer views of the device tensors, targets then drafts, as
    SGLang's Mamba host pool copies them."""
    infos = (info, *drafts)
    for index, name, item in _checked(owner, infos, "mtp_draft_buffer_infos", "a MambaStateBufferInfo", is_mamba_info):
        if tuple(getattr(item, "extra_checkpoint_buffers", ()) or ()):
            raise NotServedError(f"{owner}: {name}.extra_checkpoint_buffers (per-slot side state) is not supported by "
                                 "hicache's Mamba host pool; SGLang's own pool serves it")
        if index:
            same = item.temporal.shape[0] == 1 and len(item.conv) == len(info.conv) and all(
                a.shape[1:] == b.shape[1:] and a.dtype == b.dtype for a, b in zip((*info.conv, info.temporal),
                                                                                 (*item.conv, item.temporal)))
            if not same:
                raise LayoutError(f"{owner}: {name} must be one layer shaped like the target's states")
    temporal = tuple(layer for item in infos for layer in item.temporal.unbind(0))
    conv = tuple(tuple(layer for item in infos for layer in item.conv[i].unbind(0)) for i in range(len(info.conv)))
    facts = ((tuple(info.temporal.shape[2:]), info.temporal.dtype),
             *[(tuple(c.shape[2:]), c.dtype) for c in info.conv])
    layers = len(temporal)
    return MambaDeviceView(
        dtype=info.conv[0].dtype, device=info.temporal.device, size=int(device_capacity), layer_num=layers,
        target_layer_num=layers, host_layer={i: i for i in range(layers)}, draft_base=layers,
        mamba_cache=_MambaLayers(temporal, conv), mamba_facts=facts,
    )


def dsa_device(owner: str, decl, drafts, anchor_host) -> DeviceView:
    """A device view from a DSA `HostPoolDecl` (its device pool's ``index_k_with_scale_buffer``
    for the owned layers, then layer 0 of each packed draft pool), as SGLang's DSA indexer host
    pool maps them (drafts come as ``device layer_num + depth``)."""
    device_pool = decl.device_pool
    if getattr(device_pool, "layer_shard_enabled", False):
        raise NotServedError(f"{owner}: a layer-sharded DSA device pool is not supported by hicache's indexer "
                             "host pool")
    if decl.storage_info is None:
        raise LayoutError(f"{owner}: decl.storage_info is None (a layout root); the indexer needs its byte facts")
    declared = decl.owned_device_layers
    targets = [layer for layer in range(device_pool.layer_num) if declared is None or layer in declared]
    buffers = [device_pool.index_k_with_scale_buffer[layer] for layer in targets]
    buffers += [draft.index_k_with_scale_buffer[0] for draft in drafts]
    return DSADeviceView(
        dtype=decl.storage_info.dtype, device=getattr(device_pool, "device", "cpu"), size=int(anchor_host.size),
        start_layer=getattr(device_pool, "start_layer", 0) or 0, layer_num=len(buffers), target_layer_num=len(targets),
        host_layer={layer: i for i, layer in enumerate(targets)}, draft_base=int(device_pool.layer_num),
        index_k_with_scale_buffer=tuple(buffers), index_head_dim=int(device_pool.index_head_dim),
        quant_block_size=int(getattr(device_pool, "quant_block_size", 128)),
    )
