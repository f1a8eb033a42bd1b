"""Conformance with SGLang 0.5.23's own host pools, judged by SGLang's code: for each family and
layout hicache has, SGLang's pool and hicache's are built by 0.5.23's constructor from the same
device-buffer description (SGLang's `get_device_pool_infos()` of its real device pool, on CPU),
then compared attribute by attribute and call by call - sizes, shapes, dtypes, return types,
pointers (as offsets into each pool's buffer), flat pages and transfers, byte for byte. SGLang's
pool runs unpinned (its pinning needs a CUDA torch); hicache's registers under `fake_cuda`.
Needs `make sglang`."""

from __future__ import annotations

import re

import pytest
from sglang_support import published, sglang  # noqa: F401 - sglang: a fixture

from hicache.testing import fake_cuda
from hicache.effects import HostSetup

torch = pytest.importorskip("torch")

PAGE, LAYERS, TOKENS = 16, 3, 256
KW = dict(device_capacity_tokens=TOKENS, start_layer=0, end_layer=LAYERS - 1)
ROOM = dict(host=HostSetup(host_memory_bytes=10**12))  # hicache's budget, injected (no machine dependence)

CASES = [
    ("mha", "layer_first"), ("mha", "page_first"), ("mha", "page_first_direct"), ("mha", "page_head"),
    ("asym", "page_first"), ("asym", "page_first_direct"),
    ("mla", "layer_first"), ("mla", "page_first"), ("mla", "page_first_direct"),
]

COMMON_FIELDS = (
    "size", "page_num", "page_size", "layer_num", "start_layer", "end_layer", "logical_size", "logical_page_size",
    "dcp_size", "dcp_rank", "can_use_write_back_jit", "shared_allocation_domain", "stores_page_envelope",
    "storage_format_tag", "token_stride_size", "layout_dim", "size_per_token", "dtype", "layout", "device",
    "pool_label", "target_layer_num", "device_capacity_tokens",
)
FAMILY_FIELDS = {"mha": ("head_num", "head_dim", "v_head_dim"), "asym": ("head_num", "head_dim", "v_head_dim"),
                 "mla": ("kv_lora_rank", "qk_rope_head_dim", "kv_cache_dim", "dsa_kv_cache_store_fp8")}


def _device(kind: str, layers: int = LAYERS):
    from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool, MLATokenToKVPool

    common = dict(size=TOKENS, page_size=PAGE, dtype=torch.bfloat16, layer_num=layers, device="cpu",
                  enable_memory_saver=False)
    if kind == "mha":
        return MHATokenToKVPool(head_num=2, head_dim=64, **common)
    if kind == "asym":
        return MHATokenToKVPool(head_num=2, head_dim=64, v_head_dim=32, **common)
    return MLATokenToKVPool(kv_lora_rank=64, qk_rope_head_dim=16, **common)


def _classes(kind: str):
    """SGLang's class of ``kind`` and hicache's as the plug-in gives it to SGLang (scoped to
    SGLang's process: `served_pool_classes`)."""
    import sglang.srt.mem_cache.pool_host.mha as smha
    import sglang.srt.mem_cache.pool_host.mla as smla

    from hicache.compat.sglang_plugin import served_pool_classes

    served = served_pool_classes()
    return {
        "mha": (smha.MHATokenToKVPoolHost, served[f"{smha.__name__}.MHATokenToKVPoolHost"]),
        "asym": (smha.AsymmetricMHATokenToKVPoolHost, served[f"{smha.__name__}.AsymmetricMHATokenToKVPoolHost"]),
        "mla": (smla.MLATokenToKVPoolHost, served[f"{smla.__name__}.MLATokenToKVPoolHost"]),
    }[kind]


def _build(cls, kind, info, layout, *, hicache: bool, **extra):
    from sglang.srt.mem_cache.pool_host.base import host_memory_budget_scope

    kw = dict(KW, **extra)
    if kind == "mla":
        kw.setdefault("target_layer_num", LAYERS)
    if hicache:
        return cls(info, 2.0, 0, PAGE, layout, **kw, **ROOM)
    with host_memory_budget_scope(10**12):
        return cls(info, 2.0, 0, PAGE, layout, pin_memory=False, **kw)


@pytest.fixture
def pair(sglang, request):
    """(kind, layout, device pool, SGLang's host pool, hicache's host pool) - destroyed after."""
    kind, layout = request.param
    device = _device(kind)
    info = device.get_device_pool_infos()[0].buffer_info
    theirs_cls, ours_cls = _classes(kind)
    with fake_cuda() as fake:
        theirs = _build(theirs_cls, kind, info, layout, hicache=False)
        ours = _build(ours_cls, kind, info, layout, hicache=True)
        try:
            yield kind, layout, device, theirs, ours
        finally:
            ours.destroy()
            theirs.destroy()
        assert fake.held() == set()


def _buffers(pool) -> list:
    if hasattr(pool, "k_buffer") and not isinstance(pool.kv_buffer, torch.Tensor):
        return [pool.k_buffer, pool.v_buffer]
    return pool.kv_buffer if isinstance(pool.kv_buffer, list) else [pool.kv_buffer]


def _fill(pools, seed: int = 3) -> None:
    """The same random bytes in both pools' buffers."""
    generator = torch.Generator().manual_seed(seed)
    for theirs, ours in zip(_buffers(pools[0]), _buffers(pools[1])):
        data = torch.randint(-30000, 30000, theirs.shape, generator=generator, dtype=torch.int16)
        theirs.view(torch.int16).copy_(data)
        ours.view(torch.int16).copy_(data)


def _same_bytes(a, b) -> bool:
    return a.shape == b.shape and torch.equal(a.contiguous().view(torch.int16), b.contiguous().view(torch.int16))


@pytest.mark.parametrize("pair", CASES, indirect=True, ids=[f"{k}-{l}" for k, l in CASES])
def test_attributes_match_sglangs_pool(pair):
    """hicache's pool and SGLang's, built from the same arguments, have the same class name and
    equal attributes (and lack the same ones)."""
    kind, layout, _, theirs, ours = pair
    assert type(theirs).__name__ == type(ours).__name__
    for field in COMMON_FIELDS + FAMILY_FIELDS[kind]:
        if kind == "asym" and field in ("token_stride_size", "layout_dim"):  # unset on purpose by both
            assert not hasattr(theirs, field) and not hasattr(ours, field), field
            continue
        assert getattr(ours, field) == getattr(theirs, field), field
    assert [(b.shape, b.dtype) for b in _buffers(ours)] == [(b.shape, b.dtype) for b in _buffers(theirs)]
    assert ours.get_size_per_token() == theirs.get_size_per_token()
    assert ours.get_ksize_per_token() == theirs.get_ksize_per_token()
    assert ours.available_size() == theirs.available_size() == theirs.size
    assert type(ours.is_stride_page_aligned()) is type(theirs.is_stride_page_aligned()) is bool
    if layout in ("page_first", "page_first_direct", "page_head") or kind != "asym":
        assert ours.get_page_buffer_element_size() == theirs.get_page_buffer_element_size()
    if hasattr(theirs, "get_hybrid_pool_buffer"):
        assert [t.shape for t in ours.get_hybrid_pool_buffer()] == [t.shape for t in theirs.get_hybrid_pool_buffer()]


@pytest.mark.parametrize("pair", CASES, indirect=True, ids=[f"{k}-{l}" for k, l in CASES])
def test_zero_copy_meta_points_at_the_same_offsets(pair):
    """Zero-copy page meta points at the same offsets and sizes (plain ints) in both pools."""
    kind, layout, _, theirs, ours = pair
    if kind == "asym" and layout not in ("page_first", "page_first_direct"):
        pytest.skip("SGLang's asymmetric pool has no zero-copy meta for this layout")
    indices = torch.tensor([*range(2 * PAGE, 3 * PAGE), *range(7 * PAGE, 8 * PAGE), *range(0, PAGE)])
    t_ptrs, t_sizes = theirs.get_page_buffer_meta(indices)
    o_ptrs, o_sizes = ours.get_page_buffer_meta(indices)
    def offsets(ptrs, pool):  # (which buffer, offset inside it)
        spans = [(b.data_ptr(), b.data_ptr() + b.numel() * b.element_size()) for b in _buffers(pool)]
        return [next((i, ptr - lo) for i, (lo, hi) in enumerate(spans) if lo <= ptr < hi) for ptr in ptrs]

    assert offsets(o_ptrs, ours) == offsets(t_ptrs, theirs)
    assert o_sizes == t_sizes and all(type(v) is int for v in o_ptrs + o_sizes)


@pytest.mark.parametrize("pair", CASES, indirect=True, ids=[f"{k}-{l}" for k, l in CASES])
def test_flat_pages_are_byte_identical_both_ways(pair):
    """Flat data pages read and written are byte-identical between the two pools, and non-flat pages
    have SGLang's shapes."""
    kind, layout, _, theirs, ours = pair
    if kind == "asym":  # SGLang's asymmetric pool refuses flat pages (NotImplementedError)
        with pytest.raises(NotImplementedError):
            theirs.get_data_page(0)
        return
    _fill((theirs, ours))
    for index in (0, 3 * PAGE, torch.tensor(5 * PAGE)):  # the controller passes 0-d tensors
        assert _same_bytes(ours.get_data_page(index, flat=True), theirs.get_data_page(index, flat=True))
        assert ours.get_data_page(index, flat=False).shape == theirs.get_data_page(index, flat=False).shape
    dummy_t, dummy_o = theirs.get_dummy_flat_data_page(), ours.get_dummy_flat_data_page()
    assert (dummy_o.shape, dummy_o.dtype) == (dummy_t.shape, dummy_t.dtype)
    page = torch.randn(dummy_t.shape).to(dummy_t.dtype)
    theirs.set_from_flat_data_page(4 * PAGE, page)
    ours.set_from_flat_data_page(4 * PAGE, page)
    for a, b in zip(_buffers(theirs), _buffers(ours)):
        assert _same_bytes(a, b)


@pytest.mark.parametrize("pair", [c for c in CASES if c[1] in ("layer_first", "page_first_direct")], indirect=True,
                         ids=[f"{k}-{l}" for k, l in CASES if l in ("layer_first", "page_first_direct")])
def test_direct_transfers_write_and_load_the_same_bytes(pair):
    """SGLang's "direct" backend (its copies on CPU): backup of every layer lands on the same
    host bytes, a per-layer load into a cleared device pool restores the same rows; a target
    layer id the pool does not hold is skipped by both, silently."""
    kind, layout, device, theirs, ours = pair
    if kind == "asym" and layout == "layer_first":
        pytest.skip("not a case SGLang serves")
    layers = [*device.k_buffer, *device.v_buffer] if kind != "mla" else list(device.kv_buffer)
    generator = torch.Generator().manual_seed(5)
    for layer in layers:
        layer.copy_(torch.randn(layer.shape, generator=generator).to(layer.dtype))
    device_indices = torch.arange(2 * PAGE, 5 * PAGE)
    host_indices = torch.cat([torch.arange(7 * PAGE, 8 * PAGE), torch.arange(PAGE, 3 * PAGE)])
    for pool in (theirs, ours):
        pool.backup_from_device_all_layer_physical(device, host_indices, device_indices, "direct")
    for a, b in zip(_buffers(theirs), _buffers(ours)):
        assert _same_bytes(a, b)
    want = [layer[device_indices].clone() for layer in layers]
    for pool in (theirs, ours):
        for layer in layers:
            layer.zero_()
        for layer_id in range(LAYERS + 1):  # LAYERS: not a layer of the pool: skipped
            pool.load_to_device_per_layer_physical(device, host_indices, device_indices, layer_id, "direct")
        got = [layer[device_indices] for layer in layers]
        assert all(_same_bytes(g, w) for g, w in zip(got, want)), type(pool).__module__


@pytest.mark.parametrize("pair", [("mha", "page_first")], indirect=True)
def test_l2_hooks_and_allocation_return_what_sglangs_do(pair):
    """The L2 hooks and alloc/free return what SGLang's pool returns (types, shapes, available
    size)."""
    _, _, device, theirs, ours = pair
    host, dev = torch.arange(PAGE), torch.arange(PAGE, 2 * PAGE)
    for pool in (theirs, ours):
        got = pool.prepare_transfer_indices(host, dev, "direct")
        assert isinstance(got, tuple) and got[0] is host and got[1] is dev
    t, o = theirs.alloc(3 * PAGE), ours.alloc(3 * PAGE)
    assert (o.dtype, o.shape) == (t.dtype, t.shape)
    assert ours.available_size() == theirs.available_size()
    assert ours.alloc(10**6 * PAGE) is None and theirs.alloc(10**6 * PAGE) is None
    assert ours.free(o) == theirs.free(t) == 3 * PAGE
    assert ours.available_size() == theirs.available_size() == theirs.size


@pytest.mark.parametrize("pair", [("mha", "page_head")], indirect=True)
def test_split_heads_meta_matches_for_page_head(pair):
    """page_head's split-heads page meta and element sizes match SGLang's."""
    _, _, _, theirs, ours = pair
    indices = torch.arange(3 * PAGE, 5 * PAGE)
    t_ptrs, t_sizes = theirs.get_split_heads_page_buffer_meta(indices, 2)
    o_ptrs, o_sizes = ours.get_split_heads_page_buffer_meta(indices, 2)
    assert [p - theirs.kv_buffer.data_ptr() for p in t_ptrs] == [p - ours.kv_buffer.data_ptr() for p in o_ptrs]
    assert o_sizes == t_sizes
    assert ours.get_page_buffer_element_size(2) == theirs.get_page_buffer_element_size(2)


@pytest.mark.parametrize("layout", ["layer_first", "page_first", "page_first_direct"])
def test_mla_contiguous_buffer_infos_match(sglang, layout):
    """MLA contiguous buffer infos (offsets, lengths, item sizes) match SGLang's."""
    device = _device("mla")
    info = device.get_device_pool_infos()[0].buffer_info
    theirs_cls, ours_cls = _classes("mla")
    with fake_cuda():
        theirs = _build(theirs_cls, "mla", info, layout, hicache=False)
        ours = _build(ours_cls, "mla", info, layout, hicache=True)
        try:
            (tp, tl, ti), (op, ol, oi) = theirs.get_contiguous_buf_infos(), ours.get_contiguous_buf_infos()
            assert [p - theirs.kv_buffer.data_ptr() for p in tp] == [p - ours.kv_buffer.data_ptr() for p in op]
            assert (ol, oi) == (tl, ti)
        finally:
            ours.destroy()
            theirs.destroy()


@pytest.mark.parametrize("kind", ["mha", "mla"])
@pytest.mark.parametrize("sizing", [dict(host_token_capacity=20 * PAGE), dict(host_size=0.01), dict()])
def test_sizing_with_drafts_and_explicit_capacity_matches(sglang, kind, sizing):
    """Packed MTP draft layers (one each) widen the pool; ``host_token_capacity`` (no padding
    page), ``host_size`` in decimal GB and the ratio size it as SGLang's."""
    device = _device(kind)
    draft = _device(kind, layers=1)
    info = device.get_device_pool_infos()[0].buffer_info
    drafts = (draft.get_device_pool_infos()[0].buffer_info,)
    theirs_cls, ours_cls = _classes(kind)
    host_size = sizing.pop("host_size", 0)
    pools = []
    with fake_cuda():
        from sglang.srt.mem_cache.pool_host.base import host_memory_budget_scope

        kw = dict(KW, draft_buffer_infos=drafts, **sizing)
        if kind == "mla":
            kw["target_layer_num"] = LAYERS
        with host_memory_budget_scope(10**12):
            pools.append(theirs_cls(info, 2.0, host_size, PAGE, "page_first_direct", pin_memory=False, **kw))
        pools.append(ours_cls(info, 2.0, host_size, PAGE, "page_first_direct", **kw, **ROOM))
        try:
            theirs, ours = pools
            for field in ("size", "page_num", "layer_num", "target_layer_num", "size_per_token"):
                assert getattr(ours, field) == getattr(theirs, field), field
            assert ours.kv_buffer.shape == theirs.kv_buffer.shape
            # a draft layer loads with is_draft=True by its controller id; as a target id: skipped
            layers = list(draft.k_buffer) if kind == "mha" else list(draft.kv_buffer)
            draft_id = LAYERS if kind == "mha" else info.device_layer_num
            _fill((theirs, ours))
            rows = torch.arange(PAGE, 2 * PAGE)
            for pool in (theirs, ours):
                for layer in layers:
                    layer.zero_()
                pool.load_to_device_per_layer(draft, rows, rows, draft_id, "direct", is_draft=True)
                got = [layer[rows].clone() for layer in layers]
                if pool is theirs:
                    want = got
                else:
                    assert all(_same_bytes(g, w) for g, w in zip(got, want)) and any(g.any() for g in got)
            # a draft id below the drafts' base names no draft layer: hicache copies nothing
            # (never a target layer, nor - for an id that maps below zero - the last layer)
            every = layers + (list(device.k_buffer) + list(device.v_buffer) if kind == "mha" else list(device.kv_buffer))
            for below in (draft_id - 1, 0, -1):
                for layer in every:
                    layer.zero_()
                ours.load_to_device_per_layer(draft, rows, rows, below, "direct", is_draft=True)
                assert not any(bool(layer.any()) for layer in every), below
        finally:
            for pool in pools:
                pool.destroy()


@pytest.mark.parametrize("kind", ["mha", "mla"])
@pytest.mark.parametrize("capacity", [20 * PAGE + 1, PAGE - 1, 0, -PAGE])
def test_a_host_token_capacity_that_is_not_whole_positive_pages_is_refused_as_sglangs(sglang, kind, capacity):
    """SGLang refuses a capacity that is not positive and page-aligned with a ValueError; so
    does hicache (LayoutError is one), naming the value, before any memory is taken."""
    device = _device(kind)
    info = device.get_device_pool_infos()[0].buffer_info
    theirs_cls, ours_cls = _classes(kind)
    kw = dict(KW, host_token_capacity=capacity, **({"target_layer_num": LAYERS} if kind == "mla" else {}))
    with fake_cuda() as fake:
        from sglang.srt.mem_cache.pool_host.base import host_memory_budget_scope

        with host_memory_budget_scope(10**12), pytest.raises(ValueError, match="page-aligned"):
            theirs_cls(info, 2.0, 0, PAGE, "page_first_direct", pin_memory=False, **kw)
        with pytest.raises(ValueError, match=rf"host_token_capacity .*{capacity}"):
            ours_cls(info, 2.0, 0, PAGE, "page_first_direct", **kw, **ROOM)
        assert fake.held() == set()


def test_mla_allocator_only_pool_as_sglangs_dummy(sglang):
    """The MLA allocator-only pool matches SGLang's dummy: no buffer, nothing registered, the same
    attributes and empty infos."""
    from sglang.srt.mem_cache.pool_host.base import host_memory_budget_scope
    from sglang.srt.mem_cache.pool_host.mla import MLAHostAllocation

    allocation = MLAHostAllocation(dtype=torch.bfloat16, kv_lora_rank=64, qk_rope_head_dim=16, kv_cache_dim=80,
                                   size_per_token=80 * 2 * LAYERS)
    theirs_cls, ours_cls = _classes("mla")
    with fake_cuda() as fake:
        with host_memory_budget_scope(10**12):
            theirs = theirs_cls(allocation, 2.0, 0, PAGE, "page_first", pin_memory=False, target_layer_num=LAYERS, **KW)
        ours = ours_cls(allocation, 2.0, 0, PAGE, "page_first", target_layer_num=LAYERS, **KW, **ROOM)
        assert fake.held() == set() and ours.kv_buffer is None is theirs.kv_buffer
        for field in ("size", "page_num", "size_per_token", "token_stride_size", "layout_dim", "layer_num"):
            assert getattr(ours, field) == getattr(theirs, field), field
        assert ours.get_contiguous_buf_infos() == theirs.get_contiguous_buf_infos() == ([], [], [])
        assert len(ours.alloc(2 * PAGE)) == len(theirs.alloc(2 * PAGE)) == 2 * PAGE
        ours.destroy()
        theirs.destroy()


def test_mla_decode_context_parallel_pages_as_sglangs(sglang):
    """dcp_size=2: the page arrives widened, the pool holds this rank's half of each page,
    logical sizes are twice the physical, flat pages and meta address logical page starts."""
    device = _device("mla")
    info = device.get_device_pool_infos()[0].buffer_info
    theirs_cls, ours_cls = _classes("mla")
    kw = dict(KW, target_layer_num=LAYERS, dcp_size=2, dcp_rank=1)
    with fake_cuda():
        from sglang.srt.mem_cache.pool_host.base import host_memory_budget_scope

        with host_memory_budget_scope(10**12):
            theirs = theirs_cls(info, 2.0, 0, 2 * PAGE, "page_first_direct", pin_memory=False, **kw)
        ours = ours_cls(info, 2.0, 0, 2 * PAGE, "page_first_direct", **kw, **ROOM)
        try:
            for field in ("size", "page_num", "page_size", "logical_size", "logical_page_size", "dcp_size", "dcp_rank"):
                assert getattr(ours, field) == getattr(theirs, field), field
            _fill((theirs, ours))
            start = 3 * ours.logical_page_size
            assert _same_bytes(ours.get_data_page(start), theirs.get_data_page(start))
            indices = torch.arange(start, start + 2 * ours.logical_page_size)
            t_ptrs, t_sizes = theirs.get_page_buffer_meta(indices)
            o_ptrs, o_sizes = ours.get_page_buffer_meta(indices)
            assert [p - theirs.kv_buffer.data_ptr() for p in t_ptrs] == [p - ours.kv_buffer.data_ptr() for p in o_ptrs]
            assert o_sizes == t_sizes
            assert len(ours.alloc(ours.logical_page_size)) == len(theirs.alloc(theirs.logical_page_size))
            # transfers: widened logical slots, this rank's rows (slot % dcp_size == dcp_rank, row
            # slot // dcp_size); SGLang's direct copies need page-aligned runs, in which both
            # slots of a row come together - so the rank never changes which rows move
            step = ours.logical_page_size
            host_indices = torch.arange(5 * step, 7 * step)
            device_indices = torch.arange(2 * step, 4 * step)
            generator = torch.Generator().manual_seed(11)
            for buffer in device.kv_buffer:
                buffer.view(torch.int16).copy_(torch.randint(-30000, 30000, buffer.shape, generator=generator,
                                                             dtype=torch.int16))
            for pool in (theirs, ours):
                pool.backup_from_device_all_layer(device, host_indices, device_indices, "direct")
            assert all(_same_bytes(t, o) for t, o in zip(_buffers(theirs), _buffers(ours)))
            loaded = []
            for pool in (theirs, ours):
                for buffer in device.kv_buffer:
                    buffer.zero_()
                for layer in range(LAYERS):
                    pool.load_to_device_per_layer(device, host_indices, device_indices, layer, "direct")
                loaded.append([buffer.clone() for buffer in device.kv_buffer])
            assert all(_same_bytes(t, o) for t, o in zip(*loaded))
            assert any(bool(b.view(torch.int16).any()) for b in loaded[1])  # rows did move
        finally:
            ours.destroy()
            theirs.destroy()


@pytest.mark.parametrize("pair", [("mha", "page_first_direct"), ("mla", "layer_first")], indirect=True)
def test_every_buffer_carries_sglangs_registered_ranges_record(pair):
    """SGLang's `_cuda_host_unregister` reads ``_sglang_cuda_host_registered_ranges``: on hicache's
    buffers it lists exactly what the driver holds for them; empty after destroy."""
    from hicache.testing import fake_cuda as _unused  # noqa: F401 - the pair fixture's fake is live

    _, _, _, _, ours = pair
    buffers = _buffers(ours) if not hasattr(ours, "k_buffer") else [ours.kv_buffer]
    recorded = {tuple(r) for b in buffers for r in b._sglang_cuda_host_registered_ranges}
    assert recorded == set(ours._host.registered_ranges()) != set()
    ours.destroy()
    assert all(b._sglang_cuda_host_registered_ranges == [] for b in buffers)


@pytest.mark.parametrize("layout", ["layer_first", "page_first", "page_first_direct"])
def test_k_only_pool_beside_its_anchor_matches(sglang, layout):
    """`MHATokenToKOnlyPoolHost(device_pool, anchor_host, layout, ...)` (MiniMax's index-K): sized
    by its anchor, one K tensor; pages, meta and direct transfers as SGLang's."""
    from sglang.srt.mem_cache.memory_pool import MHATokenToKOnlyPool
    from sglang.srt.mem_cache.pool_host.base import host_memory_budget_scope
    from sglang.srt.mem_cache.pool_host.mha import MHATokenToKOnlyPoolHost as Theirs

    from hicache.pools import MHATokenToKOnlyPoolHost as Ours

    anchor_device = _device("mha")
    info = anchor_device.get_device_pool_infos()[0].buffer_info
    index_k = MHATokenToKOnlyPool(size=TOKENS, page_size=PAGE, dtype=torch.bfloat16, head_num=1, head_dim=128,
                                  layer_num=LAYERS, device="cpu", enable_memory_saver=False)
    theirs_cls, ours_cls = _classes("mha")
    with fake_cuda() as fake:
        theirs_anchor = _build(theirs_cls, "mha", info, layout, hicache=False)
        ours_anchor = _build(ours_cls, "mha", info, layout, hicache=True)
        with host_memory_budget_scope(10**12):
            theirs = Theirs(index_k, theirs_anchor, layout, pin_memory=False)
        ours = Ours(index_k, ours_anchor, layout, **ROOM)
        try:
            for field in ("size", "page_num", "page_size", "layer_num", "start_layer", "end_layer", "head_num",
                          "head_dim", "token_stride_size", "layout_dim", "size_per_token", "dtype", "layout"):
                assert getattr(ours, field) == getattr(theirs, field), field
            assert ours.k_buffer.shape == theirs.k_buffer.shape and not hasattr(ours, "v_buffer")
            assert ours.get_ksize_per_token() == theirs.get_ksize_per_token()
            assert [t.shape for t in ours.get_hybrid_pool_buffer()] == [t.shape for t in theirs.get_hybrid_pool_buffer()]
            generator = torch.Generator().manual_seed(1)
            data = torch.randint(-30000, 30000, theirs.k_buffer.shape, generator=generator, dtype=torch.int16)
            theirs.k_buffer.view(torch.int16).copy_(data)
            ours.k_buffer.view(torch.int16).copy_(data)
            assert _same_bytes(ours.get_data_page(2 * PAGE), theirs.get_data_page(2 * PAGE))
            if layout != "layer_first":
                indices = torch.arange(3 * PAGE, 5 * PAGE)
                t_ptrs, t_sizes = theirs.get_page_buffer_meta(indices)
                o_ptrs, o_sizes = ours.get_page_buffer_meta(indices)
                assert [p - theirs.k_buffer.data_ptr() for p in t_ptrs] == [p - ours.k_buffer.data_ptr() for p in o_ptrs]
                assert o_sizes == t_sizes
            if layout != "page_first":  # the direct backend's layouts
                for layer in index_k.k_buffer:
                    layer.copy_(torch.randn(layer.shape, generator=generator).to(layer.dtype))
                rows = torch.arange(PAGE, 3 * PAGE)
                for pool in (theirs, ours):
                    pool.backup_from_device_all_layer(index_k, rows, rows, "direct")
                assert _same_bytes(ours.k_buffer, theirs.k_buffer)
        finally:
            for pool in (ours, theirs, ours_anchor, theirs_anchor):
                pool.destroy()
        assert fake.held() == set()


@pytest.mark.parametrize("backend", ["direct", "kernel"])
@pytest.mark.parametrize("drafts", [0, 1])
@pytest.mark.parametrize("layout", ["page_first", "page_first_direct"])
def test_mamba_pool_from_its_state_description_matches(sglang, layout, drafts, backend):
    """`MambaPoolHost(MambaStateBufferInfo, ratio, size, *, device_capacity, layout,
    mtp_draft_buffer_infos)`: sizes, buffers, raw-byte pages, zero-copy meta and the transfers
    of every layer (drafts included) as SGLang's, with either io backend (``kernel``: SGLang's
    pool runs its Mamba JIT ops, their CPU versions here)."""
    from sglang.srt.mem_cache.device_pool_info import MambaStateBufferInfo
    from sglang.srt.mem_cache.pool_host.base import host_memory_budget_scope
    from sglang.srt.mem_cache.pool_host.mamba import MambaPoolHost as Theirs

    from hicache.pools import MambaPoolHost as Ours

    generator = torch.Generator().manual_seed(2)

    def states(layers):
        return MambaStateBufferInfo(temporal=torch.randn(layers, 9, 16, 32, generator=generator),
                                    conv=(torch.randn(layers, 9, 8, 32, generator=generator).to(torch.bfloat16),))

    info = states(2)
    draft_infos = tuple(states(1) for _ in range(drafts))
    kw = dict(device_capacity=8, layout=layout, mtp_draft_buffer_infos=draft_infos)
    with fake_cuda() as fake:
        with host_memory_budget_scope(10**12):
            theirs = Theirs(info, 2.0, 0, pin_memory=False, **kw)
        ours = Ours(info, 2.0, 0, **kw, **ROOM)
        try:
            for field in ("size", "page_num", "page_size", "size_per_token", "num_mamba_layers", "dtype", "layout",
                          "can_use_write_back_jit"):
                assert getattr(ours, field) == getattr(theirs, field), field
            import inspect

            for method in ("load_to_device_per_layer", "backup_from_device_all_layer"):  # io_backend="kernel"
                theirs_default = inspect.signature(getattr(theirs, method)).parameters["io_backend"].default
                assert inspect.signature(getattr(ours, method)).parameters["io_backend"].default == theirs_default
            assert [(t.shape, t.dtype) for t in ours.get_hybrid_pool_buffer()] == \
                [(t.shape, t.dtype) for t in theirs.get_hybrid_pool_buffer()]
            layers = [*info.temporal.unbind(0), *[d.temporal[0] for d in draft_infos],
                      *info.conv[0].unbind(0), *[d.conv[0][0] for d in draft_infos]]
            rows_d, rows_h = torch.tensor([1, 4, 6]), torch.tensor([9, 2, 16])
            for pool in (theirs, ours):
                pool.backup_from_device_all_layer(None, rows_h, rows_d, backend)
            for a, b in zip(theirs.get_hybrid_pool_buffer(), ours.get_hybrid_pool_buffer()):
                assert torch.equal(a.view(torch.uint8), b.view(torch.uint8))
            for index in (2, torch.tensor(9)):
                assert torch.equal(ours.get_data_page(index), theirs.get_data_page(index))
            dummy = theirs.get_dummy_flat_data_page()
            assert (ours.get_dummy_flat_data_page().shape, ours.get_dummy_flat_data_page().dtype) == (dummy.shape, dummy.dtype)
            page = theirs.get_data_page(16)
            for pool in (theirs, ours):
                pool.set_from_flat_data_page(3, page)
            assert torch.equal(ours.get_data_page(3), theirs.get_data_page(3))
            t_ptrs, t_sizes = theirs.get_page_buffer_meta(torch.tensor([2, 9]))
            o_ptrs, o_sizes = ours.get_page_buffer_meta(torch.tensor([2, 9]))
            t_bases = [t.data_ptr() for t in theirs.get_hybrid_pool_buffer()]
            o_bases = [t.data_ptr() for t in ours.get_hybrid_pool_buffer()]
            assert [p - t_bases[i % 2] for i, p in enumerate(t_ptrs)] == [p - o_bases[i % 2] for i, p in enumerate(o_ptrs)]
            assert o_sizes == t_sizes
            want = [layer[rows_d].clone() for layer in layers]
            for pool in (theirs, ours):
                for layer in layers:
                    layer.zero_()
                for layer_id in range(2 + drafts):
                    pool.load_to_device_per_layer(None, rows_h, rows_d, layer_id, backend, is_draft=layer_id >= 2)
                assert all(torch.equal(layer[rows_d], w) for layer, w in zip(layers, want)), type(pool).__module__
        finally:
            ours.destroy()
            theirs.destroy()
        assert fake.held() == set()


def test_a_mamba_slot_whose_later_state_starts_off_its_dtypes_alignment_round_trips_as_sglangs(sglang):
    """A slot of a bf16 state with an odd element count before an fp32 one: the fp32 state's
    bytes start in the flat page where fp32 cannot be viewed (SGLang's pool re-bases such a
    piece); set_from_flat_data_page restores it byte for byte, as SGLang's, and a page one byte
    short is refused with nothing written."""
    from sglang.srt.mem_cache.device_pool_info import MambaStateBufferInfo
    from sglang.srt.mem_cache.pool_host.base import host_memory_budget_scope
    from sglang.srt.mem_cache.pool_host.mamba import MambaPoolHost as Theirs

    from hicache.errors import TransferError
    from hicache.pools import MambaPoolHost as Ours

    generator = torch.Generator().manual_seed(5)
    info = MambaStateBufferInfo(temporal=torch.randn(3, 9, 3, 3, generator=generator).to(torch.bfloat16),
                                conv=(torch.randn(3, 9, 2, 3, generator=generator),))  # 3 x 18 B, then fp32
    with fake_cuda() as fake:
        with host_memory_budget_scope(10**12):
            theirs = Theirs(info, 2.0, 0, pin_memory=False, device_capacity=8, layout="page_first_direct")
        ours = Ours(info, 2.0, 0, device_capacity=8, layout="page_first_direct", **ROOM)
        try:
            for a, b in zip(theirs.get_hybrid_pool_buffer(), ours.get_hybrid_pool_buffer()):
                data = torch.randint(0, 256, (a.numel() * a.element_size(),), generator=generator, dtype=torch.uint8)
                a.view(-1).view(torch.uint8).copy_(data)
                b.view(-1).view(torch.uint8).copy_(data)
            page = theirs.get_data_page(2)
            assert torch.equal(ours.get_data_page(2), page)
            for pool in (theirs, ours):
                pool.set_from_flat_data_page(5, page)
            assert torch.equal(ours.get_data_page(5), page) and torch.equal(theirs.get_data_page(5), page)
            before = ours.get_data_page(6)
            with pytest.raises(TransferError, match="bytes"):
                ours.set_from_flat_data_page(6, page[:-1])
            assert torch.equal(ours.get_data_page(6), before)
        finally:
            ours.destroy()
            theirs.destroy()
        assert fake.held() == set()


def test_logical_host_pool_as_sglangs(sglang):
    """DeepSeek-V4's anchor: slots, no memory; SGLang's return values for every call."""
    from sglang.srt.mem_cache.memory_pool_host import LogicalHostPool as Theirs

    from hicache.errors import PlanError
    from hicache.pools import LogicalHostPool as Ours

    theirs, ours = Theirs(8 * PAGE, PAGE), Ours(8 * PAGE, PAGE)
    for field in ("size", "logical_size", "page_size", "device", "layout", "dtype", "layer_num", "start_layer",
                  "end_layer", "kv_buffer", "size_per_token", "allocator", "can_use_write_back_jit",
                  "shared_allocation_domain", "stores_page_envelope", "storage_format_tag"):
        assert getattr(ours, field) == getattr(theirs, field), field
    t, o = theirs.alloc(3 * PAGE), ours.alloc(3 * PAGE)
    assert (o.dtype, o.shape) == (t.dtype, t.shape) and ours.available_size() == theirs.available_size()
    assert ours.alloc(100 * PAGE) is None is theirs.alloc(100 * PAGE)
    assert ours.free(o) == theirs.free(t)
    for pool, error in ((theirs, ValueError), (ours, PlanError)):
        with pytest.raises(error):
            pool.alloc(PAGE + 1)
    assert ours.get_page_buffer_meta(torch.arange(PAGE)) is None is theirs.get_page_buffer_meta(torch.arange(PAGE))
    assert ours.get_data_page(0).numel() == 0 == theirs.get_data_page(0).numel()
    assert ours.get_page_buffer_element_size() is None and ours.get_ksize_per_token() == 0
    assert ours.load_to_device_per_layer_physical(None, None, None, 0, "direct", is_draft=True) is None
    with pytest.raises(PlanError, match="page-aligned"):
        Ours(PAGE + 1, PAGE)
    ours.destroy()


@pytest.mark.parametrize("layout", ["layer_first", "page_first", "page_first_direct"])
def test_dsa_indexer_pool_from_its_declaration_matches(sglang, layout):
    """`DSAIndexerPoolHost(decl, anchor_host)` beside its MLA anchor: the anchor's slots and
    pages, the index buffer, pages, meta and direct transfers as SGLang's."""
    from sglang.srt.mem_cache.memory_pool import DSATokenToKVPool
    from sglang.srt.mem_cache.pool_host.base import host_memory_budget_scope
    from sglang.srt.mem_cache.pool_host.dsa import DSAIndexerPoolHost as Theirs
    from sglang.srt.mem_cache.pool_host.dsa import make_dsa_indexer_pool_decl

    from hicache.pools import DSAIndexerPoolHost as Ours

    theirs_cls, ours_cls = _classes("mla")
    kw = dict(device_capacity_tokens=TOKENS, start_layer=0, end_layer=2, target_layer_num=2)
    with published(), fake_cuda() as fake:  # SGLang's DSA device pool reads the parallel config
        device = DSATokenToKVPool(size=TOKENS, page_size=64, kv_lora_rank=64, dtype=torch.bfloat16,
                                  qk_rope_head_dim=16, layer_num=2, device="cpu", index_head_dim=128,
                                  enable_memory_saver=False, kv_cache_dim=80)
        info = device.get_device_pool_infos()[0].buffer_info
        decl = make_dsa_indexer_pool_decl(device)
        with host_memory_budget_scope(10**12):
            theirs_anchor = theirs_cls(info, 2.0, 0, 64, layout, pin_memory=False, **kw)
            theirs = Theirs(decl, theirs_anchor, pin_memory=False)
        ours_anchor = ours_cls(info, 2.0, 0, 64, layout, **kw, **ROOM)
        ours = Ours(decl, ours_anchor, **ROOM)
        try:
            for field in ("size", "page_num", "page_size", "layer_num", "target_layer_num", "indexer_page_num",
                          "indexer_page_stride_size", "indexer_layout_dim", "indexer_dtype", "size_per_token",
                          "layout", "start_layer", "end_layer", "can_use_write_back_jit"):
                assert getattr(ours, field) == getattr(theirs, field), field
            assert ours.index_k_with_scale_buffer.shape == theirs.index_k_with_scale_buffer.shape
            assert ours.get_ksize_per_token() == theirs.get_ksize_per_token()
            assert ours.available_size() == theirs.available_size()
            generator = torch.Generator().manual_seed(4)
            for layer in device.index_k_with_scale_buffer:
                layer.copy_(torch.randint(0, 255, layer.shape, generator=generator, dtype=torch.uint8))
            rows = torch.arange(64, 3 * 64)  # device pages 1, 2 -> host pages 1, 2
            if layout != "page_first":
                for pool in (theirs, ours):
                    pool.backup_from_device_all_layer(device, rows, rows, "direct")
                assert torch.equal(ours.index_k_with_scale_buffer, theirs.index_k_with_scale_buffer)
            else:
                data = torch.randint(0, 255, theirs.index_k_with_scale_buffer.shape, generator=generator,
                                     dtype=torch.uint8)
                theirs.index_k_with_scale_buffer.copy_(data)
                ours.index_k_with_scale_buffer.copy_(data)
            assert torch.equal(ours.get_data_page(64), theirs.get_data_page(64))
            if layout != "layer_first":
                t_ptrs, t_sizes = theirs.get_page_buffer_meta(rows)
                o_ptrs, o_sizes = ours.get_page_buffer_meta(rows)
                t_base, o_base = theirs.index_k_with_scale_buffer.data_ptr(), ours.index_k_with_scale_buffer.data_ptr()
                assert [p - t_base for p in t_ptrs] == [p - o_base for p in o_ptrs] and o_sizes == t_sizes
            if layout != "page_first":
                want = [layer[1:3].clone() for layer in device.index_k_with_scale_buffer]
                for pool in (theirs, ours):
                    for layer in device.index_k_with_scale_buffer:
                        layer.zero_()
                    for layer_id in range(2):
                        pool.load_to_device_per_layer(device, rows, rows, layer_id, "direct")
                    assert all(torch.equal(layer[1:3], w) for layer, w in zip(device.index_k_with_scale_buffer, want))
        finally:
            for pool in (ours, theirs, ours_anchor, theirs_anchor):
                pool.destroy()
        assert fake.held() == set()


@pytest.mark.parametrize("layout", ["layer_first", "page_first", "page_first_direct"])
def test_deepseek_v4_paged_pool_matches(sglang, layout):
    """`DeepSeekV4PagedHostPool(pool_name, device_buffers, item_bytes, num_host_pages,
    slot_page_size, layout=, page_aligned_only=)`: sizes, buffers, pages and whole-page
    transfers as SGLang's."""
    from sglang.srt.mem_cache.memory_pool_host import DeepSeekV4PagedHostPool as Theirs

    from hicache.pools import DeepSeekV4PagedHostPool as Ours

    generator = torch.Generator().manual_seed(6)
    device_buffers = [torch.randint(0, 255, (16, 512), generator=generator, dtype=torch.uint8) for _ in range(3)]
    args = ("c4", device_buffers, 512, 24, 64)
    by_keyword = dict(pool_name="dsv4_hisparse_c4", device_buffers=device_buffers, item_bytes=512, num_host_pages=24,
                      slot_page_size=64, layout="layer_first")  # hisparse_coordinator.py:580's call
    with fake_cuda() as fake:
        from sglang.srt.mem_cache.pool_host.base import host_memory_budget_scope

        with host_memory_budget_scope(10**12):
            theirs = Theirs(*args, layout=layout, pin_memory=False, page_aligned_only=True)
        ours = Ours(*args, layout=layout, page_aligned_only=True, **ROOM)
        with host_memory_budget_scope(10**12):
            theirs_kw = Theirs(**by_keyword, pin_memory=False)
        ours_kw = Ours(**by_keyword, **ROOM)
        assert [b.shape for b in _buffers(ours_kw)] == [b.shape for b in _buffers(theirs_kw)]
        assert (ours_kw.pool_name, ours_kw.size, ours_kw.layer_num) == (theirs_kw.pool_name, theirs_kw.size,
                                                                         theirs_kw.layer_num)
        ours_kw.destroy()
        theirs_kw.destroy()
        try:
            for field in ("pool_name", "layer_num", "item_bytes", "num_host_pages", "slot_page_size", "page_size",
                          "size", "size_per_token", "dtype", "layout", "start_layer", "end_layer", "page_aligned_only"):
                assert getattr(ours, field) == getattr(theirs, field), field
            assert [b.shape for b in _buffers(ours)] == [b.shape for b in _buffers(theirs)]
            assert ours.available_size() == theirs.available_size()
            device_rows, host_rows = torch.arange(64, 3 * 64), torch.arange(5 * 64, 7 * 64)
            if layout == "page_first":  # SGLang's direct backend has no page_first copy: same bytes by hand
                data = torch.randint(0, 255, theirs.kv_buffer.shape, generator=generator, dtype=torch.uint8)
                theirs.kv_buffer.copy_(data)
                ours.kv_buffer.copy_(data)
            else:
                for pool in (theirs, ours):
                    pool.backup_from_device_all_layer(None, host_rows, device_rows, "direct")
            for a, b in zip(_buffers(theirs), _buffers(ours)):
                assert torch.equal(a, b)
            assert torch.equal(ours.get_data_page(5 * 64), theirs.get_data_page(5 * 64))
        finally:
            ours.destroy()
            theirs.destroy()
        assert fake.held() == set()


@pytest.mark.parametrize("layout", ["layer_first", "page_first"])
def test_deepseek_v4_state_pool_matches(sglang, layout):
    """The DeepSeek-V4 state pool's attributes and buffer shapes match SGLang's, and nothing stays
    registered."""
    from sglang.srt.mem_cache.deepseek_v4_compress_state import CompressStatePool
    from sglang.srt.mem_cache.memory_pool_host import DeepSeekV4StateHostPool as Theirs
    from sglang.srt.mem_cache.pool_host.base import host_memory_budget_scope

    from hicache.pools import DeepSeekV4StateHostPool as Ours

    states = [CompressStatePool(size=64, ring_size=4, overlap=False, head_dim=64, dtype=torch.float32, device="cpu",
                                enable_memory_saver=False, ratio=4, swa_page_size=16) for _ in range(2)]
    with fake_cuda() as fake:
        with host_memory_budget_scope(10**12):
            theirs = Theirs("state", states, 48, 16, layout=layout, pin_memory=False)
        ours = Ours("state", states, 48, 16, layout=layout, **ROOM)
        try:
            for field in ("pool_name", "layer_num", "page_size", "size", "dtype", "layout", "start_layer", "end_layer"):
                assert getattr(ours, field) == getattr(theirs, field), field
            assert [b.shape for b in _buffers(ours)] == [b.shape for b in _buffers(theirs)]
        finally:
            ours.destroy()
            theirs.destroy()
        assert fake.held() == set()


def test_hisparse_coordinators_mla_call_and_slot_helpers_match(sglang):
    """`hisparse_coordinator.py:618`: MLATokenToKVPoolHost(buffer_info=..., device_capacity_tokens=...,
    start_layer=..., end_layer=..., target_layer_num=..., host_to_device_ratio=..., host_size=0,
    page_size=..., layout="layer_first", override_kv_cache_dim=...) - all by keyword - then its
    per-request slot helpers, on the same request tables, give the same slots."""
    device = _device("mla")
    info = device.get_device_pool_infos()[0].buffer_info
    theirs_cls, ours_cls = _classes("mla")
    kw = dict(buffer_info=info, device_capacity_tokens=TOKENS, start_layer=0, end_layer=LAYERS - 1,
              target_layer_num=LAYERS, host_to_device_ratio=2.0, host_size=0, page_size=PAGE, layout="layer_first",
              override_kv_cache_dim=device.kv_cache_dim)
    with fake_cuda() as fake:
        from sglang.srt.mem_cache.pool_host.base import host_memory_budget_scope

        with host_memory_budget_scope(10**12):
            theirs = theirs_cls(pin_memory=False, **kw)
        ours = ours_cls(**kw, **ROOM)
        try:
            for field in ("size", "page_num", "token_stride_size", "kv_cache_dim", "layer_num", "end_layer"):
                assert getattr(ours, field) == getattr(theirs, field), field
            results = []
            for pool in (theirs, ours):
                table = torch.full((4, 8 * PAGE), -1, dtype=torch.int64)
                lengths = torch.zeros(4, dtype=torch.int64)
                got = [pool.alloc_paged_token_slots(table, lengths, 1, 0, 5),
                       pool.alloc_paged_token_slots(table, lengths, 1, 5, PAGE),
                       pool.alloc_paged_token_slots(table, lengths, 2, 0, 3 * PAGE + 1),
                       pool.alloc_paged_token_slots(table, lengths, 1, 0, 0)]
                got.append(pool.allocated_host_indices(table, 1, 5 + PAGE))
                got.append(pool.allocated_host_indices(table, 3, 0))
                results.append((got, lengths.clone(), pool.available_size()))
            (t_got, t_len, t_free), (o_got, o_len, o_free) = results
            assert all(torch.equal(a, b) and a.dtype == b.dtype for a, b in zip(t_got, o_got))
            assert torch.equal(t_len, o_len) and t_free == o_free
        finally:
            ours.destroy()
            theirs.destroy()
        assert fake.held() == set()


def test_a_back_ends_own_allocator_comes_from_sglang_and_hicache_registers_its_memory(sglang):
    """allocator_type="shm" inside SGLang: SGLang's `ShmHostTensorAllocator` (its ``fd``, as
    SGLang's pool exposes it), its memory registered by hicache exactly; a name SGLang has no
    allocator for gets hicache's default."""
    from sglang.srt.mem_cache.pool_host.common import ShmHostTensorAllocator

    from hicache.pools import HostTensorAllocator

    info = _device("mha").get_device_pool_infos()[0].buffer_info
    _, ours_cls = _classes("mha")
    with fake_cuda() as fake:
        shm = ours_cls(info, 2.0, 0, PAGE, "page_first_direct", allocator_type="shm", **KW, **ROOM)
        plain = ours_cls(info, 2.0, 0, PAGE, "page_first_direct", allocator_type="file", **KW, **ROOM)
        try:
            assert isinstance(shm.allocator, ShmHostTensorAllocator) and isinstance(shm.fd, int)
            assert isinstance(plain.allocator, HostTensorAllocator) and plain.fd is None
            recorded = {tuple(r) for r in shm.kv_buffer._sglang_cuda_host_registered_ranges}
            assert recorded and recorded <= fake.held()
            shm.kv_buffer.view(torch.int16).fill_(7)
            assert int(shm.get_data_page(PAGE).view(torch.int16)[0]) == 7
        finally:
            shm.destroy()
            plain.destroy()
        assert fake.held() == set()


def test_a_pool_inside_sglangs_budget_scope_is_admitted_by_it_as_sglangs(sglang):
    """Inside SGLang's `host_memory_budget_scope` (its auto-sizing books every pool built inside
    against one snapshot; its tests give pools a budget so) hicache's pool is admitted by the
    scope, as SGLang's own, where hicache's own figure would refuse (a stated host of 1 MB), and
    books its bytes in it; one past what is left is refused before any memory, naming the scope;
    outside a scope, hicache's budget decides."""
    from sglang.srt.mem_cache.pool_host import base

    from hicache.errors import CapacityError

    _, ours_cls = _classes("mha")
    info = _device("mha").get_device_pool_infos()[0].buffer_info
    tiny = dict(host=HostSetup(host_memory_bytes=10**6))  # hicache's own figure: room for none of it

    def build():
        return ours_cls(info, 2.0, 0, PAGE, "page_first", **KW, **tiny)

    with fake_cuda() as fake:
        with pytest.raises(CapacityError, match="host memory budget refused"):
            build()
        with base.host_memory_budget_scope(10**9):
            pool = build()
            try:
                assert base._host_memory_budget.get() == 10**9 - pool.pool_plan.total_bytes  # booked
            finally:
                pool.destroy()
        with base.host_memory_budget_scope(1000):
            with pytest.raises(CapacityError, match="budget in force has"):
                build()
        assert fake.held() == set()


#: the families whose SGLang 0.5.23 form differs from their older one in its positional
#: arguments: SGLang's class, and the named constructor of that form (bound to the form's builder)
DISPATCHED = {
    "k_only": ("sglang.srt.mem_cache.pool_host.mha", "MHATokenToKOnlyPoolHost", "from_anchor"),
    "dsa": ("sglang.srt.mem_cache.pool_host.dsa", "DSAIndexerPoolHost", "from_decl"),
    "v4_paged": ("sglang.srt.mem_cache.memory_pool_host", "DeepSeekV4PagedHostPool", "from_pool_name"),
    "v4_state": ("sglang.srt.mem_cache.memory_pool_host", "DeepSeekV4StateHostPool", "from_pool_name"),
}


@pytest.mark.parametrize("kind", sorted(DISPATCHED))
def test_a_dispatched_forms_signature_is_sglangs_exactly(sglang, kind):
    """Where one ``__init__`` serves two SGLang signatures that differ in their positional
    arguments (K-only, DSA, DeepSeek-V4), the call is bound once against the builder of its form
    (issue #55 item 1): that builder's signature, which the form's named constructor shows, is
    SGLang 0.5.23's own - names, order, kinds and defaults - plus hicache's ``options``/``host``;
    the class's signature, as tools read it, is that form's too (not ``*args, **kwargs``)."""
    import importlib
    import inspect

    import hicache.pools as ours

    module, name, constructor = DISPATCHED[kind]
    theirs = dict(inspect.signature(getattr(importlib.import_module(module), name).__init__).parameters)
    theirs.pop("self")
    mine = dict(inspect.signature(getattr(getattr(ours, name), constructor)).parameters)
    assert [(n, p.kind, p.default) for n, p in mine.items() if n not in ("options", "host")] == \
        [(n, p.kind, p.default) for n, p in theirs.items()]
    assert [(n, p.kind) for n, p in mine.items() if n in ("options", "host")] == \
        [("options", inspect.Parameter.KEYWORD_ONLY), ("host", inspect.Parameter.KEYWORD_ONLY)]
    assert inspect.signature(getattr(ours, name)) == inspect.signature(getattr(getattr(ours, name), constructor))


#: what hicache's constructors add to SGLang 0.5.23's signature: the older form's first argument
#: by keyword, an anchor-like page count, and its two keyword-only values
HICACHE_KEYWORDS = {"device_pool", "page_num", "options", "host"}


@pytest.mark.parametrize("kind", ["mha", "asym", "mla", "mamba"])
def test_a_pools_signature_is_sglangs_plus_hicaches_own_keywords(sglang, kind):
    """hicache's constructor takes SGLang 0.5.23's parameters by the same names, in the same
    order and kind, with SGLang's defaults (a parameter SGLang requires defaults to None here:
    the older form does without it), and adds only hicache's own keywords (issue #55 item 2)."""
    import inspect

    if kind == "mamba":
        import sglang.srt.mem_cache.pool_host.mamba as smamba

        import hicache.pools as ours

        theirs_cls, ours_cls = smamba.MambaPoolHost, ours.MambaPoolHost
    else:
        theirs_cls, ours_cls = _classes(kind)
    theirs = inspect.signature(theirs_cls.__init__).parameters
    ours_params = inspect.signature(ours_cls.__init__).parameters
    assert all(p.kind is not p.VAR_KEYWORD for p in ours_params.values()), "no **keywords"
    assert set(ours_params) - set(theirs) == HICACHE_KEYWORDS, set(ours_params) - set(theirs)
    positional = [n for n, p in theirs.items() if p.kind is p.POSITIONAL_OR_KEYWORD]
    assert [n for n, p in ours_params.items() if p.kind is p.POSITIONAL_OR_KEYWORD][:len(positional)] == positional
    for name, param in theirs.items():
        mine = ours_params[name]
        if param.kind is param.KEYWORD_ONLY:  # ours may take it by position only where SGLang's older form did
            assert mine.kind in (mine.KEYWORD_ONLY, mine.POSITIONAL_OR_KEYWORD), name
        expected = None if param.default is param.empty and name != "self" else param.default
        if name != "self":
            assert mine.default == expected, (name, mine.default, expected)


def _refused_inputs():
    """(family, what SGLang 0.5.23's device pool hands the host pool, changed in one way hicache's
    pools do not serve, the error's words, whether SGLang's own pool serves it - a
    `NotServedError` - or nobody does: another family's description, KV scales SGLang's own MHA
    and MLA host pools refuse as well (its `token` layout, MLA's FP4)) - docs/sglang.md's
    "Layouts and backends" list; `test_sglangs_own_pools_serve_exactly_what_is_called_not_served`
    holds that flag to SGLang's own constructors."""
    from sglang.srt.mem_cache.device_pool_info import (
        KVBufferLayout, KVScaleBuffers, KVScaleLayout, MambaStateBufferInfo)

    def replace(struct, **changes):
        """msgspec.structs.replace, without naming msgspec (SGLang's dependency) in the suite."""
        fields = {name: getattr(struct, name) for name in struct.__struct_fields__}
        return type(struct)(**{**fields, **changes})

    mha, mla = (_device(kind).get_device_pool_infos()[0].buffer_info for kind in ("mha", "mla"))
    scale = tuple(torch.zeros(TOKENS, 2) for _ in range(LAYERS))
    states = MambaStateBufferInfo(temporal=torch.zeros(2, 9, 16, 32), conv=(torch.zeros(2, 9, 8, 32),))
    return [
        ("mha", replace(mha, scales=KVScaleBuffers(k=scale, v=scale, layout=KVScaleLayout.TOKEN)), {},
         "buffer_info.scales has layout 'token': no host pool of SGLang 0.5.23 copies KV scales", False),
        ("mha", replace(mha, scales=KVScaleBuffers(k=scale, v=scale, layout=KVScaleLayout.MXFP8_INTERLEAVED)), {},
         "buffer_info.scales is set (MXFP8): hicache's MHA host pool does not copy KV scales", True),
        ("mha", replace(mha, transfer_buffers=lambda: (mha.buffers.k[0], mha.buffers.v[0])), {},
         "transfer_buffers (a relocatable device pool) is not supported", True),
        ("mha", replace(mha, buffers=replace(mha.buffers, layout=KVBufferLayout.HND)), {},
         "buffer_info.buffers.layout='hnd' is not supported", True),
        ("mha", mla, {}, "the first argument must be an MHABufferInfo (SGLang 0.5.23) or a device pool (older "
         "SGLang), got MLABufferInfo (no layer_num, head_num)", False),
        ("mla", mha, {}, "the first argument must be an MLABufferInfo or MLAHostAllocation (SGLang 0.5.23) or a "
         "device pool (older SGLang), got MHABufferInfo (no layer_num, kv_lora_rank, qk_rope_head_dim)", False),
        ("mamba", mha, {}, "the first argument must be a MambaStateBufferInfo (SGLang 0.5.23) or a device pool "
         "(older SGLang), got MHABufferInfo (no mamba_cache)", False),
        ("mla", replace(mla, scales=tuple(torch.zeros(TOKENS, 1, 4) for _ in range(LAYERS))), {},
         "buffer_info.scales is set (FP4 KV): packed FP4 payload and block scales cannot be restored", False),
        ("mla", mla, {"layer_shard_enabled": True}, "layer_shard_enabled=True (layer-sharded MLA device pools)", True),
        ("mla", mla, {"target_layer_num": LAYERS + 1}, f"{LAYERS} layer slots but target_layer_num={LAYERS + 1}", True),
        ("mamba", replace(states, extra_checkpoint_buffers=(torch.zeros(9, 4),)), {},
         "buffer_info.extra_checkpoint_buffers (per-slot side state) is not supported", True),
    ]


def test_what_sglang_serves_and_hicaches_pools_do_not_is_refused_by_name_before_any_memory(sglang):
    """docs/sglang.md's list, from SGLang 0.5.23's own device-pool descriptions: KV scales (MHA
    and MLA), a relocatable device pool (``transfer_buffers``), a non-token-row buffer layout,
    another family's description, layer-sharded MLA, layer slots that are not the target's
    layers and Mamba's per-slot side state - and another family's description (it failed deep in
    the geometry as a bare AttributeError) - each a LayoutError naming it, raised before the pool
    registers a byte (the fake driver sees no call); a NotServedError exactly where SGLang's own
    pool serves it."""
    from hicache.errors import LayoutError, NotServedError
    from hicache.pools import MambaPoolHost

    cases = _refused_inputs()
    with fake_cuda() as fake:
        for family, info, extra, words, sglang_serves in cases:
            with pytest.raises(NotServedError if sglang_serves else LayoutError, match=re.escape(words)) as caught:
                if family == "mamba":
                    MambaPoolHost(info, 2.0, 0, device_capacity=8, layout="page_first", **ROOM)
                else:
                    _build(_classes(family)[1], family, info, "page_first", hicache=True, **extra)
            assert isinstance(caught.value, NotServedError) == sglang_serves, words
            assert fake.held() == set() and fake.cudart.register_calls == 0, words


def test_sglangs_own_pools_serve_exactly_what_is_called_not_served(sglang):
    """The oracle for `NotServedError`'s word "SGLang's own pool serves it": each refused input,
    handed to SGLang 0.5.23's own host-pool class - as its assembler picks it
    (`get_mha_host_pool_cls` routes MXFP8 scales to its MXFP8 pool) - is built exactly where
    hicache's refusal is a `NotServedError`, and refused where it is not. MXFP8's pool needs
    CUDA's write-back kernel to be built; on CPU its refusal must say so, and nothing else."""
    from sglang.srt.mem_cache.pool_host.base import host_memory_budget_scope
    from sglang.srt.mem_cache.pool_host.mamba import MambaPoolHost as SGLangMamba
    from sglang.srt.mem_cache.pool_host.mha import get_mha_host_pool_cls

    from hicache.pools._sglang_inputs import is_mha_info

    with fake_cuda():
        for family, info, extra, words, sglang_serves in _refused_inputs():
            try:
                if family == "mamba":
                    with host_memory_budget_scope(10**12):
                        pool = SGLangMamba(info, 2.0, 0, device_capacity=8, layout="page_first", pin_memory=False)
                else:
                    cls = get_mha_host_pool_cls(info) if family == "mha" and is_mha_info(info) else _classes(family)[0]
                    pool = _build(cls, family, info, "page_first", hicache=False, **extra)
            except Exception as error:  # noqa: BLE001 - SGLang refuses with ValueError, AttributeError, ...
                assert not sglang_serves or "MXFP8" in words and "CUDA" in str(error), (words, error)
            else:
                assert sglang_serves, words
                pool.destroy()
