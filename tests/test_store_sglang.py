"""HiCacheNodeStore inside one SGLang 0.5.23 process (its real pools, factory, HiCacheFile and
controller, on CPU under the fake driver): SGLang's factory builds it as ``cls(storage_config,
{})``; bad extra_config is one error naming every bad key, before anything exists; a geometry
that does not fit fails SGLang's attach cleanly; `batch_exists_v2` answers as SGLang's own
HiCacheFile for random patterns; sidecar (v2) and legacy flat pages round-trip; bad host indices
are an error before any copy; `get_stats` is a dict that is also SGLang's StorageMetrics; `clear`
empties this engine's pages only; `close` is idempotent. Needs `make sglang`."""

from __future__ import annotations

import os
import random

import pytest
from sglang_support import published, sglang  # noqa: F401 - sglang: a fixture
from store_support import shm_dir  # noqa: F401 - a fixture
from test_sglang_conformance import PAGE, _build, _classes, _device

from hicache.errors import ArenaError, ArenaGeometryError, TransferError
from hicache.store import shard_of
from hicache.testing import fake_cuda

torch = pytest.importorskip("torch")

GB = 0.02


def _extra(path, **more):
    extra = {"backend_name": "hicache_node", "module_path": "hicache.compat.sglang_store",
             "class_name": "HiCacheNodeStore", "interface_v1": 1, "arena": str(path), "size_gb": GB}
    extra.update(more)
    return {k: v for k, v in extra.items() if v is not None}


def _config(extra, *, model="m", mla=False, tp_rank=0, tp_size=1, metrics=False):
    from sglang.srt.mem_cache.hicache_storage import HiCacheStorageConfig

    return HiCacheStorageConfig(tp_rank=tp_rank, tp_size=tp_size, pp_rank=0, pp_size=1, attn_cp_rank=0,
                                attn_cp_size=1, is_mla_model=mla, enable_storage_metrics=metrics,
                                is_page_first_layout=False, model_name=model, extra_config=extra)


@pytest.fixture
def pools(sglang):
    """Three SGLang MHA host pools (page_first_direct) with random bytes, under the fake driver."""
    with fake_cuda():
        device = _device("mha")
        info = device.get_device_pool_infos()[0].buffer_info
        made = [_build(_classes("mha")[0], "mha", info, "page_first_direct", hicache=False) for _ in range(3)]
        generator = torch.Generator().manual_seed(1)
        for pool in made:
            pool.kv_buffer.view(torch.int16).copy_(torch.randint(-30000, 30000, pool.kv_buffer.shape,
                                                                 generator=generator, dtype=torch.int16))
        yield made


def _store(path, pool, *, sidecars=(), **kwargs):
    from sglang.srt.mem_cache.storage.backend_factory import StorageBackendFactory

    store = StorageBackendFactory.create_backend("dynamic", _config(_extra(path, **kwargs.pop("extra", {})), **kwargs),
                                                 pool)
    store.register_mem_pool_host(pool)
    for name, side in sidecars:
        store.register_mem_host_pool_v2(side, name)
    store.on_host_pools_registered()
    return store


def _page(pool, page: int):
    return pool.get_data_page(page * PAGE, flat=True).contiguous().view(torch.uint8)


def test_sglangs_factory_builds_it_with_an_empty_kwargs_dict(sglang, shm_dir, pools):
    """`StorageBackendFactory.create_backend("dynamic", ...)` imports the class from
    extra_config and calls ``cls(storage_config, {})``: a HiCacheStorage that stores and finds."""
    from sglang.srt.mem_cache.hicache_storage import HiCacheStorage

    from hicache.compat.sglang_store import HiCacheNodeStore

    store = _store(shm_dir / "arena", pools[0])
    try:
        assert type(store) is HiCacheNodeStore and isinstance(store, HiCacheStorage)
        assert store.batch_set_v1(["a", "b"], torch.arange(0, 2 * PAGE)) == [True, True]
        assert store.batch_exists(["a", "b", "c"]) == 2 and store.exists("a") and not store.exists("c")
    finally:
        store.close()


@pytest.mark.parametrize("extra, match", [
    (dict(arena=None), r"'arena' must be an absolute path"),
    (dict(arena="relative/arena"), r"'arena' must be an absolute path"),
    (dict(size_gb="big"), r"'size_gb' must be a positive number of GB, got 'big'"),
    (dict(size_gb=-1), r"'size_gb' must be a positive number"),
    (dict(slot_bytes=1.5), r"'slot_bytes' must be a positive integer, got 1.5"),
    (dict(colour="blue"), r"unknown key\(s\) \['colour'\]"),
    (dict(size_gb=float("inf")), r"'size_gb' must be a positive number of GB, got inf"),
    (dict(prefault_threads=5000), r"'prefault_threads' must be at most 1024, got 5000"),
    (dict(label="x" * 65), r"'label' must be at most 64 bytes of UTF-8, got 65"),
    (dict(label="a\nb"), r"'label' must be printable text, got 'a\\nb'"),
    (dict(label="\ud800"), r"'label' must be printable text"),
])
def test_bad_extra_config_is_one_error_naming_the_key_before_anything_exists(sglang, shm_dir, extra, match):
    """Each bad value (a missing or relative arena path, a size that is no positive finite number
    - JSON's ``Infinity`` reaches here -, a fractional slot size, more pre-fault threads than
    `open_store` takes, a label the arena's header cannot hold, an unknown key) is an ArenaError
    from SGLang's factory naming its key, and no arena file is made. The last three failed only
    when this engine came to create the arena, named as `open_store`'s or the header's fields -
    and an attaching engine's bad label passed unseen."""
    from sglang.srt.mem_cache.storage.backend_factory import StorageBackendFactory

    config = _config(_extra(shm_dir / "arena", **extra))  # a None value drops the key
    with pytest.raises(ArenaError, match=match):
        StorageBackendFactory.create_backend("dynamic", config, None)
    assert os.listdir(shm_dir) == []


def test_a_geometry_that_does_not_fit_fails_sglangs_attach_cleanly(sglang, shm_dir, pools):
    """An arena made with slots smaller than this engine's pages: SGLang's controller attach
    raises the geometry error, keeps no back end and no storage thread; the arena is untouched."""
    import threading

    from sglang.srt.managers.cache_controller import HiCacheController
    from sglang.srt.mem_cache.allocator.paged import PagedTokenToKVPoolAllocator

    from hicache.store import open_store

    path = shm_dir / "arena"
    open_store(str(path), size_bytes=int(GB * 1e9), slot_bytes=1024).close()
    before = path.read_bytes()[:4096]
    device = _device("mha")
    allocator = PagedTokenToKVPoolAllocator(256, PAGE, torch.bfloat16, "cpu", device, False)
    with published(page_size=PAGE, enable_hierarchical_cache=True, hicache_ratio=2.0,
                   hicache_mem_layout="page_first_direct", hicache_io_backend="direct"):
        controller = HiCacheController(allocator, pools[0], PAGE, None, threading.Event(), io_backend="direct")
        with pytest.raises(ArenaGeometryError, match="slots hold 1024 bytes, a page of this engine is"):
            controller.attach_storage_backend("dynamic", storage_backend_extra_config=_extra(path, size_gb=None))
    assert controller.storage_backend is None and not controller.enable_storage
    assert not any(t.name.startswith("Thread") and t.is_alive() and "storage" in t.name for t in threading.enumerate())
    assert path.read_bytes()[:4096] == before


def _file_backend(path, kv=None, sidecars=()):
    """SGLang's own HiCacheFile at ``path`` (the oracle), with ``kv`` and the ``(name, pool)``
    sidecars registered as `_store` registers them."""
    from sglang.srt.mem_cache.hicache_storage import HiCacheFile

    backend = HiCacheFile(_config({}), file_path=str(path))
    if kv is not None:
        backend.register_mem_pool_host(kv)
    for name, side in sidecars:
        backend.register_mem_host_pool_v2(side, name)
    return backend


@pytest.mark.parametrize("seed", range(12))
def test_batch_exists_v2_answers_as_sglangs_hicache_file(sglang, shm_dir, pools, seed):
    """Random pages present per pool (KV, a trailing-pages pool, an all-pages pool) stored in
    both back ends; random queries: the same kv hit, per-pool hits and restorable prefixes."""
    from sglang.srt.mem_cache.hicache_storage import PoolHitPolicy, PoolName, PoolTransfer

    rng = random.Random(seed)
    kv, swa, mamba = pools
    sidecars = [(PoolName.SWA, swa), (PoolName.MAMBA, mamba)]
    ours, theirs = _store(shm_dir / "arena", kv, sidecars=sidecars), _file_backend(shm_dir / "file", kv, sidecars)
    keys = [f"s{seed}-{i}" for i in range(8)]
    try:
        for name in (PoolName.KV, PoolName.SWA, PoolName.MAMBA):
            held = [i for i in range(8) if rng.random() < 0.75]
            if not held:
                continue
            indices = torch.cat([torch.arange(i * PAGE, (i + 1) * PAGE) for i in held])
            chosen = [keys[i] for i in held]
            if name == PoolName.KV:
                assert all(ours.batch_set_v1(chosen, indices))
                for i, key in zip(held, chosen):
                    assert theirs.set(key, kv.get_data_page(i * PAGE, flat=True))
            else:
                transfer = [PoolTransfer(name=name, host_indices=indices, keys=chosen)]
                assert ours.batch_set_v2(transfer) == theirs.batch_set_v2(transfer)
        for _ in range(6):
            transfers = [PoolTransfer(name=name, keys=keys[-rng.randint(1, 4):], hit_policy=policy)
                         for name, policy in ((PoolName.SWA, PoolHitPolicy.TRAILING_PAGES),
                                              (PoolName.MAMBA, rng.choice(list(PoolHitPolicy)[:2])))
                         if rng.random() < 0.8]
            rng.shuffle(transfers)
            a, b = ours.batch_exists_v2(keys, transfers), theirs.batch_exists_v2(keys, transfers)
            assert (a.kv_hit_pages, a.extra_pool_hit_pages, a.restorable_prefix_pages) == \
                   (b.kv_hit_pages, b.extra_pool_hit_pages, b.restorable_prefix_pages)
    finally:
        ours.close()


def test_block_groups_is_refused_as_hicache_file_refuses_it(sglang, shm_dir, pools):
    """SGLang 0.5.23's HiCacheFile raises ValueError for BLOCK_GROUPS (no 0.5.23 caller sends it):
    so do we, with the same words."""
    from sglang.srt.mem_cache.hicache_storage import PoolHitPolicy, PoolName, PoolTransfer

    ours = _store(shm_dir / "arena", pools[0], sidecars=[(PoolName.SWA, pools[1])])
    theirs = _file_backend(shm_dir / "file")
    transfer = [PoolTransfer(name=PoolName.SWA, keys=["k"], hit_policy=PoolHitPolicy.BLOCK_GROUPS)]
    try:
        assert ours.batch_set_v1(["k"], torch.arange(PAGE)) == [True]
        theirs.set("k", pools[0].get_data_page(0, flat=True))
        with pytest.raises(ValueError, match="Unsupported pool hit policy") as mine:
            ours.batch_exists_v2(["k"], transfer)
        with pytest.raises(ValueError, match="Unsupported pool hit policy") as file:
            theirs.batch_exists_v2(["k"], transfer)
        assert str(mine.value) == str(file.value)
    finally:
        ours.close()


def test_sidecar_pages_round_trip_and_a_bad_transfer_fails_its_pages(sglang, shm_dir, pools):
    """batch_set_v2/batch_get_v2 move a sidecar pool's pages byte-exact into other slots; a
    transfer whose host indices do not cover its keys is all False (as HiCacheFile)."""
    from sglang.srt.mem_cache.hicache_storage import PoolName, PoolTransfer

    kv, swa, _ = pools
    store = _store(shm_dir / "arena", kv, sidecars=[(PoolName.SWA, swa)])
    try:
        put = [PoolTransfer(name=PoolName.SWA, host_indices=torch.arange(0, 3 * PAGE), keys=["a", "b", "c"])]
        assert store.batch_set_v2(put) == {PoolName.SWA: [True, True, True]}
        want = [_page(swa, i).clone() for i in range(3)]
        get = [PoolTransfer(name=PoolName.SWA, host_indices=torch.arange(5 * PAGE, 8 * PAGE), keys=["a", "b", "c"])]
        assert store.batch_get_v2(get) == {PoolName.SWA: [True, True, True]}
        assert all(torch.equal(_page(swa, 5 + i), want[i]) for i in range(3))
        short = [PoolTransfer(name=PoolName.SWA, host_indices=torch.arange(0, PAGE), keys=["a", "b"])]
        assert store.batch_get_v2(short) == {PoolName.SWA: [False, False]}
        assert store.batch_exists(["a"]) == 0  # the KV namespace is another one
    finally:
        store.close()


@pytest.mark.parametrize("side", ["sglang", "hicache"])
def test_a_memoryless_anchor_keeps_a_marker_per_page_and_answers_as_hicache_file(sglang, shm_dir, pools, side):
    """DeepSeek-V4's KV anchor (`LogicalHostPool`, SGLang's or hicache's) holds no bytes: the store
    keeps a marker page for each of its pages (before, SGLang's attach failed on it), so it answers
    presence as HiCacheFile (an empty file a page) beside a sidecar's real pages, and a KV page
    whose bytes are not the marker reads as a miss."""
    from sglang.srt.mem_cache.hicache_storage import PoolHitPolicy, PoolName, PoolTransfer
    from sglang.srt.mem_cache.memory_pool_host import LogicalHostPool as Theirs

    from hicache.compat._store_views import MARKER
    from hicache.pools import LogicalHostPool as Ours

    anchor, swa = (Theirs if side == "sglang" else Ours)(8 * PAGE, PAGE), pools[1]
    ours = _store(shm_dir / "arena", anchor, sidecars=[(PoolName.SWA, swa)])
    theirs = _file_backend(shm_dir / "file")
    theirs.register_mem_pool_host(anchor)
    for name, pool in ((PoolName.KV, anchor), (PoolName.SWA, swa)):  # as SGLang's controller registers a group
        theirs.register_mem_host_pool_v2(pool, name)
    keys = ["a", "b", "c", "d"]
    try:
        for backend in (ours, theirs):
            put = [PoolTransfer(name=PoolName.KV, host_indices=torch.arange(0, 3 * PAGE), keys=keys[:3]),
                   PoolTransfer(name=PoolName.SWA, host_indices=torch.arange(0, 2 * PAGE), keys=keys[:2])]
            assert backend.batch_set_v2(put) == {PoolName.KV: [True] * 3, PoolName.SWA: [True] * 2}
        for policy in (PoolHitPolicy.ALL_PAGES, PoolHitPolicy.TRAILING_PAGES, None):
            transfers = [] if policy is None else [PoolTransfer(name=PoolName.SWA, keys=keys[:1], hit_policy=policy)]
            a, b = ours.batch_exists_v2(keys, transfers), theirs.batch_exists_v2(keys, transfers)
            assert (a.kv_hit_pages, a.extra_pool_hit_pages, a.restorable_prefix_pages) == \
                   (b.kv_hit_pages, b.extra_pool_hit_pages, b.restorable_prefix_pages)
        want = [_page(swa, i).clone() for i in range(2)]
        get = [PoolTransfer(name=PoolName.KV, host_indices=torch.arange(4 * PAGE, 8 * PAGE), keys=keys),
               PoolTransfer(name=PoolName.SWA, host_indices=torch.arange(5 * PAGE, 7 * PAGE), keys=keys[:2])]
        assert ours.batch_get_v2(get) == {PoolName.KV: [True, True, True, False], PoolName.SWA: [True, True]}
        assert all(torch.equal(_page(swa, 5 + i), want[i]) for i in range(2))
        view = ours.pools[PoolName.KV.value]
        assert view.page_bytes == len(MARKER) and view.memoryless
        other = torch.zeros(len(MARKER), dtype=torch.uint8)  # a whole, checksummed page, not the marker
        assert ours.store.put(view.namespace, ["e"], [[(other.data_ptr(), other.nbytes)]]) == [True]
        assert ours.store_present(PoolName.KV, ["e"]) == [True]
        wrong = [PoolTransfer(name=PoolName.KV, host_indices=torch.arange(0, 2 * PAGE), keys=["e", "a"])]
        assert ours.batch_get_v2(wrong) == {PoolName.KV: [False, True]}
    finally:
        ours.close()


def test_legacy_flat_pages_round_trip(sglang, shm_dir, pools):
    """SGLang's legacy calls (interface_v1 off): set/batch_set of flat pages, get/batch_get into
    flat targets - byte-exact, None for a miss - in a namespace of their own."""
    kv = pools[0]
    store = _store(shm_dir / "arena", kv, extra={"interface_v1": 0})
    try:
        pages = [kv.get_data_page(i * PAGE, flat=True) for i in range(3)]
        assert store.batch_set(["a", "b", "c"], pages) is True
        assert store.set("d", kv.get_data_page(3 * PAGE, flat=True)) is True
        targets = [torch.zeros_like(p) for p in pages] + [torch.zeros_like(pages[0])]
        got = store.batch_get(["a", "b", "c", "zz"], targets)
        assert got[3] is None and all(torch.equal(g.view(torch.int16), p.view(torch.int16)) for g, p in zip(got, pages))
        assert store.batch_exists(["a", "b", "c", "d", "zz"]) == 4
        with pytest.raises(TransferError, match="not one flat page"):
            store.batch_get(["a"], [torch.zeros(3)])
    finally:
        store.close()


def test_host_indices_outside_the_pool_are_an_error_before_any_copy(sglang, shm_dir, pools):
    """A page start past the pool's end, a start off a page boundary, or fewer indices than
    the keys need: TransferError naming it, and nothing was stored."""
    kv = pools[0]
    store = _store(shm_dir / "arena", kv)
    try:
        with pytest.raises(TransferError, match="not the start of a page inside"):
            store.batch_set_v1(["a"], torch.arange(kv.size, kv.size + PAGE))
        with pytest.raises(TransferError, match="not the start of a page"):
            store.batch_set_v1(["a"], torch.arange(3, 3 + PAGE))
        with pytest.raises(TransferError, match="need 32 host indices, got 16"):
            store.batch_get_v1(["a", "b"], torch.arange(0, PAGE))
        assert store.batch_exists(["a"]) == 0
    finally:
        store.close()


def test_get_stats_is_a_dict_and_sglangs_storage_metrics(sglang, shm_dir, pools):
    """At least pages, bytes, hits, misses, torn, evictions - and SGLang's StorageMetrics type
    its metrics collector asserts, carrying the pages each prefetch and backup moved."""
    from sglang.srt.observability.metrics_collector import StorageMetrics

    store = _store(shm_dir / "arena", pools[0], metrics=True)
    try:
        store.batch_set_v1(["a", "b"], torch.arange(0, 2 * PAGE))
        store.batch_get_v1(["a", "b", "c"], torch.arange(4 * PAGE, 7 * PAGE))
        stats = store.get_stats()
        assert isinstance(stats, StorageMetrics) and isinstance(stats, dict)
        assert {k: stats[k] for k in ("pages", "hits", "misses", "torn", "evictions")} == \
               dict(pages=2, hits=2, misses=1, torn=0, evictions=0)
        assert stats["bytes"] == 2 * store.pools["kv"].page_bytes
        assert (stats.backup_pgs, stats.prefetch_pgs) == ([2], [2])
        assert store.get_stats().backup_pgs == []  # drained: each figure reported once
    finally:
        store.close()


def test_sglangs_own_storage_metrics_collector_logs_what_get_stats_returns(sglang, shm_dir, pools):
    """SGLang's `StorageMetricsCollector.log_storage_metrics` - what its radix cache hands
    `get_stats()`'s result to on every step under --enable-metrics - takes ours (it asserts
    StorageMetrics) and records each prefetch's and backup's pages and bandwidth into its
    histograms (here bound to a registry of the test's own through its DI hooks)."""
    import functools

    prometheus_client = pytest.importorskip("prometheus_client")
    from sglang.srt.observability.metrics_collector import StorageMetricsCollector

    registry = prometheus_client.CollectorRegistry()

    class Collector(StorageMetricsCollector):
        _counter_cls = functools.partial(prometheus_client.Counter, registry=registry)
        _gauge_cls = functools.partial(prometheus_client.Gauge, registry=registry)
        _histogram_cls = functools.partial(prometheus_client.Histogram, registry=registry)

    collector = Collector(labels={"tp_rank": "0"})
    store = _store(shm_dir / "arena", pools[0], metrics=True)
    try:
        store.batch_set_v1(["a", "b", "c"], torch.arange(0, 3 * PAGE))
        store.batch_get_v1(["a", "b"], torch.arange(4 * PAGE, 6 * PAGE))
        stats = store.get_stats()
        stats.prefetch_stats = {}  # what SGLang's radix cache sets where a back end has none
        collector.log_storage_metrics(stats)
        collector.log_storage_metrics(store.get_stats())  # drained: nothing more is recorded

        def sample(name: str) -> float:
            return registry.get_sample_value(name, {"tp_rank": "0"})

        assert (sample("sglang:backup_pgs_sum"), sample("sglang:backup_pgs_count")) == (3, 1)
        assert (sample("sglang:prefetch_pgs_sum"), sample("sglang:prefetch_pgs_count")) == (2, 1)
        assert sample("sglang:backup_bandwidth_count") == 1 and sample("sglang:backup_bandwidth_sum") > 0
        assert sample("sglang:prefetch_bandwidth_count") == 1 and sample("sglang:prefetch_bandwidth_sum") > 0
    finally:
        store.close()


def test_the_pages_each_transfer_moved_are_kept_only_for_sglangs_metrics_and_boundedly(sglang, shm_dir, pools,
                                                                                        monkeypatch):
    """The pages and bandwidth of each prefetch and backup are what SGLang's storage metrics
    drain through `get_stats` - and SGLang calls it only with --enable-metrics
    (`enable_storage_metrics`, as its Mooncake store records them only then). Without it
    nothing is kept: the lists grew by four entries a batch for the server's life, metrics
    being off by default. With it, a caller that never drains them keeps the latest 4,096."""
    from hicache.compat import sglang_store

    quiet = _store(shm_dir / "arena", pools[0])
    try:
        for _ in range(20):
            quiet.batch_set_v1(["a"], torch.arange(0, PAGE))
            quiet.batch_get_v1(["a"], torch.arange(PAGE, 2 * PAGE))
        stats = quiet.get_stats()
        assert (stats.backup_pgs, stats.prefetch_pgs, stats.backup_bandwidth, stats.prefetch_bandwidth) == ([],) * 4
        assert stats["hits"] == 20  # the store's own figures stay
    finally:
        quiet.close()
    monkeypatch.setattr(sglang_store, "KEPT_TRANSFERS", 8)
    counted = _store(shm_dir / "arena", pools[1], model="counted", metrics=True)
    try:
        for n in range(1, 13):  # batches of 1, 2, ... 12 pages
            counted.batch_set_v1([f"k{n}-{i}" for i in range(n)], torch.arange(0, n * PAGE))
        assert counted.get_stats().backup_pgs == list(range(5, 13))  # the latest 8 of 12
    finally:
        counted.close()


def test_a_full_namespace_table_is_logged_once_a_minute_not_once_a_batch(sglang, shm_dir, pools, monkeypatch, caplog):
    """A write that finds the arena's namespace table full fails its pages (False) and logs an
    error - once, then at most once a minute on the store's clock (injected), naming how many
    batches failed since: SGLang's backup thread writes every step, and each one logged it (a
    node past 256 namespaces filled the server's log)."""
    import logging

    from hicache.errors import NamespaceTableFullError

    store = _store(shm_dir / "arena", pools[0])
    clock = [0.0]
    monkeypatch.setattr(store, "clock", lambda: 5000.0 + clock[0])  # a monotonic clock is never near 0

    def full(*args, **kwargs):
        raise NamespaceTableFullError("all 256 namespace entries hold pages")

    monkeypatch.setattr(store.store, "put", full)
    try:
        with caplog.at_level(logging.ERROR, logger="hicache.compat.sglang_store"):
            for step in range(30):
                clock[0] = step * 1.0
                assert store.batch_set_v1(["a", "b"], torch.arange(0, 2 * PAGE)) == [False, False]
            said = [r.getMessage() for r in caplog.records if r.name == "hicache.compat.sglang_store"]
            assert len(said) == 1 and "all 256 namespace entries hold pages" in said[0]
            clock[0] = 60.0
            store.batch_set_v1(["c"], torch.arange(0, PAGE))
            said = [r.getMessage() for r in caplog.records if r.name == "hicache.compat.sglang_store"]
            assert len(said) == 2 and "30 batches" in said[1]
    finally:
        store.close()


def _counted_store(shm_dir, pool, monkeypatch):
    """(a store with SGLang's storage metrics on, its injected clock, the clock's time at each
    census it takes)."""
    store = _store(shm_dir / "arena", pool, metrics=True)
    clock = [0.0]
    monkeypatch.setattr(store, "clock", lambda: clock[0])
    censuses = []
    real = store.store.census
    monkeypatch.setattr(store.store, "census", lambda: censuses.append(clock[0]) or real())
    return store, clock, censuses


def test_get_stats_counts_the_arena_at_most_every_ten_seconds(sglang, shm_dir, pools, monkeypatch):
    """SGLang calls `get_stats` on every scheduler step when --enable-metrics is on (its
    `check_hicache_events`), and a census scans every slot of the arena (0.25 s at 516,000 slots):
    the census is taken on the first call and again only once 10 s have passed on the store's
    clock (injected); the step's own figures - pages moved, hits, misses - are fresh every call."""
    store, clock, censuses = _counted_store(shm_dir, pools[0], monkeypatch)
    try:
        store.batch_set_v1(["a"], torch.arange(0, PAGE))
        assert store.get_stats()["pages"] == 1 and len(censuses) == 1
        store.batch_set_v1(["b"], torch.arange(PAGE, 2 * PAGE))
        store.batch_get_v1(["a", "c"], torch.arange(4 * PAGE, 6 * PAGE))
        for step in range(50):
            clock[0] = step * 0.199  # 50 scheduler steps within 10 s
            stats = store.get_stats()
            assert stats["pages"] == 1 and (stats["hits"], stats["misses"]) == (1, 1)
            assert stats.backup_pgs == ([1] if step == 0 else []) and stats.prefetch_pgs == ([1] if step == 0 else [])
        assert len(censuses) == 1
        clock[0] = 10.0
        store.get_stats()  # starts the census beside this step
        store.census_refresh.wait()
        assert store.get_stats()["pages"] == 2 and len(censuses) == 2
    finally:
        store.close()


@pytest.mark.concurrency
def test_a_stale_census_is_retaken_beside_the_scheduler_step_never_on_it(sglang, shm_dir, pools, monkeypatch):
    """A census of a production arena takes ~0.13 s (3 M slots), and SGLang's scheduler thread
    calls `get_stats` between its steps: once the census is 10 s old the step gets the last one at
    once while a thread of its own takes the next (here held until the test lets it go: the step
    returned while it was still counting), one at a time however many steps ask; the next step
    after it finishes sees the new count. Only the first call, with nothing older to show, waits."""
    import threading

    store = _store(shm_dir / "arena", pools[0], metrics=True)
    clock = [0.0]
    monkeypatch.setattr(store, "clock", lambda: clock[0])
    real = store.store.census
    held, counting, threads = threading.Event(), threading.Event(), []

    step_thread = threading.current_thread()

    def slow_census():
        threads.append(threading.current_thread())
        assert threads[-1] is not step_thread, "the census ran on the step's own thread"
        counting.set()
        assert held.wait(timeout=60), "the test never let the census go"
        return real()

    try:
        store.batch_set_v1(["a"], torch.arange(0, PAGE))
        assert store.get_stats()["pages"] == 1  # the first census, waited for
        monkeypatch.setattr(store.store, "census", slow_census)
        store.batch_set_v1(["b"], torch.arange(PAGE, 2 * PAGE))
        clock[0] = 10.0
        for _ in range(20):  # steps while the census counts: each gets the last one, none waits
            assert store.get_stats()["pages"] == 1
        assert counting.wait(timeout=60) and not held.is_set()
        assert len(threads) == 1
        held.set()
        store.census_refresh.wait()
        assert store.get_stats()["pages"] == 2 and len(threads) == 1
    finally:
        held.set()
        store.close()


@pytest.mark.concurrency
def test_a_census_that_fails_keeps_the_last_and_close_waits_for_one_in_flight(sglang, shm_dir, pools, monkeypatch,
                                                                              caplog):
    """A census that raises on its thread is logged and the steps keep the last count (no
    exception reaches SGLang's scheduler), tried again only once 10 s later; `close` while a census counts waits for it to finish
    before the arena is unmapped, and `get_stats` after close reports an empty store."""
    import logging
    import threading

    store = _store(shm_dir / "arena", pools[0], metrics=True)
    clock = [0.0]
    monkeypatch.setattr(store, "clock", lambda: clock[0])
    real_store, real_index = store.store.census, store.store.index.census
    store.batch_set_v1(["a"], torch.arange(0, PAGE))
    assert store.get_stats()["pages"] == 1

    broke = []

    def broken():
        broke.append(clock[0])
        raise RuntimeError("a census that breaks")

    monkeypatch.setattr(store.store, "census", broken)
    clock[0] = 10.0
    with caplog.at_level(logging.WARNING, logger="hicache.compat"):
        for _ in range(5):
            assert store.get_stats()["pages"] == 1
            store.census_refresh.wait()
    assert broke == [10.0]  # tried again once it is 10 s old, not on every step
    assert [r for r in caplog.records if "a census that breaks" in r.getMessage()]
    held, counting, closed = threading.Event(), threading.Event(), threading.Event()

    def slow_census():  # the index's: inside the store's census, which holds the arena mapped
        counting.set()
        assert held.wait(timeout=60), "the test never let the census go"
        return real_index()

    monkeypatch.setattr(store.store, "census", real_store)
    monkeypatch.setattr(store.store.index, "census", slow_census)
    clock[0] = 30.0
    try:
        store.get_stats()
        assert counting.wait(timeout=60)
        closer = threading.Thread(target=lambda: (store.close(), closed.set()))
        closer.start()
        assert not closed.wait(timeout=0.2)  # a guard only: the census still holds the arena
        held.set()
        closer.join(timeout=60)
        assert closed.is_set() and store.store.closed
        assert store.get_stats()["pages"] == 0
    finally:
        held.set()
        store.close()


def test_clear_empties_this_engines_pages_only_and_close_is_idempotent(sglang, shm_dir, pools):
    """Two engines of different models share an arena: one clears, the other's pages stay.
    close() twice is fine; SGLang's detach calls it."""
    mine = _store(shm_dir / "arena", pools[0], model="a")
    other = _store(shm_dir / "arena", pools[1], model="b")
    try:
        mine.batch_set_v1(["k"], torch.arange(PAGE))
        other.batch_set_v1(["k"], torch.arange(PAGE))
        mine.clear()
        assert (mine.batch_exists(["k"]), other.batch_exists(["k"])) == (0, 1)
    finally:
        mine.close()
        mine.close()
        other.close()
    with pytest.raises(RuntimeError, match="closed"):
        mine.batch_exists(["k"])


def test_a_segment_outside_the_pools_buffers_is_refused_before_any_copy(sglang, shm_dir, pools, monkeypatch):
    """A pool whose get_page_buffer_meta points past its own buffer (a bug, or a layout we do
    not know): the copy is refused naming the segment, nothing stored or read."""
    kv = pools[0]
    store = _store(shm_dir / "arena", kv)
    real = kv.get_page_buffer_meta

    def past_the_end(indices):
        ptrs, sizes = real(indices)
        return [kv.kv_buffer.data_ptr() + kv.kv_buffer.nbytes - sizes[0] // 2] * len(ptrs), sizes

    monkeypatch.setattr(kv, "get_page_buffer_meta", past_the_end)
    try:
        with pytest.raises(TransferError, match="lies outside its buffers"):
            store.batch_set_v1(["a"], torch.arange(PAGE))
        assert store.batch_exists(["a"]) == 0
    finally:
        store.close()


@pytest.mark.parametrize("wrong", ["a segment short", "a size short"])
def test_page_meta_of_the_wrong_length_is_refused_before_any_copy(sglang, shm_dir, pools, monkeypatch, wrong):
    """A pool whose get_page_buffer_meta gives fewer segments than its pages have, or fewer sizes
    than pointers: the batch is refused naming the pool, nothing stored."""
    kv = pools[0]
    store = _store(shm_dir / "arena", kv)
    real = kv.get_page_buffer_meta

    def short(indices):
        ptrs, sizes = real(indices)
        return (ptrs[:-1], sizes[:-1]) if wrong == "a segment short" else (ptrs, sizes[:-1])

    monkeypatch.setattr(kv, "get_page_buffer_meta", short)
    try:
        with pytest.raises(TransferError, match="pool 'kv': \\d+ segments for 2 pages"):
            store.batch_set_v1(["a", "b"], torch.arange(2 * PAGE))
        assert store.batch_exists(["a"]) == 0
    finally:
        store.close()


def test_metrics_report_the_arena_and_this_engines_counts(sglang, shm_dir, pools):
    """hicache_store_* in a Prometheus registry (as a server's /metrics scrapes it): the arena's
    bytes by backing, used slots, pages, this process's hits, misses and writes, attach seconds;
    once closed the arena is no longer reported."""
    prometheus_client = pytest.importorskip("prometheus_client")
    from hicache import metrics

    registry = prometheus_client.CollectorRegistry()
    assert metrics.install(registry)
    store = _store(shm_dir / "arena", pools[0])
    arena = str(shm_dir / "arena")
    try:
        store.batch_set_v1(["a", "b", "c"], torch.arange(0, 3 * PAGE))
        store.batch_get_v1(["a", "zz"], torch.arange(4 * PAGE, 6 * PAGE))
        text = prometheus_client.generate_latest(registry).decode()
        values = {line.rsplit(" ", 1)[0]: float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
                  if line.startswith("hicache_store_")}
        at = f'arena="{arena}"'
        assert values[f'hicache_store_bytes{{{at},backing="tmpfs"}}'] == store.store.arena.plan.total_bytes
        assert values[f'hicache_store_slots{{{at},state="used"}}'] == 3
        assert values[f'hicache_store_pages{{{at}}}'] == 3
        assert (values[f'hicache_store_hits_total{{{at}}}'], values[f'hicache_store_misses_total{{{at}}}'],
                values[f'hicache_store_writes_total{{{at}}}']) == (1, 1, 3)
        assert values[f'hicache_store_attach_seconds{{{at}}}'] > 0
    finally:
        store.close()
    assert f'arena="{arena}"' not in prometheus_client.generate_latest(registry).decode()


@pytest.mark.concurrency
def test_the_metrics_scrape_and_get_stats_share_one_census_at_most_ten_seconds_old(sglang, shm_dir, pools,
                                                                                    monkeypatch):
    """Every rank's metrics publisher scrapes every 5 s and SGLang's scheduler asks `get_stats`
    every step; a census reads every slot (170 ms and 245 MiB at 2.8 M slots). Both read the one
    census of the L3 seam, retaken once it is 10 s old on the store's clock (injected): four
    scrapes and a get_stats within 10 s take one census, the next after 10 s one more."""
    prometheus_client = pytest.importorskip("prometheus_client")
    from hicache import metrics

    registry = prometheus_client.CollectorRegistry()
    assert metrics.install(registry)
    store, clock, censuses = _counted_store(shm_dir, pools[0], monkeypatch)
    pages = f'hicache_store_pages{{arena="{shm_dir / "arena"}"}}'

    def scraped() -> float:
        text = prometheus_client.generate_latest(registry).decode()
        return next(float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line.startswith(pages))

    try:
        store.batch_set_v1(["a"], torch.arange(0, PAGE))
        for step in range(4):
            clock[0] = step * 2.0
            assert scraped() == 1
        assert store.get_stats()["pages"] == 1 and censuses == [0.0]
        store.batch_set_v1(["b"], torch.arange(PAGE, 2 * PAGE))
        clock[0] = 10.0
        scraped()  # starts the next census beside the scrape
        store.census_refresh.wait()
        assert scraped() == 2 and store.get_stats()["pages"] == 2 and censuses == [0.0, 10.0]
    finally:
        store.close()


def test_the_launch_flags_in_docs_store_md_build_the_store_through_sglangs_own_parsing(sglang, shm_dir, pools):
    """The --hicache-storage-backend-extra-config JSON docs/store.md shows, parsed by SGLang's
    own `parse_storage_backend_extra_config` (which takes its keys out) and handed to its factory
    with backend "dynamic": a HiCacheNodeStore that stores zero-copy, and SGLang passes prefix keys."""
    import json
    import re
    from pathlib import Path

    from sglang.srt.mem_cache.hybrid_cache.hybrid_cache_controller import HybridCacheController
    from sglang.srt.mem_cache.storage.backend_factory import StorageBackendFactory

    doc = (Path(__file__).resolve().parents[1] / "docs" / "store.md").read_text()
    shown = re.search(r"--hicache-storage-backend-extra-config '(\{.*?\})'", doc, re.S).group(1)
    assert json.loads(shown)["arena"] == "/dev/shm/hicache-kv"
    ours = shown.replace("/dev/shm/hicache-kv", str(shm_dir / "arena")).replace('"size_gb": 200', f'"size_gb": {GB}')
    extra, threshold, _, _, pass_prefix_keys = HybridCacheController.parse_storage_backend_extra_config(ours)
    assert pass_prefix_keys is True and threshold == 256
    store = StorageBackendFactory.create_backend("dynamic", _config(extra), pools[0])
    store.register_mem_pool_host(pools[0])
    store.on_host_pools_registered()
    try:
        assert store.zero_copy and store.batch_set_v1(["a"], torch.arange(PAGE)) == [True]
    finally:
        store.close()


def test_an_engine_creating_the_arena_logs_its_pre_fault_progress(sglang, shm_dir, pools, caplog):
    """The first engine creates the arena: SGLang's log shows the pre-fault's progress to 100 %
    and one line saying it created it (the others say attached)."""
    import logging

    with caplog.at_level(logging.INFO, logger="hicache.compat.sglang_store"):
        first = _store(shm_dir / "arena", pools[0])
        second = _store(shm_dir / "arena", pools[1])
    first.close()
    second.close()
    lines = [r.getMessage() for r in caplog.records if r.name == "hicache.compat.sglang_store"]
    assert any("pre-faulted" in line and "(100 %)" in line for line in lines)
    assert sum("created arena" in line for line in lines) == 1 and sum("attached arena" in line for line in lines) == 1


def test_a_layout_sglang_gives_no_page_access_for_is_one_clear_error(sglang, shm_dir):
    """SGLang's page_unified host pools refuse both get_page_buffer_meta and get_data_page (its
    own L3 back ends cannot store them): registering one is an ArenaError naming the layout,
    before any arena exists."""
    with fake_cuda():
        device = _device("mla")
        info = device.get_device_pool_infos()[0].buffer_info
        pool = _build(_classes("mla")[0], "mla", info, "page_unified", hicache=False)
        with pytest.raises(ArenaError, match="layout 'page_unified'.* gives no page access for L3"):
            _store(shm_dir / "arena", pool, mla=True)
    assert os.listdir(shm_dir) == []


def test_a_pool_that_refuses_zero_copy_is_served_through_its_flat_pages(sglang, shm_dir, pools, monkeypatch):
    """A pool whose get_page_buffer_meta raises for its layout (as SGLang's do for some): v1
    calls still store and load its pages byte-exact, through SGLang's flat-page accessors."""
    kv = pools[0]

    def refuse(indices):
        raise ValueError(f"Unsupported layout: {kv.layout}")

    monkeypatch.setattr(kv, "get_page_buffer_meta", refuse)
    store = _store(shm_dir / "arena", kv)
    try:
        assert not store.pools["kv"].zero_copy
        want = [_page(kv, i).clone() for i in range(2)]
        assert store.batch_set_v1(["a", "b"], torch.arange(0, 2 * PAGE)) == [True, True]
        assert store.batch_get_v1(["a", "b"], torch.arange(6 * PAGE, 8 * PAGE)) == [True, True]
        assert all(torch.equal(_page(kv, 6 + i), want[i]) for i in range(2))
    finally:
        store.close()


def test_a_pool_whose_pages_are_not_whole_checksum_words_is_refused_before_any_arena(sglang, shm_dir, pools,
                                                                                      monkeypatch):
    """A pool whose flat page is not a multiple of 8 bytes (the store checksums whole words) is
    one ArenaError naming the pool and its page size, before any arena exists - not a refusal
    of every batch later."""
    kv = pools[0]
    monkeypatch.setattr(kv, "get_page_buffer_meta", lambda indices: (_ for _ in ()).throw(ValueError("no")))
    monkeypatch.setattr(kv, "get_data_page", lambda index, flat=True: torch.zeros(12, dtype=torch.uint8))
    with pytest.raises(ArenaError, match="pool 'kv' has pages of 12 bytes, not a multiple of 8"):
        _store(shm_dir / "arena", kv)
    assert os.listdir(shm_dir) == []


@pytest.mark.concurrency
def test_close_racing_a_batch_get_v1_in_flight_waits_and_later_calls_are_errors(sglang, shm_dir, pools):
    """SGLang's prefetch thread stopped inside batch_get_v1's copy (an Event): close() from
    another thread waits for it; released, the read completes with the stored bytes, and every
    later call - batch_get_v1, batch_set_v1, batch_exists - is StoreClosedError (a RuntimeError),
    never a read of unmapped memory."""
    import threading

    from store_support import StoppingOps, wait_until

    from hicache.errors import StoreClosedError

    writer, reader = pools[0], pools[1]
    store = _store(shm_dir / "arena", writer)
    assert store.batch_set_v1(["a"], torch.arange(0, PAGE)) == [True]
    store.close()
    store = _store(shm_dir / "arena", reader)
    closed = threading.Event()
    stopping = store.store.index.ops = StoppingOps(store.store.index.ops)
    result = []
    prefetch = threading.Thread(target=lambda: result.append(store.batch_get_v1(["a"], torch.arange(2 * PAGE,
                                                                                                   3 * PAGE))))
    closer = threading.Thread(target=lambda: (store.close(), closed.set()))
    try:
        prefetch.start()
        assert stopping.inside.wait(60), "hang guard"
        closer.start()
        wait_until(lambda: store.store.closed)
        assert not closed.is_set()  # it waits for the copy in flight
    finally:
        stopping.go.set()
        prefetch.join(60)
        closer.join(60)
    assert result == [[True]] and closed.is_set()
    assert torch.equal(_page(reader, 2), _page(writer, 0))
    for call in (lambda: store.batch_get_v1(["a"], torch.arange(0, PAGE)),
                 lambda: store.batch_set_v1(["b"], torch.arange(0, PAGE)), lambda: store.batch_exists(["a"])):
        with pytest.raises(StoreClosedError, match="closed"):
            call()


def test_a_slot_size_below_this_engines_pages_is_refused_before_the_arena_exists(sglang, shm_dir, pools):
    """extra_config's ``slot_bytes`` smaller than the engine's largest page: one ArenaError
    naming both at SGLang's attach, and no arena file made."""
    page = pools[0].get_data_page(0, flat=True).nbytes
    with pytest.raises(ArenaError, match=f"'slot_bytes' 1024 is below this engine's largest page of {page} bytes"):
        _store(shm_dir / "arena", pools[0], extra={"slot_bytes": 1024})
    assert os.listdir(shm_dir) == []


def test_an_attach_with_no_host_pool_is_refused(sglang, shm_dir):
    """on_host_pools_registered() before any host pool was registered: an ArenaError saying so,
    and no arena file made."""
    from sglang.srt.mem_cache.storage.backend_factory import StorageBackendFactory

    store = StorageBackendFactory.create_backend("dynamic", _config(_extra(shm_dir / "arena")), None)
    with pytest.raises(ArenaError, match="no host pool was registered before on_host_pools_registered"):
        store.on_host_pools_registered()
    assert os.listdir(shm_dir) == []


def test_a_pool_the_engine_never_registered_or_one_too_large_for_the_slots_is_refused(sglang, shm_dir, pools):
    """A v2 transfer naming a pool never registered is a TransferError naming it; a pool
    registered after the arena opened whose pages exceed its slots is an ArenaError naming both
    sizes - neither copies a byte."""
    from sglang.srt.mem_cache.hicache_storage import PoolTransfer

    store = _store(shm_dir / "arena", pools[0])
    try:
        indices = torch.arange(0, PAGE, dtype=torch.int64)
        with pytest.raises(TransferError, match="no host pool named 'nowhere' was registered"):
            store.batch_set_v2([PoolTransfer(name="nowhere", host_indices=indices, keys=["k"])])
        big = _build(_classes("mha")[0], "mha", _device("mha", layers=6).get_device_pool_infos()[0].buffer_info,
                     "page_first_direct", hicache=False)
        slots = store.store.arena.plan.slot_bytes
        with pytest.raises(ArenaError, match=f"pool 'big' pages of \\d+ bytes do not fit the arena's {slots}-byte slots"):
            store.register_mem_host_pool_v2(big, "big")
            store.batch_exists_v2(["k"], [PoolTransfer(name="big", keys=["k"])])
        assert store.batch_exists(["k"]) == 0
    finally:
        store.close()


def test_a_legacy_batch_set_of_mismatched_or_misshaped_values_is_refused(sglang, shm_dir, pools):
    """The legacy flat-page ``batch_set``: fewer values than keys, or a value that is not one flat
    page, is a TransferError naming it, and nothing is stored."""
    store = _store(shm_dir / "arena", pools[0])
    try:
        page = _page(pools[0], 0)
        with pytest.raises(TransferError, match="2 keys but 1 values"):
            store.batch_set(["a", "b"], [page])
        with pytest.raises(TransferError, match=f"value for 'a' has {page.nbytes // 2} bytes, a flat page is "
                                                f"{page.nbytes}"):
            store.batch_set(["a"], [page[: page.nbytes // 2]])
        assert store.batch_exists(["a", "b"]) == 0
    finally:
        store.close()


def _grid():
    """Every rank layout SGLang 0.5.23's storage config admits at TP <= 4, PP and CP <= 2, DCP
    (MLA only, contiguous groups within TP) <= 2: (is_mla, tp, pp, cp, dcp) as (rank, size) pairs."""
    for is_mla in (True, False):
        for tp_size in (1, 2, 4):
            for tp_rank in range(tp_size):
                for pp in ((0, 1), (0, 2), (1, 2)):
                    for cp in ((0, 1), (0, 2), (1, 2)):
                        for dcp_size in (1, 2) if is_mla else (1,):
                            if tp_size % dcp_size == 0:
                                yield is_mla, (tp_rank, tp_size), pp, cp, (tp_rank % dcp_size, dcp_size)


@pytest.mark.parametrize("pool", ["kv", "mamba"])
def test_ranks_share_a_namespace_exactly_where_sglangs_hicache_file_shares_a_file(sglang, tmp_path, pool):
    """The shard in a namespace (`shard_of`) against SGLang 0.5.23's own HiCacheFile, which keys a
    page's file by a suffix of its rank layout: over every layout of the grid, two engines' pages
    share a namespace exactly when HiCacheFile gives them one file - never pages another rank's
    bytes could answer (a shared namespace where SGLang keeps two files), never a miss SGLang would hit."""
    from sglang.srt.mem_cache.hicache_storage import HiCacheFile, HiCacheStorageConfig

    by_suffix: dict[str, set] = {}
    by_shard: dict[tuple, set] = {}
    for is_mla, (tp_rank, tp_size), (pp_rank, pp_size), (cp_rank, cp_size), (dcp_rank, dcp_size) in _grid():
        config = HiCacheStorageConfig(
            tp_rank=tp_rank, tp_size=tp_size, pp_rank=pp_rank, pp_size=pp_size, attn_cp_rank=cp_rank,
            attn_cp_size=cp_size, is_mla_model=is_mla, enable_storage_metrics=False, is_page_first_layout=True,
            model_name="org/model", dcp_size=dcp_size, dcp_rank=dcp_rank,
            logical_page_size=64 if dcp_size > 1 else None)
        key = "page-hash" + (".mamba" if pool == "mamba" else "")
        suffix = HiCacheFile(config, file_path=str(tmp_path))._get_suffixed_key(key)
        shard = shard_of(is_mla=is_mla, pool=pool, tp_rank=tp_rank, tp_size=tp_size, pp_rank=pp_rank,
                               pp_size=pp_size, cp_rank=cp_rank, cp_size=cp_size, dcp_rank=dcp_rank, dcp_size=dcp_size)
        by_suffix.setdefault(suffix, set()).add(shard)
        by_shard.setdefault(shard, set()).add(suffix)
    assert len(by_suffix) > 20
    assert {s: shards for s, shards in by_suffix.items() if len(shards) > 1} == {}  # one file, two namespaces
    assert {s: suffixes for s, suffixes in by_shard.items() if len(suffixes) > 1} == {}  # one namespace, two files


@pytest.mark.parametrize("model", [
    "/models/huggingface/hub/models--meta-llama--Llama-3.1-70B-Instruct/snapshots/1605565b47bb9346c5515c34102e054115b4f98b",
    "/srv/модели/" + "Ω" * 40,
], ids=["hf-snapshot-path", "multibyte"])
def test_a_long_served_model_name_labels_the_arena_shortened(sglang, shm_dir, pools, model):
    """SGLang's served model name defaults to ``--model-path``, and a Hugging Face cache path is
    longer than the header's 64-byte label: the engine creating the arena labels it with that
    name shortened in the middle (whole characters, the head and tail kept) - it failed its
    attach with ``store label must be at most 64 bytes``, so every engine on the node did."""
    from hicache.effects import arena as effects_arena

    store = _store(shm_dir / "arena", pools[0], model=model)
    try:
        assert store.batch_set_v1(["a"], torch.arange(0, PAGE)) == [True]
    finally:
        store.close()
    attached = effects_arena.attach_arena(str(shm_dir / "arena"))
    try:
        label = attached.label
    finally:
        attached.close()
    assert len(label.encode()) <= 64 and "..." in label
    head, _, tail = label.partition("...")
    assert model.startswith(head) and model.endswith(tail) and len(head) >= 10 and len(tail) >= 10


def test_docs_store_md_lists_every_extra_config_key_as_the_code_says_it():
    """docs/store.md's extra_config table is `CONFIG_KEYS`, row for row (backticks aside): what an
    operator reads there is what the back end reads and checks (the two had drifted apart)."""
    import pathlib
    import re

    from hicache.compat._store_config import CONFIG_KEYS  # as sglang_store names it, without SGLang

    text = (pathlib.Path(__file__).parent.parent / "docs" / "store.md").read_text()
    table = text.split("### extra_config keys", 1)[1].split("\n\n(", 1)[0]
    rows = dict(re.findall(r"^\| `(\w+)` \| (.+) \|$", table, flags=re.M))
    assert {key: meaning.replace("`", "") for key, meaning in rows.items()} == {
        key: meaning.replace("`", "") for key, meaning in CONFIG_KEYS.items()}


def test_after_clear_the_next_census_starts_at_once_not_ten_seconds_later(sglang, shm_dir, pools, monkeypatch):
    """SGLang's /clear_hicache_storage_backend calls `clear()`: the census of before is out of
    date, so the next `get_stats` starts a new one beside it (the clock has not moved), and the
    step after it sees the cleared store - not 10 s of pages that are gone."""
    store, clock, censuses = _counted_store(shm_dir, pools[0], monkeypatch)
    try:
        store.batch_set_v1(["a", "b"], torch.arange(0, 2 * PAGE))
        assert store.get_stats()["pages"] == 2
        store.clear()
        store.get_stats()
        store.census_refresh.wait()
        assert store.get_stats()["pages"] == 0 and censuses == [0.0, 0.0]
    finally:
        store.close()


def test_a_census_is_taken_on_the_callers_thread_where_no_thread_can_start(sglang, shm_dir, pools, monkeypatch):
    """Python refuses new threads once the interpreter is exiting (a last scrape or get_stats
    from an atexit hook): a stale census is then taken on the caller's own thread, not lost to
    a RuntimeError."""
    import threading

    store = _store(shm_dir / "arena", pools[0], metrics=True)
    clock = [0.0]
    monkeypatch.setattr(store, "clock", lambda: clock[0])
    try:
        store.batch_set_v1(["a"], torch.arange(0, PAGE))
        assert store.get_stats()["pages"] == 1
        store.batch_set_v1(["b"], torch.arange(PAGE, 2 * PAGE))

        def refused(self):
            raise RuntimeError("can't create new thread at interpreter shutdown")

        monkeypatch.setattr(threading.Thread, "start", refused)
        clock[0] = 10.0
        assert store.get_stats()["pages"] == 2 and store.census_refresh._running is None
    finally:
        store.close()
