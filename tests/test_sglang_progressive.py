"""Serving before the pool is pinned, inside SGLang 0.5.23: with HICACHE_SGLANG_POOLS=1 and
HICACHE_PROGRESSIVE=1 the plug-in makes SGLang's assembler build hicache's progressive pool,
and SGLang's real `HybridCacheController` writes to it while registration continues (a fake
driver at 10 GB/s): each write lands on registered pages or is skipped (``None``, which SGLang's
controller handles), never an error, never a page outside the registered ranges; after
`wait_ready()` every write succeeds. Needs `make sglang`."""

from __future__ import annotations

import threading

import pytest
from machine import roomy_psutil  # noqa: F401 - a fixture
from sglang_support import published, sglang  # noqa: F401 - sglang: a fixture

from hicache.testing import fake_cuda

pytestmark = pytest.mark.concurrency  # processes, threads, signals or waits: `make test-loaded`

torch = pytest.importorskip("torch")

PAGE, LAYERS, DEVICE_TOKENS = 16, 3, 512


def _covered(held, ptr: int, size: int) -> bool:
    """[ptr, ptr + size) lies inside the registered ranges (merged where they touch)."""
    end, position = ptr + size, ptr
    for start, length in sorted(held):
        if start <= position < start + length:
            position = start + length
            if position >= end:
                return True
    return position >= end


def test_sglangs_controller_writes_while_the_pool_registers_and_after_it_is_ready(sglang, monkeypatch, roomy_psutil):
    """SGLang's controller writes to a progressive hicache pool while it registers, and only into
    registered ranges."""
    import sglang.srt.plugins as plugins
    from sglang.srt.mem_cache.allocator.paged import PagedTokenToKVPoolAllocator
    from sglang.srt.mem_cache.hicache_storage import PoolName
    from sglang.srt.mem_cache.hybrid_cache.hybrid_cache_controller import HybridCacheController
    from sglang.srt.mem_cache.hybrid_cache.hybrid_pool_assembler import build_kv_host_pool
    from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool
    from sglang.srt.mem_cache.pool_host import HostPoolGroup, PoolEntry

    monkeypatch.setenv("HICACHE_SGLANG_POOLS", "1")
    monkeypatch.setenv("HICACHE_PROGRESSIVE", "1")
    plugins.load_plugins()
    settings = dict(page_size=PAGE, enable_hierarchical_cache=True, hicache_size=0.4,
                    hicache_mem_layout="page_first_direct", hicache_io_backend="direct")
    with published(**settings), fake_cuda(register_bytes_per_s=10e9) as fake:
        device = MHATokenToKVPool(size=DEVICE_TOKENS, page_size=PAGE, dtype=torch.bfloat16, head_num=8, head_dim=128,
                                  layer_num=LAYERS, device="cpu", enable_memory_saver=False)
        allocator = PagedTokenToKVPoolAllocator(DEVICE_TOKENS, PAGE, torch.bfloat16, "cpu", device, False)
        host = build_kv_host_pool(kv_pool=device, page_size=PAGE)
        try:
            assert type(host).__module__.startswith("hicache.pools") and host.progressive
            assert host.ready_pages() < host.page_num  # it returned while registering
            group = HostPoolGroup([PoolEntry(name=PoolName.KV, host_pool=host, device_pool=device,
                                             layer_mapper=lambda layer: layer, is_primary_index_anchor=True)])
            controller = HybridCacheController(allocator, group, PAGE, None, threading.Event(), io_backend="direct")
            generator = torch.Generator().manual_seed(7)
            # What was registered when the pool chose a write's pages: sampled as its alloc returns
            # (registration only grows while the pool lives, and the fake records a range before its
            # call returns). Sampled before controller.write instead, pages the background
            # registration finished in between looked outside it (seen under load).
            held_at_alloc = []
            choose = host.alloc

            def alloc(*args, **kwargs):
                chosen = choose(*args, **kwargs)
                held_at_alloc.append(fake.held())
                return chosen

            monkeypatch.setattr(host, "alloc", alloc)

            def write() -> bool:
                written = allocator.alloc(2 * PAGE)
                for layer in [*device.k_buffer, *device.v_buffer]:
                    layer[written] = torch.randn(layer[written].shape, generator=generator).to(layer.dtype)
                want = device.k_buffer[1][written].clone()
                held_at_alloc.clear()
                host_indices = controller.write(written)
                for ack in controller.ack_write_queue:
                    ack.finish_event.synchronize()
                controller.ack_write_queue.clear()
                allocator.free(written)
                if host_indices is None:
                    return False
                [held] = held_at_alloc  # the controller asked the pool once
                ptrs, sizes = host.get_page_buffer_meta(host_indices)
                assert all(_covered(held, p, s) for p, s in zip(ptrs, sizes)), "a page outside the registered ranges"
                rows = host.kv_buffer[0][host_indices // PAGE, 1, host_indices % PAGE]  # K of layer 1
                assert torch.equal(rows.view(torch.int16), want.view(torch.int16))
                return True

            during = [write() for _ in range(200) if host.ready_pages() < host.page_num]
            assert during and during[0]  # the first pages were ready at once
            assert host.wait_ready(timeout=60)
            recorded = {tuple(r) for r in host.kv_buffer._sglang_cuda_host_registered_ranges}
            assert recorded == fake.held()  # SGLang's record kept up as the background registered
            assert all(write() for _ in range(20))
            assert host.available_size() == host.size - PAGE * 2 * (sum(during) + 20)
        finally:
            host.destroy()
        assert fake.held() == set()
