"""What each process of the zygote's multi-process tests does (run by tests/store_child.py, one
forked process per task): the node store's, and SGLang's ranks of the plug-in's admission and
metrics tests. Each role reports events through ``say`` and returns a JSON-able
report; page contents are a function of (seed, page) so any process can check any page."""

from __future__ import annotations

import os
import time

PAGE_BYTES = 4096  # the core roles' page: 4 segments of 1 KiB
SEGMENTS = 4


def page_bytes_of(seed: int, page: int, size: int = PAGE_BYTES):
    import torch

    generator = torch.Generator().manual_seed(seed * 1_000_003 + page)
    return torch.randint(0, 256, (size,), dtype=torch.uint8, generator=generator)


def _segments(tensor) -> list:
    step = tensor.numel() // SEGMENTS
    return [(tensor.data_ptr() + i * step, step) for i in range(SEGMENTS)]


def core_namespace():
    from hicache.store import Namespace

    return Namespace(model="core", dtype="uint8", page_tokens=1, layout="flat", pool="kv", page_bytes=PAGE_BYTES)


def _wait_file(path: str) -> None:
    """Block until ``path`` exists (a barrier the test sets); a hang guard, not a timer."""
    deadline = time.monotonic() + 300
    while not os.path.exists(path):
        if time.monotonic() > deadline or not os.path.isdir(os.path.dirname(path)):
            raise TimeoutError(f"hang guard: {path} never appeared")
        time.sleep(0.002)


# -- core store ----------------------------------------------------------------------------------

def write_until(say, *, path: str, size: int, batches: int, per_batch: int, seed: int, kill_at=None,
                hooked_build=None) -> dict:
    """Write ``batches`` batches of ``per_batch`` pages; at the write step ``kill_at`` =
    [batch, page, stage] say "at" and wait to be killed. The steps are the Python write's (the
    store's fault hook) or, given ``hooked_build`` (the path of a C helper built with its step
    hook), the C write's - the one a user's build runs."""
    import sys

    from hicache.store import open_store

    position = {"batch": 0}

    def hook(stage: str, page: int) -> None:
        if kill_at is not None and [position["batch"], page, stage] == list(kill_at):
            say("at", stage, page)
            while True:
                time.sleep(3600)

    if hooked_build is None:
        store = open_store(path, size_bytes=size, slot_bytes=PAGE_BYTES, fault_hook=hook)
    else:
        from store_support import load_slotops

        hooked = load_slotops(hooked_build, "hicache_step_hook._slotops")
        sys.modules["hicache.effects._arena._slots"]._native = hooked  # this forked process's native slot ops
        hooked.set_step_hook(hook)
        from hicache.effects import arena

        store = open_store(path, size_bytes=size, slot_bytes=PAGE_BYTES, ops=arena.slot_ops("native"))
    ns = core_namespace()
    for batch in range(batches):
        position["batch"] = batch
        pages = [page_bytes_of(seed, batch * per_batch + i) for i in range(per_batch)]
        keys = [f"p{batch * per_batch + i}" for i in range(per_batch)]
        assert store.put(ns, keys, [_segments(t) for t in pages]) == [True] * per_batch
    store.close()
    return {"written": batches * per_batch}


def clear_until(say, *, path: str, hooked_build: str, kill_at: int) -> dict:
    """Clear the core namespace of the arena at ``path`` with the C helper's test build; at its
    ``kill_at``-th slot (counting from 0), between the slot's odd generation and its empty record
    (step "reclaiming"), say "at" with the slot and wait to be killed."""
    import sys

    from store_support import load_slotops

    from hicache.effects import arena
    from hicache.store import open_store

    hooked = load_slotops(hooked_build, "hicache_step_hook._slotops")
    sys.modules["hicache.effects._arena._slots"]._native = hooked  # this forked process's native slot ops
    seen = []

    def hook(stage: str, slot: int) -> None:
        if stage == "reclaiming":
            seen.append(slot)
            if len(seen) == kill_at + 1:
                say("at", slot)
                while True:
                    time.sleep(3600)

    hooked.set_step_hook(hook)
    store = open_store(path, size_bytes=None, slot_bytes=PAGE_BYTES, ops=arena.slot_ops("native"))
    cleared = store.clear([core_namespace()])
    store.close()
    return {"cleared": cleared}


def pressure_writer(say, *, path: str, chains: int, length: int, seed: int, go: str) -> dict:
    """After the ``go`` file appears, write ``chains`` chains of ``length`` pages (more than the
    arena holds: eviction all along)."""
    from hicache.store import open_store

    store = open_store(path, size_bytes=None, slot_bytes=PAGE_BYTES)
    ns = core_namespace()
    _wait_file(go)
    for chain in range(chains):
        keys = [f"c{chain}-{i}" for i in range(length)]
        pages = [page_bytes_of(seed, chain * 1000 + i) for i in range(length)]
        store.put(ns, keys, [_segments(t) for t in pages], first_depth=0)
        say("chain", chain)
    counts = store.counts
    store.close()
    return {"evictions": counts.evictions, "writes": counts.writes}


def pressure_reader(say, *, path: str, chains: int, length: int, seed: int, stop: str) -> dict:
    """Until the ``stop`` file appears - and one whole round after it did, so the last round sees
    the writer's final state - look chains up (SGLang's leading-run exists), read what is
    reported and check every page read True byte for byte."""
    import torch

    from hicache.store import open_store

    store = open_store(path, size_bytes=None, slot_bytes=PAGE_BYTES)
    ns = core_namespace()
    reads = wrong = hits = rounds = 0
    say("reading")
    deadline = time.monotonic() + 300  # a hang guard: the test stops it with the file
    stopping = False
    while not stopping:
        stopping = os.path.exists(stop)
        if time.monotonic() > deadline or not os.path.isdir(os.path.dirname(stop)):
            raise TimeoutError(f"hang guard: {stop} never appeared")
        for chain in range(chains):
            keys = [f"c{chain}-{i}" for i in range(length)]
            lead = store.exists(ns, keys)
            if not lead:
                continue
            out = [torch.zeros(PAGE_BYTES, dtype=torch.uint8) for _ in range(lead)]
            ok = store.get(ns, keys[:lead], [_segments(t) for t in out])
            reads += lead
            for i, (hit, got) in enumerate(zip(ok, out)):
                if hit:
                    hits += 1
                    wrong += not torch.equal(got, page_bytes_of(seed, chain * 1000 + i))
        rounds += 1
    counts = store.counts
    store.close()
    return {"reads": reads, "hits": hits, "wrong": wrong, "torn": counts.torn, "corrupt": counts.corrupt,
            "rounds": rounds}


ROLES = {name: globals()[name] for name in ("write_until", "clear_until", "pressure_writer", "pressure_reader")}


# -- SGLang 0.5.23's real pools, controller and factory (the zygote ran with --sglang) ------------

SG_PAGE, SG_LAYERS, SG_HEADS, SG_DIM = 16, 3, 2, 64
SG_TOKENS = 4096  # device pool rows: 128 pages of 16 tokens, plus room


def _server_args(layout: str, **extra):
    from sglang.srt.server_args import ServerArgs

    return ServerArgs(model_path="dummy", page_size=SG_PAGE, enable_hierarchical_cache=True, hicache_ratio=2.0,
                      hicache_mem_layout=layout, hicache_io_backend="direct", **extra)


def _publish(layout: str, **extra) -> None:
    from sglang.srt.runtime_context import SpawnRanks, publish, reset_context

    reset_context()
    publish(_server_args(layout, **extra), role="test", ranks=SpawnRanks(world_rank=0, dp_rank=None))


def _device(kind: str):
    import torch
    from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool, MLATokenToKVPool

    common = dict(size=SG_TOKENS, page_size=SG_PAGE, dtype=torch.bfloat16, layer_num=SG_LAYERS, device="cpu",
                  enable_memory_saver=False)
    if kind == "mha":
        return MHATokenToKVPool(head_num=SG_HEADS, head_dim=SG_DIM, **common)
    return MLATokenToKVPool(kv_lora_rank=64, qk_rope_head_dim=16, **common)


def _device_layers(device, kind: str) -> list:
    return [*device.k_buffer, *device.v_buffer] if kind == "mha" else list(device.kv_buffer)


def _expected(seed: int, kind: str, rows: int) -> list:
    """What the device pool holds for ``seed``: one tensor per layer buffer."""
    import torch

    generator = torch.Generator().manual_seed(seed)
    width = (SG_HEADS, SG_DIM) if kind == "mha" else (1, 80)
    count = 2 * SG_LAYERS if kind == "mha" else SG_LAYERS
    return [torch.randn((rows, *width), generator=generator).to(torch.bfloat16) for _ in range(count)]


def _plug(pools: str) -> None:
    """``pools``: "sglang" (SGLang's own pools, no plug-in), "plugged" (SGLang's pools, the
    hicache plug-in registering them), "hicache" (the plug-in's pools, HICACHE_SGLANG_POOLS=1)."""
    import sglang.srt.mem_cache.pool_host.base as base
    import sglang.srt.plugins as plugins

    if pools == "hicache":
        os.environ["HICACHE_SGLANG_POOLS"] = "1"
    if pools != "sglang":
        plugins.load_plugins()
    base._is_cuda = True  # SGLang's destroy() unregisters only where it thinks CUDA is


def _flat_page(host, seed: int, page: int):
    """Page ``page`` of ``seed`` as one of SGLang's flat data pages of ``host``."""
    import torch

    like = host.get_data_page(0, flat=True)
    generator = torch.Generator().manual_seed(seed * 7919 + page)
    return torch.randint(-30000, 30000, like.shape, generator=generator, dtype=torch.int16).view(like.dtype) \
        if like.element_size() == 2 else torch.randint(0, 255, like.shape, generator=generator).to(like.dtype)


def store_extra(path: str, size_gb: float | None, **more) -> dict:
    extra = {"backend_name": "hicache_node", "module_path": "hicache.compat.sglang_store",
             "class_name": "HiCacheNodeStore", "interface_v1": 1, "arena": path}
    if size_gb is not None:
        extra["size_gb"] = size_gb
    return {**extra, **more}


def _config(kind: str, extra: dict, *, tp_rank: int = 0, tp_size: int = 1, model: str = "hicache/store-test"):
    from sglang.srt.mem_cache.hicache_storage import HiCacheStorageConfig

    return HiCacheStorageConfig(tp_rank=tp_rank, tp_size=tp_size, pp_rank=0, pp_size=1, attn_cp_rank=0,
                                attn_cp_size=1, is_mla_model=kind == "mla", enable_storage_metrics=False,
                                is_page_first_layout=False, model_name=model, extra_config=dict(extra))


def sglang_pool(say, *, path: str, size_gb, kind: str, layout: str, pools: str, seed: int, pages: int,
                write: bool, read_seed=None, tp_rank: int = 0, tp_size: int = 1, model: str = "hicache/store-test",
                wait: str | None = None) -> dict:
    """One engine: SGLang's assembler builds its host pool (``pools`` as `_plug` says) under
    the fake driver, SGLang's factory makes the store (`dynamic`). With ``write`` (and when
    SGLang's backup rule lets this rank write) it fills its device pool from ``seed``, backs the
    pages up to its host pool and stores them zero-copy; says "stored". Then (after the file
    ``wait`` exists, when given) with ``read_seed`` it looks those pages up, fetches them into
    other host slots and loads them into a cleared device pool: byte-exact against ``read_seed``."""
    import torch
    from sglang.srt.mem_cache.hybrid_cache.hybrid_pool_assembler import build_kv_host_pool
    from sglang.srt.mem_cache.pool_host.base import host_memory_budget_scope
    from sglang.srt.mem_cache.storage.backend_factory import StorageBackendFactory

    from hicache.testing import fake_cuda

    _plug(pools)
    _publish(layout)
    device = _device(kind)
    report: dict = {}
    tokens = pages * SG_PAGE
    keys = [f"page-{i}" for i in range(pages)]
    with fake_cuda() as fake:
        if pools == "sglang":  # SGLang's own registration calls torch.cuda.cudart(): the fake driver
            torch.cuda.cudart = lambda: fake.cudart
        with host_memory_budget_scope(10**12):
            host = build_kv_host_pool(kv_pool=device, page_size=SG_PAGE)
        report["pool"] = [type(host).__module__.split(".")[0], host.layout]
        config = _config(kind, store_extra(path, size_gb), tp_rank=tp_rank, tp_size=tp_size, model=model)
        store = StorageBackendFactory.create_backend("dynamic", config, host)
        store.register_mem_pool_host(host)
        store.on_host_pools_registered()
        report["created"] = store.store.arena.created
        report["attach_resident"] = store.attach_resident
        report["writer"] = config.is_storage_writer
        direct = layout in ("layer_first", "page_first_direct")  # SGLang's CPU "direct" copies serve these
        if write:
            host_indices = host.alloc(tokens)
            if direct:
                rows = torch.arange(SG_PAGE, SG_PAGE + tokens)  # row 0 is the device pool's padding
                for layer, data in zip(_device_layers(device, kind), _expected(seed, kind, tokens)):
                    layer[rows] = data.reshape(layer[rows].shape)
                host.backup_from_device_all_layer(device, host_indices, rows, "direct")
            else:  # SGLang's own flat-page setter (what its L3 back ends use)
                for i in range(pages):
                    host.set_from_flat_data_page(int(host_indices[i * SG_PAGE]), _flat_page(host, seed, i))
            if config.is_storage_writer:  # SGLang's backup rule (cache_controller.backup_skip)
                report["stored"] = all(store.batch_set_v1(keys, host_indices))
            say("stored")
        if wait is not None:
            _wait_file(wait)
        if read_seed is not None:
            host.alloc(3 * SG_PAGE)  # other requests' pages: this engine's slots differ from the writer's
            host_indices = host.alloc(tokens)
            report["exists"] = store.batch_exists(keys)
            report["fetched"] = sum(store.batch_get_v1(keys, host_indices))
            if direct:  # loaded into a cleared device pool by SGLang's own copy
                rows = torch.arange(9 * SG_PAGE, 9 * SG_PAGE + tokens)
                for layer in _device_layers(device, kind):
                    layer.zero_()
                for layer_id in range(SG_LAYERS):
                    host.load_to_device_per_layer(device, host_indices, rows, layer_id, "direct")
                got = [layer[rows] for layer in _device_layers(device, kind)]
                want = _expected(read_seed, kind, tokens)
                same = [torch.equal(g.reshape(w.shape).view(torch.int16), w.view(torch.int16))
                        for g, w in zip(got, want)]
                report["loaded_to_device"] = True
            else:  # read back by SGLang's own flat-page getter
                same = [torch.equal(host.get_data_page(int(host_indices[i * SG_PAGE]), flat=True).view(torch.uint8),
                                    _flat_page(host, read_seed, i).view(torch.uint8)) for i in range(pages)]
            report["byte_exact"] = all(same)
        stats = store.get_stats()
        report["stats"] = {k: stats[k] for k in ("pages", "bytes", "hits", "misses", "torn")}
        store.close()
        host.destroy()
        report["held_after_destroy"] = sorted(fake.held())
    return report


ROLES["sglang_pool"] = sglang_pool


def controller(say, *, path: str, size_gb, kind: str, layout: str, pools: str, seed: int, pages: int, mode: str,
               host_memory_mode: str = "cache", backend: str = "dynamic") -> dict:
    """SGLang's real `HybridCacheController` with the dynamic back end (`--hicache-storage-backend
    dynamic`). ``mode="write"``: fill the device pool from ``seed``, write the pages to host and
    back them up to L3 through SGLang's backup thread, say "stored" and wait to be killed.
    ``mode="prefetch"``: a fresh controller prefetches the same tokens through SGLang's prefetch
    threads (hit query, then `batch_get_v1`) and loads them into its device pool: byte-exact.
    ``backend="file"``: SGLang's own HiCacheFile in the directory ``path`` instead (a baseline)."""
    import threading

    import torch
    from sglang.srt.mem_cache.allocator.paged import PagedTokenToKVPoolAllocator
    from sglang.srt.mem_cache.base_prefix_cache import CacheRequestHandle
    from sglang.srt.mem_cache.hicache_storage import PoolName
    from sglang.srt.mem_cache.hybrid_cache.hybrid_cache_controller import HybridCacheController
    from sglang.srt.mem_cache.hybrid_cache.hybrid_pool_assembler import build_kv_host_pool
    from sglang.srt.mem_cache.pool_host import HostPoolGroup, PoolEntry
    from sglang.srt.mem_cache.pool_host.base import host_memory_budget_scope
    from sglang.srt.mem_cache.utils import get_storage_hash_str

    from hicache.testing import fake_cuda

    began = time.perf_counter()
    _plug(pools)
    _publish(layout, hicache_host_memory_mode=host_memory_mode) if host_memory_mode != "cache" else _publish(layout)
    report: dict = {}
    tokens = list(range(seed * 100_000, seed * 100_000 + pages * SG_PAGE))
    with fake_cuda() as fake:
        if pools == "sglang":
            torch.cuda.cudart = lambda: fake.cudart
        device = _device(kind)
        allocator = PagedTokenToKVPoolAllocator(SG_TOKENS, SG_PAGE, torch.bfloat16, "cpu", device, False)
        with host_memory_budget_scope(10**12):
            host = build_kv_host_pool(kv_pool=device, page_size=SG_PAGE)
        group = HostPoolGroup([PoolEntry(name=PoolName.KV, host_pool=host, device_pool=device,
                                         layer_mapper=lambda layer: layer, is_primary_index_anchor=True)])
        started = time.perf_counter()
        extra = store_extra(path, size_gb) if backend == "dynamic" else {"file_storage_path": path}
        cc = HybridCacheController(allocator, group, SG_PAGE, None, threading.Event(), io_backend="direct",
                                   storage_backend=backend, prefetch_threshold=SG_PAGE, model_name="hicache/restart",
                                   storage_backend_extra_config=extra, host_memory_mode=host_memory_mode)
        store = cc.storage_backend
        report["backend"] = type(store).__name__
        report["zero_copy"] = cc.page_get_func.__name__
        aside = time.perf_counter()  # the checks' own reads (mincore of the arena) are no part of the restart
        if backend == "dynamic":
            report["attach_resident"] = store.attach_resident
            report["data_offset"] = store.store.arena.plan.data_offset  # where the first slot's page starts
        started += time.perf_counter() - aside
        want = _expected(seed, kind, len(tokens))
        if mode == "write":
            written = allocator.alloc(len(tokens))
            for layer, data in zip(_device_layers(device, kind), want):
                layer[written] = data.reshape(layer[written].shape)
            host_indices = cc.write(written)
            for ack in cc.ack_write_queue:
                ack.finish_event.synchronize()
            hashes = get_storage_hash_str(tokens, None, page_size=SG_PAGE)
            cc.write_storage(host_indices, tokens, hash_value=hashes)
            done = cc.ack_backup_queue.get(timeout=120)  # SGLang's backup thread finished the operation
            report["backed_up_tokens"] = done.completed_tokens
            say("stored", done.completed_tokens)
            while True:  # until kill -9: nothing is closed or flushed
                time.sleep(3600)
        operation = cc.prefetch(CacheRequestHandle(rid="restart", attempt_id=0), tokens, None, prefix_keys=[])
        hit = cc.prefetch_hit_queue.get(timeout=120)  # SGLang's prefetch thread ran the hit query
        report["first_hit_s"] = time.perf_counter() - started
        report["start_to_hit_s"] = time.perf_counter() - began
        report["hit_tokens"] = hit.storage_hit_count
        host_indices = cc.alloc_prefetch_host_buffers(hit, hit.storage_hit_count)
        hit.host_indices = host_indices
        cc.prefetch_buffer.put(hit)  # as UnifiedRadixCache does once it allocated the host bounce
        ack = cc.ack_prefetch_queue.get(timeout=120)
        report["fetched_tokens"] = ack.completed_tokens if ack.completed_tokens is not None else hit.completed_tokens
        report["same_operation"] = ack.operation is operation
        loaded = cc.load(host_indices)
        cc.start_loading()
        for done in cc.ack_load_queue:
            done.finish_event.synchronize()
        got = [layer[loaded] for layer in _device_layers(device, kind)]
        report["byte_exact"] = all(torch.equal(g.reshape(w.shape).view(torch.int16), w.view(torch.int16))
                                   for g, w in zip(got, want))
        if backend == "dynamic":
            stats = store.get_stats()
            report["stats"] = {k: stats[k] for k in ("pages", "hits", "misses", "torn", "reclaimed")}
        cc.detach_storage_backend()
        report["closed"] = getattr(store, "_closed", True)
        host.destroy()
        report["held_after_destroy"] = sorted(fake.held())
    return report


ROLES["controller"] = controller


def admission_rank(say, *, shared: str, room: int, ranks: int, tokens: int) -> dict:
    """One rank of the plug-in's admission test (tests/test_sglang_plugin.py): SGLang's own
    sample of the machine (`available_host_memory_bytes`, replaced where it lives and where
    pool_host.base imported it, before the plug-in loads, so hicache's hooks wrap it as they wrap
    the real one) reads a host with ``room`` bytes beyond SGLang's reserve, less what every rank
    has mapped (files under ``shared``); an admitted rank maps only once all ``ranks`` sampled.
    Then SGLang's real MHA pool of ``tokens`` tokens is built under the fake driver: "admitted"
    with the number of registrations held, or "refused" with SGLang's error."""
    from pathlib import Path

    import torch
    import sglang.srt.mem_cache.host_memory as host_memory
    import sglang.srt.mem_cache.pool_host.base as base
    import sglang.srt.plugins as plugins
    from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool
    from sglang.srt.mem_cache.pool_host.mha import MHATokenToKVPoolHost

    from hicache.effects import HostTensorAllocator
    from hicache.testing import fake_cuda

    shared_dir = Path(shared)
    mine = shared_dir / f"mapped-{os.getpid()}"
    mine.write_text("0")
    real = HostTensorAllocator.allocate_unfaulted

    def allocate_unfaulted(self, dims, dtype):  # the machine's memory is used from the mapping on
        _wait_count(shared_dir, "sampled-*", ranks)  # an admitted rank maps only once every rank has sampled
        tensor, buffer = real(self, dims, dtype)
        mine.write_text(str(int(mine.read_text()) + buffer.mapped_bytes))
        return tensor, buffer

    def available(allow_cgroup_fallback=True):  # a host with room for the pools beyond SGLang's reserve
        used = sum(int(p.read_text() or 0) for p in shared_dir.glob("mapped-*"))
        time.sleep(0.3)  # sampling takes a while: ranks starting together all sample before any maps
        (shared_dir / f"sampled-{os.getpid()}").touch()
        return base.HICACHE_HOST_MEMORY_RESERVE_BYTES + room - used

    HostTensorAllocator.allocate_unfaulted = allocate_unfaulted
    host_memory.available_host_memory_bytes = base.available_host_memory_bytes = available
    plugins.load_plugins()
    device = MHATokenToKVPool(size=256, page_size=16, dtype=torch.bfloat16, head_num=2, head_dim=64, layer_num=4,
                              device="cpu", enable_memory_saver=False)
    info = device.get_device_pool_infos()[0].buffer_info
    (shared_dir / f"ready-{os.getpid()}").touch()
    _wait_count(shared_dir, "ready-*", ranks)  # start together
    with fake_cuda() as fake:
        try:
            MHATokenToKVPoolHost(info, 2.0, 0, 16, "page_first_direct", True, "cpu", device_capacity_tokens=256,
                                 start_layer=0, end_layer=4, host_token_capacity=tokens)
            return {"admitted": len(fake.held())}
        except ValueError as error:
            return {"refused": str(error)}


def _wait_count(directory, pattern: str, count: int) -> None:
    """Block until ``count`` files match ``pattern`` (a barrier the ranks set); a hang guard."""
    deadline = time.monotonic() + 240
    while len(list(directory.glob(pattern))) < count and time.monotonic() < deadline:
        time.sleep(0.01)


ROLES["admission_rank"] = admission_rank


def metrics_rank(say, *, tokens: int, hicache_pools: bool) -> dict:
    """One scheduler-like process of the metrics test (tests/metrics_child.py's `main`: SGLang's
    assembler builds a host pool of ``tokens`` tokens under the plug-in - hicache's own pools with
    ``hicache_pools``); the zygote ran with PROMETHEUS_MULTIPROC_DIR set, as SGLang's launcher
    sets it. The pool stays up: the zygote's task ends with os._exit, no release writes 0s."""
    import metrics_child

    os.environ.pop("HICACHE_SGLANG_POOLS", None)
    if hicache_pools:
        os.environ["HICACHE_SGLANG_POOLS"] = "1"
    return metrics_child.main(tokens)


ROLES["metrics_rank"] = metrics_rank
