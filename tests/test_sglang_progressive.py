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
from sglang_support import hold_background_registration, plug, published, sglang  # noqa: F401 - sglang: a fixture

from hicache.testing import fake_cuda

pytestmark = pytest.mark.concurrency  # processes, threads, signals or waits: `make test-loaded`

torch = pytest.importorskip("torch")

PAGE, LAYERS, DEVICE_TOKENS = 16, 3, 512
SETTINGS = dict(page_size=PAGE, enable_hierarchical_cache=True, hicache_size=0.4,
                hicache_mem_layout="page_first_direct", hicache_io_backend="direct")


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
    from sglang.srt.mem_cache.allocator.paged import PagedTokenToKVPoolAllocator
    from sglang.srt.mem_cache.hicache_storage import PoolName
    from sglang.srt.mem_cache.hybrid_cache.hybrid_cache_controller import HybridCacheController
    from sglang.srt.mem_cache.hybrid_cache.hybrid_pool_assembler import build_kv_host_pool
    from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool
    from sglang.srt.mem_cache.pool_host import HostPoolGroup, PoolEntry

    plug(monkeypatch, pools=True, progressive=True)  # SGLang builds hicache's pools; they serve while registering
    with published(**SETTINGS), fake_cuda(register_bytes_per_s=10e9) as fake:
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


def test_sglangs_controller_writes_an_anchor_and_its_index_pool_while_the_anchor_registers(sglang, monkeypatch,
                                                                                            roomy_psutil):
    """MiniMax's sparse layout as SGLang's assembler builds it (the KV pool, and beside it the
    K-only index pool on the KV pool's slots, `MHATokenToKOnlyPoolHost(index_k_pool, kv_host,
    layout)`), both hicache's under HICACHE_PROGRESSIVE=1: SGLang's controller writes both while
    the KV pool registers, each write skipped or landing byte-exact in both, never an error (the
    index pool, itself progressive, lagged the slots its anchor handed out: TransferError)."""
    from sglang.srt.mem_cache.allocator.paged import PagedTokenToKVPoolAllocator
    from sglang.srt.mem_cache.hicache_storage import PoolName
    from sglang.srt.mem_cache.hybrid_cache.hybrid_cache_controller import HybridCacheController, PoolTransfer
    from sglang.srt.mem_cache.hybrid_cache import hybrid_pool_assembler as assembler
    from sglang.srt.mem_cache.memory_pool import MHATokenToKOnlyPool, MHATokenToKVPool
    from sglang.srt.mem_cache.pool_host import HostPoolGroup, PoolEntry

    plug(monkeypatch, pools=True, progressive=True)  # SGLang builds hicache's pools; they serve while registering
    with published(**SETTINGS), fake_cuda(register_bytes_per_s=10e9) as fake:
        # the KV pool's background registration waits for `go`: "while it registers" is the
        # test's order, not a race with the clock (the index pool, not progressive, is not held)
        go = threading.Event()
        hold_background_registration(monkeypatch, fake, go)
        common = dict(size=DEVICE_TOKENS, page_size=PAGE, dtype=torch.bfloat16, layer_num=LAYERS, device="cpu",
                      enable_memory_saver=False)
        device = MHATokenToKVPool(head_num=8, head_dim=128, **common)
        index_device = MHATokenToKOnlyPool(head_num=1, head_dim=128, **common)
        allocator = PagedTokenToKVPoolAllocator(DEVICE_TOKENS, PAGE, torch.bfloat16, "cpu", device, False)
        host = assembler.build_kv_host_pool(kv_pool=device, page_size=PAGE)
        # the assembler's own call for MiniMax's index pool (through the plug-in's class REPLACE)
        index = assembler.MHATokenToKOnlyPoolHost(index_device, host, "page_first_direct")
        try:
            assert type(index).__module__.startswith("hicache.pools") and host.progressive
            assert host.ready_pages() < host.page_num  # the anchor returned while registering
            assert index.ready_pages() == index.page_num  # its side pool, whole before it serves
            group = HostPoolGroup([
                PoolEntry(name=PoolName.KV, host_pool=host, device_pool=device, layer_mapper=lambda layer: layer,
                          is_primary_index_anchor=True),
                PoolEntry(name=PoolName.INDEXER, host_pool=index, device_pool=index_device,
                          layer_mapper=lambda layer: layer)])
            controller = HybridCacheController(allocator, group, PAGE, None, threading.Event(), io_backend="direct")
            generator = torch.Generator().manual_seed(11)

            def write() -> bool:
                written = allocator.alloc(2 * PAGE)
                for layer in [*device.k_buffer, *device.v_buffer, *index_device.k_buffer]:
                    layer[written] = torch.randn(layer[written].shape, generator=generator).to(layer.dtype)
                want = index_device.k_buffer[1][written].clone()
                sidecar = PoolTransfer(name=PoolName.INDEXER, indices_from_pool=PoolName.KV)  # as the tree passes it
                host_indices = controller.write(written, extra_pools=[sidecar])
                for ack in controller.ack_write_queue:
                    ack.finish_event.synchronize()
                controller.ack_write_queue.clear()
                if host_indices is None:
                    allocator.free(written)
                    return False
                index_device.k_buffer[1][written] = 0
                index.load_to_device_per_layer(index_device, host_indices, written, 1, "direct")
                assert torch.equal(index_device.k_buffer[1][written].view(torch.int16), want.view(torch.int16))
                allocator.free(written)
                return True

            during = [write()]
            while during[-1] and len(during) < host.page_num:  # its ready pages written, then "host pool full"
                during.append(write())
            assert host.ready_pages() < host.page_num  # all of them while the KV pool was registering
            assert during[0] and not during[-1], during
            go.set()
            assert host.wait_ready(timeout=60)
            assert all(write() for _ in range(20))
        finally:
            go.set()
            index.destroy()
            host.destroy()
        assert fake.held() == set()
