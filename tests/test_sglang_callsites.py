"""SGLang's call sites, called exactly as SGLang calls them (../shared/reference/sglang-callsites.md):
constructors with SGLang's defaults, pool-local layer ids on a pipeline stage, flat pages and
zero-copy meta for L3 back ends, HiSparse helpers, and a destroyed pool refusing work."""

from __future__ import annotations

import pytest
from doors import doors
from machine import ROOMY, roomy_psutil  # noqa: F401 - roomy_psutil: a fixture

from hicache.errors import RegistrationStateError, TransferError
from hicache.plan import Limits
from hicache.pools import (
    HICACHE_HOST_MEMORY_RESERVE_BYTES,
    AsymmetricMHATokenToKVPoolHost,
    MHATokenToKVPoolHost,
    MLATokenToKVPoolHost,
    get_mha_host_pool_cls)
from hicache.testing import AsymmetricMHADevicePool, MHADevicePool, MLADevicePool, fake_cuda
from hicache.effects import HostSetup

torch = pytest.importorskip("torch")
P = 4


def _mha(**kw):
    kw.setdefault("size", 64)
    return MHADevicePool(layer_num=3, head_num=2, head_dim=8, page_size=P, **kw)


def test_hiradix_cache_constructs_the_mha_pool_with_sglang_defaults(roomy_psutil):
    """HiRadixCache: MHATokenToKVPoolHost(kv_cache, ratio, size, page_size, layout) - pinned,
    on the CPU, default allocator; on a CPU box under hicache.testing.fake_cuda."""
    with fake_cuda() as cuda:
        host = MHATokenToKVPoolHost(_mha(), 2.0, 0, P, "page_first_direct")
        assert host.pin_memory is True and host.device == "cpu" and host.pool_label == "kv"
        assert cuda.held() == {(r.ptr, r.size) for r in host.registration.ranges}
        host.destroy()
        assert cuda.held() == set()


def test_the_assembler_passes_the_storage_backend_and_a_pool_label(roomy_psutil):
    """hybrid_pool_assembler: cls(kv_pool, ratio, size, page_size, layout,
    allocator_type=server_args.hicache_storage_backend, pool_label=...)."""
    for backend in (None, "file", "mooncake", "nixl"):
        host = MHATokenToKVPoolHost(_mha(), 2.0, 0, P, "page_first", allocator_type=backend, pool_label="full",
                                    pin_memory=False)
        assert host.pool_label == "full"
        host.destroy()


def test_get_mha_host_pool_cls_picks_asymmetric_when_head_dims_differ():
    """SGLang's get_mha_host_pool_cls picks the asymmetric pool when K and V head dims differ, the
    plain one otherwise."""
    assert get_mha_host_pool_cls(_mha()) is MHATokenToKVPoolHost
    asym = AsymmetricMHADevicePool(size=64, layer_num=3, head_num=2, k_head_dim=12, v_head_dim=4, page_size=P)
    assert get_mha_host_pool_cls(asym) is AsymmetricMHATokenToKVPoolHost


def test_hisparse_builds_mla_with_keywords_and_an_overridden_dim(roomy_psutil):
    """hisparse_coordinator: MLATokenToKVPoolHost(device_pool=..., host_to_device_ratio=...,
    host_size=0, page_size=..., layout="layer_first", override_kv_cache_dim=...) and then
    reads token_stride_size."""
    device = MLADevicePool(size=64, layer_num=3, kv_lora_rank=16, qk_rope_head_dim=4, page_size=P)
    host = MLATokenToKVPoolHost(device_pool=device, host_to_device_ratio=2.0, host_size=0, page_size=P,
                                layout="layer_first", override_kv_cache_dim=24, pin_memory=False)
    assert host.kv_cache_dim == 24 and host.token_stride_size == 24 * 2
    assert host.kv_buffer.shape[-1] == 24
    host.destroy()


def _pool(device, layout, cls=MHATokenToKVPoolHost, **kw):
    return cls(device, 2.0, 0, P, layout, False, "cpu", **doors(limits=Limits(chunk_limit_bytes=8192), machine=ROOMY, **kw))


@pytest.mark.parametrize("end_layer", ["exclusive", "inclusive"])
def test_a_pipeline_stage_loads_every_layer_by_pool_local_id(end_layer):
    """A stage with start_layer 4: the controller loads ids 0..layer_num-1 (never from
    end_layer, which SGLang sets inclusive when the caller gave none)."""
    device = _mha(start_layer=4)
    device.end_layer = 4 + 3 if end_layer == "exclusive" else 4 + 3 - 1
    device.randomize(1)
    host = _pool(device, "layer_first")
    assert (host.start_layer, host.end_layer, host.layer_num) == (4, 7, 3)  # the stage's layers, end exclusive
    host_idx = host.alloc(2 * P)
    device_idx = torch.arange(4 * P, 6 * P)
    host.backup_from_device_all_layer(device, host_idx, device_idx, "direct")
    expected = [t[4 * P:6 * P].clone() for t in device.tensors()]
    device.zero()
    for i in range(device.layer_num):
        host.load_to_device_per_layer(device, host_idx, device_idx, i, "direct")
    assert all(torch.equal(t[4 * P:6 * P], e) for t, e in zip(device.tensors(), expected))
    with pytest.raises(TransferError, match=r"layer_id 3 out of range \[0, 3\)"):
        host.load_to_device_per_layer(device, host_idx, device_idx, 3, "direct")
    host.destroy()


@pytest.mark.parametrize("layout", ["layer_first", "page_first", "page_first_direct"])
@pytest.mark.parametrize("family", ["mha", "mla"])
def test_flat_pages_are_the_buffer_page_narrowed_on_the_token_axis(family, layout):
    """get_data_page(i) with an int or a 0-d tensor = the page slice of kv_buffer, flattened in
    the buffer's dims (as SGLang's, so an L3 store is shared); set_from_flat_data_page inverts it;
    the dummy page has its shape."""
    if family == "mha":
        device, cls = _mha(), MHATokenToKVPoolHost
    else:
        device, cls = MLADevicePool(size=64, layer_num=3, kv_lora_rank=16, qk_rope_head_dim=4, page_size=P), MLATokenToKVPoolHost
    host = _pool(device, layout, cls)
    buffer = host.kv_buffer
    buffer.copy_(torch.randn(buffer.shape).to(buffer.dtype))
    token_axis = {"mha": {"layer_first": 2, "page_first": 1}, "mla": {"layer_first": 1, "page_first": 0}}[family].get(layout)
    index = torch.tensor(2 * P)  # a 0-d tensor, as host_indices[i * page_size]
    page = host.get_data_page(index, flat=True)
    if token_axis is not None:
        assert torch.equal(page, buffer.narrow(token_axis, 2 * P, P).flatten())
    else:  # page_first_direct: pages are an axis of their own
        page_axis = 1 if family == "mha" else 0
        assert torch.equal(page, buffer.narrow(page_axis, 2, 1).flatten())
    dummy = host.get_dummy_flat_data_page()
    assert dummy.shape == page.shape and dummy.dtype == page.dtype and dummy.is_contiguous()
    host.set_from_flat_data_page(3 * P, page)
    assert torch.equal(host.get_data_page(3 * P), page)
    host.destroy()


def test_zero_copy_meta_sizes_and_alignment_as_the_backends_read_them():
    """mooncake/nixl: per page a K and a V pointer (MHA) or one (MLA), inside kv_buffer;
    ksize per token; stride alignment False for layer_first; k_buffer/v_buffer views."""
    host = _pool(_mha(), "page_first")
    ptrs, sizes = host.get_page_buffer_meta(torch.arange(2 * P, 4 * P))
    per_block = host.layer_num * 2 * P * 2 * 8  # layers x itemsize x page x heads x dim
    assert sizes == [per_block] * 4 and len(ptrs) == 4
    base, end = host.kv_buffer.data_ptr(), host.kv_buffer.data_ptr() + host.kv_buffer.numel() * 2
    assert all(base <= p and p + s <= end for p, s in zip(ptrs, sizes))
    assert ptrs[0] == host.k_buffer[2 * P:].data_ptr() and ptrs[1] == host.v_buffer[2 * P:].data_ptr()
    assert host.get_ksize_per_token() == host.size_per_token // 2
    assert torch.equal(host.k_buffer, host.kv_buffer[0]) and hasattr(host, "v_buffer")
    host.destroy()
    mla = _pool(MLADevicePool(size=64, layer_num=3, kv_lora_rank=16, qk_rope_head_dim=4, page_size=P),
                "page_first_direct", MLATokenToKVPoolHost)
    ptrs, sizes = mla.get_page_buffer_meta([0, 1, 2, 3])
    assert len(ptrs) == 1 and sizes == [3 * 2 * P * 20] and not hasattr(mla, "v_buffer")
    assert mla.get_ksize_per_token() == mla.size_per_token
    mla.destroy()
    layer_first = _pool(_mha(), "layer_first")
    assert layer_first.is_stride_page_aligned(64) is False
    ptrs, sizes = layer_first.get_page_buffer_meta(torch.arange(P, 2 * P))  # as SGLang's: per layer, K then V
    assert sizes == [P * 2 * 8 * 2] * (2 * layer_first.layer_num)
    assert ptrs[:2] == [layer_first.k_buffer[0, P:].data_ptr(), layer_first.v_buffer[0, P:].data_ptr()]
    assert ptrs[-1] == layer_first.v_buffer[layer_first.layer_num - 1, P:].data_ptr()
    layer_first.destroy()
    assert HICACHE_HOST_MEMORY_RESERVE_BYTES == 10 * 1024**3


def test_a_destroyed_pool_refuses_every_use():
    """After destroy() every pool operation raises RegistrationStateError saying it was
    destroyed."""
    host = _pool(_mha(), "page_first")
    slots = host.alloc(P)
    host.destroy()
    host.destroy()  # idempotent
    for call in (lambda: host.alloc(P), lambda: host.free(slots), host.available_size, host.clear,
                 lambda: host.get_data_page(0),
                 lambda: host.load_to_device_per_layer(_mha(), slots, torch.arange(P), 0, "direct")):
        with pytest.raises(RegistrationStateError, match="destroyed"):
            call()


@pytest.mark.parametrize("page_size", [1, P])
def test_an_index_equal_to_the_slot_count_is_refused(page_size):
    """A host or device index equal to the slot count is a TransferError naming which, never a wild
    copy."""
    device = MHADevicePool(size=64, layer_num=2, head_num=2, head_dim=8, page_size=page_size)
    host = MHATokenToKVPoolHost(device, 2.0, 0, page_size, "page_first", False, "cpu",
                                host=HostSetup(limits=Limits(chunk_limit_bytes=8192), machine=ROOMY))
    slots = torch.arange(host.size - page_size, host.size)  # the last page: fine
    host.backup_from_device_all_layer(device, slots, torch.arange(page_size), "direct")
    with pytest.raises(TransferError, match="host_indices out of range"):
        host.backup_from_device_all_layer(device, slots + 1, torch.arange(page_size), "direct")
    device_slots = device.k_buffer[0].shape[0]
    with pytest.raises(TransferError, match="device_indices out of range"):
        host.load_to_device_per_layer(device, slots, torch.arange(device_slots - page_size + 1, device_slots + 1), 0, "direct")
    host.destroy()


def test_the_assembler_builds_the_mamba_pool_as_sglang_does(roomy_psutil):
    """MambaPoolHost(mamba_pool, ratio, size, allocator_type=..., layout=...) against SGLang's
    MambaPool, which has num_mamba_layers and mamba_cache but no store_dtype or layer_num."""
    from types import SimpleNamespace

    from hicache.pools import MambaPoolHost

    layers, slots = 3, 16
    cache = SimpleNamespace(
        temporal=torch.randn(layers, slots + 1, 2, 4),
        conv=[torch.randn(layers, slots + 1, 3, 2).to(torch.bfloat16)])
    mamba_pool = SimpleNamespace(num_mamba_layers=layers, mamba_cache=cache, size=slots, device="cpu")
    with fake_cuda() as cuda:
        host = MambaPoolHost(mamba_pool, 2.0, 0, allocator_type="file", layout="page_first")
        assert host.layer_num == layers and host.page_size == 1 and host.dtype == torch.bfloat16
        assert cuda.held()
        slots_ = host.alloc(2)
        device_idx = torch.tensor([3, 7])
        expected = [cache.temporal[:, device_idx].clone(), cache.conv[0][:, device_idx].clone()]
        host.backup_from_device_all_layer(mamba_pool, slots_, device_idx, "direct")
        cache.temporal.zero_()
        cache.conv[0].zero_()
        for layer in range(layers):
            host.load_to_device_per_layer(mamba_pool, slots_, device_idx, layer, "direct")
        assert torch.equal(cache.temporal[:, device_idx], expected[0])
        assert torch.equal(cache.conv[0][:, device_idx], expected[1])
        host.destroy()
        assert cuda.held() == set()


@pytest.mark.parametrize("layout", ["layer_first", "page_first", "page_first_direct"])
def test_deepseek_v4_paged_pool_as_sglang_builds_it(layout):
    """DeepSeekV4PagedHostPool(pool_name=..., device_buffers=..., item_bytes=...,
    num_host_pages=..., slot_page_size=..., layout=...): transfers use the device buffers
    given at construction (the device_pool argument is ignored, as SGLang's does), alloc
    rounds up to slot pages, pages and page meta are per layer (layer_first) or one row."""
    from hicache.pools import DeepSeekV4PagedHostPool

    layers, rows, item, slot_page = 3, 12, 48, 4
    buffers = [torch.randint(0, 256, (rows, item), dtype=torch.uint8) for _ in range(layers)]
    host = DeepSeekV4PagedHostPool(pool_name="c4", device_buffers=buffers, item_bytes=item, num_host_pages=8,
                                   slot_page_size=slot_page, layout=layout, pin_memory=False,
                                   host=HostSetup(machine=ROOMY, limits=Limits(chunk_limit_bytes=8192)))
    assert host.layer_num == layers and host.size == 8 * slot_page and host.get_ksize_per_token() == item
    slots = host.alloc(5)  # rounded up to two slot pages
    assert slots.numel() == 2 * slot_page
    device_idx = torch.arange(3 * slot_page, 5 * slot_page)  # device rows 3 and 4
    expected = [b[3:5].clone() for b in buffers]
    host.backup_from_device_all_layer(object(), slots, device_idx, "direct")
    for b in buffers:
        b.zero_()
    for layer in range(layers):
        host.load_to_device_per_layer(object(), slots, device_idx, layer, "direct")
    assert all(torch.equal(b[3:5], e) for b, e in zip(buffers, expected))
    page = host.get_data_page(slots[slot_page])  # the second host page: device row 4
    assert torch.equal(page, torch.stack([e[1] for e in expected]).flatten())
    ptrs, sizes = host.get_page_buffer_meta(slots)
    assert sizes == ([item] * layers * 2 if layout == "layer_first" else [layers * item] * 2)
    host.destroy()


def test_deepseek_v4_state_pool_as_sglang_builds_it():
    """DeepSeekV4StateHostPool(pool_name, state_pools, num_host_pages, swa_page_size, ...):
    a page row is ring_size state slots; it reuses SWA indices (alloc is NotImplementedError)."""
    from types import SimpleNamespace

    from hicache.pools import DeepSeekV4StateHostPool

    ring, swa_page = 2, 4
    states = [SimpleNamespace(kv_score_buffer=SimpleNamespace(kv_score=torch.randn(9, 3, 2)), ring_size=ring)
              for _ in range(2)]
    host = DeepSeekV4StateHostPool("state", states, 6, swa_page, layout="page_first", pin_memory=False,
                                   host=HostSetup(machine=ROOMY, limits=Limits(chunk_limit_bytes=8192)))
    assert host.size_per_token == ring * 3 * 2 * 4  # ring_size x slot bytes
    with pytest.raises(NotImplementedError):
        host.alloc(swa_page)
    host_idx, device_idx = torch.arange(2 * swa_page, 3 * swa_page), torch.arange(swa_page, 2 * swa_page)
    expected = [s.kv_score_buffer.kv_score[ring:2 * ring].clone() for s in states]  # device page 1
    host.backup_from_device_all_layer(None, host_idx, device_idx, "direct")
    for s in states:
        s.kv_score_buffer.kv_score.zero_()
    for layer in range(2):
        host.load_to_device_per_layer(None, host_idx, device_idx, layer, "direct")
    assert all(torch.equal(s.kv_score_buffer.kv_score[ring:2 * ring], e) for s, e in zip(states, expected))
    host.destroy()


@pytest.mark.parametrize("start_layer, end_layer", [(0, "exclusive"), (0, "inclusive"), (4, "exclusive")])
@pytest.mark.parametrize("layout", ["layer_first", "page_first_direct"])
@pytest.mark.parametrize("family", ["mha", "mla"])
def test_backup_then_l3_then_load_of_every_layer_is_byte_exact(roomy_psutil, family, layout, start_layer, end_layer):
    """The whole HiCache path as SGLang drives it: the pool built as HiRadixCache builds it,
    backup, pages out to an L3 store (file-style flat pages; zero-copy page pointers where the
    layout allows), the host copies dropped, pages back from L3 into other host slots, then
    every layer loaded by pool-local id - byte-exact, also on a pipeline stage."""
    import ctypes

    if family == "mha":
        device = MHADevicePool(size=64, layer_num=3, head_num=2, head_dim=8, page_size=P, start_layer=start_layer)
        cls = MHATokenToKVPoolHost
    else:
        device = MLADevicePool(size=64, layer_num=3, kv_lora_rank=16, qk_rope_head_dim=4, page_size=P,
                               start_layer=start_layer)
        cls = MLATokenToKVPoolHost
    device.end_layer = start_layer + 3 if end_layer == "exclusive" else start_layer + 2
    assert all(t.shape[0] == 64 + P for t in device.tensors())  # SGLang's padding page
    device.randomize(11)
    original = [t.clone() for t in device.tensors()]
    device_idx = torch.cat([torch.arange(2 * P, 3 * P), torch.arange(9 * P, 11 * P)])  # pages 2, 9, 10
    with fake_cuda() as cuda:
        host = cls(device, 2.0, 0, P, layout)  # as HiRadixCache calls it
        host_idx = host.alloc(device_idx.numel())
        host.backup_from_device_all_layer(device, host_idx, device_idx, "direct")
        pages = [host_idx[i * P] for i in range(device_idx.numel() // P)]  # 0-d tensors, as the controller
        store = {i: host.get_data_page(page, flat=True).clone() for i, page in enumerate(pages)}
        zero_copy = {}
        if layout == "page_first_direct":
            ptrs, sizes = host.get_page_buffer_meta(host_idx)
            per_page = len(ptrs) // len(pages)
            zero_copy = {i: [ctypes.string_at(p, s) for p, s in zip(ptrs[i * per_page:(i + 1) * per_page],
                                                                     sizes[i * per_page:(i + 1) * per_page])]
                         for i in range(len(pages))}
        host.free(host_idx)
        host.kv_buffer.zero_()  # the host copies are gone; L3 has them
        restored = host.alloc(device_idx.numel() + P)[P:]  # other slots than before
        for i in range(len(pages)):
            slot = restored[i * P]
            if zero_copy:
                ptrs, sizes = host.get_page_buffer_meta(restored[i * P:(i + 1) * P])
                for ptr, size, blob in zip(ptrs, sizes, zero_copy[i]):
                    assert len(blob) == size
                    ctypes.memmove(ptr, blob, size)
                assert torch.equal(host.get_data_page(slot), store[i])  # both stores agree
            else:
                host.set_from_flat_data_page(slot, store[i])
        device.zero()
        for layer_id in range(device.layer_num):
            host.load_to_device_per_layer(device, restored, device_idx, layer_id, "direct")
        for before, after in zip(original, device.tensors()):
            assert torch.equal(after[device_idx], before[device_idx])
            untouched = torch.ones(after.shape[0], dtype=torch.bool)
            untouched[device_idx] = False
            assert after[untouched].count_nonzero() == 0
        host.destroy()
        assert cuda.held() == set()
