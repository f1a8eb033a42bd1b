"""SGLang 0.5.23's own controller over SGLang's own host pools with the hicache plug-in loaded:
`HybridCacheController` (what `UnifiedRadixCache` drives) over a `HostPoolGroup` whose pool
SGLang's assembler built - its registration hicache's (under `fake_cuda`) - writes device pages
to host through `L2TransferEngine`, and loads them back into a cleared device pool byte for
byte, with SGLang's "direct" and "kernel" io_backends (their sgl-kernel copies stood in for on CPU by
`hicache.testing.sglang_on_cpu`). Needs `make sglang`."""

from __future__ import annotations

import contextlib
import threading

import pytest
from machine import roomy_psutil  # noqa: F401 - a fixture
from sglang_support import published, sglang  # noqa: F401 - sglang: a fixture

from hicache.testing import fake_cuda

pytestmark = pytest.mark.concurrency  # processes, threads, signals or waits: `make test-loaded`

torch = pytest.importorskip("torch")

PAGE, LAYERS = 16, 3


def _device_pool(kind: str):
    from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool, MLATokenToKVPool

    if kind == "mha":
        return MHATokenToKVPool(size=256, page_size=PAGE, dtype=torch.bfloat16, head_num=2, head_dim=64,
                                layer_num=LAYERS, device="cpu", enable_memory_saver=False)
    return MLATokenToKVPool(size=256, page_size=PAGE, dtype=torch.bfloat16, kv_lora_rank=64, qk_rope_head_dim=16,
                            layer_num=LAYERS, device="cpu", enable_memory_saver=False)


def _layers(device, kind: str) -> list:
    if kind == "mha":
        return [*device.k_buffer, *device.v_buffer]
    return list(device.kv_buffer)


def _host_rows(host, kind: str, layout: str, j: int, indices):
    """Rows ``indices`` of device layer ``j`` (in `_layers` order) where SGLang's layout puts them
    in the host buffer - read by hand from the shapes, independent of the copy code."""
    kv = host.kv_buffer[j // LAYERS] if kind == "mha" else host.kv_buffer  # K then V for MHA
    layer = j % LAYERS
    if layout == "layer_first":  # [layer, token, ...]
        return kv[layer][indices]
    if layout == "page_first":  # [token, layer, ...]
        return kv[indices, layer]
    if layout == "page_head":  # [page, head, token, layer, dim]
        return kv[indices // PAGE, :, indices % PAGE, layer]
    return kv[indices // PAGE, layer, indices % PAGE]  # page_first_direct: [page, layer, token, ...]


def _round_trip(controller, allocator, device, host, kind: str, layout: str, *, seed: int, pages: int) -> None:
    """The controller writes ``pages`` device pages to the host - checked where SGLang's layout
    puts them there, not just round trip - then loads them into a cleared device pool: byte-exact."""
    generator = torch.Generator().manual_seed(seed)
    written = allocator.alloc(pages * PAGE)
    for layer in _layers(device, kind):
        layer[written] = torch.randn(layer[written].shape, generator=generator).to(layer.dtype)
    want = [layer[written].clone() for layer in _layers(device, kind)]
    host_indices = controller.write(written)
    assert host_indices is not None and len(host_indices) == len(written)
    for ack in controller.ack_write_queue:
        ack.finish_event.synchronize()
    for j, rows in enumerate(want):
        assert torch.equal(_host_rows(host, kind, layout, j, host_indices).view(torch.int16), rows.view(torch.int16))
    allocator.free(written)
    for layer in _layers(device, kind):
        layer.zero_()
    loaded = controller.load(host_indices)
    controller.start_loading()
    for ack in controller.ack_load_queue:
        ack.finish_event.synchronize()
    got = [layer[loaded] for layer in _layers(device, kind)]
    assert all(torch.equal(a.view(torch.int16), b.view(torch.int16)) for a, b in zip(got, want))


@contextlib.contextmanager
def _assembled_host(monkeypatch, pools: str, kind: str, layout: str, backend: str = "direct", **build):
    """SGLang's assembler builds the host pool of a device pool of ``kind`` - SGLang's own class
    (pools="sglang": hicache registers its buffers) or, with HICACHE_SGLANG_POOLS=1, hicache's -
    under the fake driver; yields ``(fake, allocator, device, host)`` and destroys the pool
    after (also when an assertion failed: nothing left for the next test), then checks that
    nothing stays registered."""
    import sglang.srt.plugins as plugins
    from sglang.srt.mem_cache.allocator.paged import PagedTokenToKVPoolAllocator
    from sglang.srt.mem_cache.hybrid_cache.hybrid_pool_assembler import build_kv_host_pool
    from sglang.srt.mem_cache.pool_host.base import host_memory_budget_scope

    if pools == "hicache":
        monkeypatch.setenv("HICACHE_SGLANG_POOLS", "1")
    plugins.load_plugins()
    settings = dict(page_size=PAGE, enable_hierarchical_cache=True, hicache_ratio=2.0, hicache_mem_layout=layout,
                    hicache_io_backend=backend)
    with published(**settings), fake_cuda() as fake:
        device = _device_pool(kind)
        allocator = PagedTokenToKVPoolAllocator(256, PAGE, torch.bfloat16, "cpu", device, False)
        with host_memory_budget_scope(10**12):
            host = build_kv_host_pool(kv_pool=device, page_size=PAGE, **build)
        assert type(host).__module__.startswith("hicache.pools" if pools == "hicache" else "sglang.")
        try:
            yield fake, allocator, device, host
        finally:
            host.destroy()
        assert fake.held() == set()


@pytest.mark.parametrize("pools", ["sglang", "hicache"])
@pytest.mark.parametrize("kind, layout, backend", [
    (kind, layout, backend) for kind in ("mha", "mla") for layout, backend in (
        ("layer_first", "direct"), ("page_first_direct", "direct"), ("page_first", "kernel"), ("layer_first", "kernel"))
] + [("mha", "page_head", "kernel")])
def test_sglangs_controller_round_trips_pages_byte_exact_over_a_plugged_pool(sglang, monkeypatch, roomy_psutil,
                                                                            kind, layout, backend, pools):
    """pools="sglang": SGLang's own pool classes (hicache registers their buffers);
    pools="hicache": HICACHE_SGLANG_POOLS=1 - the plug-in's class REPLACE, so SGLang's assembler
    builds hicache's pool and SGLang's controller drives it. SGLang's defaults (page_first with
    the kernel backend: sgl-kernel's kvcacheio ops on CPU for SGLang's pools) included; both put
    every row where SGLang's layout says."""
    from sglang.srt.mem_cache.hicache_storage import PoolName
    from sglang.srt.mem_cache.hybrid_cache.hybrid_cache_controller import HybridCacheController
    from sglang.srt.mem_cache.pool_host import HostPoolGroup, PoolEntry

    with _assembled_host(monkeypatch, pools, kind, layout, backend) as (fake, allocator, device, host):
        buffers = host.kv_buffer if isinstance(host.kv_buffer, list) else [host.kv_buffer]
        assert {tuple(r) for b in buffers for r in b._sglang_cuda_host_registered_ranges} == fake.held() != set()
        group = HostPoolGroup([PoolEntry(name=PoolName.KV, host_pool=host, device_pool=device,
                                         layer_mapper=lambda layer: layer, is_primary_index_anchor=True)])
        controller = HybridCacheController(allocator, group, PAGE, None, threading.Event(), io_backend=backend)
        _round_trip(controller, allocator, device, host, kind, layout, seed=11, pages=5)
    fake.check_valid()


@pytest.mark.parametrize("pools", ["sglang", "hicache"])
@pytest.mark.parametrize("kind", ["mha", "mla"])
@pytest.mark.parametrize("layout, backend", [("page_first_direct", "direct"), ("page_first", "kernel")])
def test_decode_offloads_hicache_controller_round_trips_pages_byte_exact(sglang, monkeypatch, roomy_psutil, kind,
                                                                         pools, layout, backend):
    """Decode-side KV offload (`disaggregation/decode_kvcache_offload_manager.py`): SGLang's
    assembler builds the host pool for a flat device pool and SGLang's `HiCacheController` (no
    HostPoolGroup) backs pages up and loads them back - over SGLang's pool and, with
    HICACHE_SGLANG_POOLS=1, over hicache's."""
    from sglang.srt.managers.cache_controller import HiCacheController

    with _assembled_host(monkeypatch, pools, kind, layout, backend, use_mla=kind == "mla") as (_, allocator, device,
                                                                                             host):
        controller = HiCacheController(token_to_kv_pool_allocator=allocator, mem_pool_host=host, page_size=PAGE,
                                       tp_group=None, load_cache_event=threading.Event(), io_backend=backend)
        _round_trip(controller, allocator, device, host, kind, layout, seed=13, pages=4)


@pytest.mark.parametrize("kind", ["mha", "mla"])
def test_a_backend_hicaches_pools_cannot_serve_fails_the_build_naming_the_pair_and_flag(sglang, monkeypatch,
                                                                                       roomy_psutil, kind):
    """A server started with --hicache-io-backend kernel_ascend and hicache's pools: SGLang's
    assembler's build raises, naming the pair and the flag, before anything is registered - not
    the first write-back on the scheduler thread (that once took the server down)."""
    import sglang.srt.plugins as plugins
    from sglang.srt.mem_cache.hybrid_cache.hybrid_pool_assembler import build_kv_host_pool
    from sglang.srt.mem_cache.pool_host.base import host_memory_budget_scope

    from hicache.errors import LayoutError

    monkeypatch.setenv("HICACHE_SGLANG_POOLS", "1")
    plugins.load_plugins()
    settings = dict(page_size=PAGE, enable_hierarchical_cache=True, hicache_ratio=2.0,
                    hicache_mem_layout="page_first", hicache_io_backend="kernel_ascend")
    with published(**settings), fake_cuda() as fake:
        device = _device_pool(kind)
        with host_memory_budget_scope(10**12), pytest.raises(LayoutError) as raised:
            build_kv_host_pool(kv_pool=device, page_size=PAGE)
        assert fake.cudart.log == [] and fake.held() == set()
    message = str(raised.value)
    assert "'kernel_ascend' with layout 'page_first'" in message and "--hicache-io-backend kernel" in message
