"""HiCacheNodeStore's calls off SGLang's main path, over SGLang 0.5.23's real pools (needs `make
sglang`): a caller that never fires on_host_pools_registered, the legacy single-key calls beside
the zero-copy ones, empty transfers answered as HiCacheFile answers them, a pool refused at its
registration staying refused, a sidecar's namespace whenever it registers, the arena's size from
``size_gb``, a bad arena path refused at construction, and the pace of the creation's log."""

from __future__ import annotations

import logging
import os

import pytest
from sglang_support import sglang  # noqa: F401 - a fixture
from store_support import shm_dir  # noqa: F401 - a fixture
from test_sglang_conformance import PAGE, _build, _classes, _device
from test_store_sglang import GB, _config, _extra, _file_backend, _page, _store, pools  # noqa: F401 - pools: a fixture

from hicache.errors import ArenaError

torch = pytest.importorskip("torch")


def test_a_caller_that_never_fires_on_host_pools_registered_attaches_at_its_first_call(sglang, shm_dir, pools):
    """SGLang's attach fires on_host_pools_registered; a caller that registers the pool and goes
    straight to a transfer gets the arena opened then, not an AttributeError from a missing one."""
    from sglang.srt.mem_cache.storage.backend_factory import StorageBackendFactory

    store = StorageBackendFactory.create_backend("dynamic", _config(_extra(shm_dir / "arena")), pools[0])
    store.register_mem_pool_host(pools[0])
    try:
        assert store.store is None and os.listdir(shm_dir) == []
        assert store.batch_set_v1(["a"], torch.arange(PAGE)) == [True]
        assert store.store is not None and store.batch_exists(["a", "b"]) == 1
    finally:
        store.close()


def test_legacy_calls_keep_flat_pages_apart_from_the_zero_copy_pages(sglang, shm_dir, pools):
    """With interface_v1 on, the legacy ``set``/``get``/``batch_get`` move flat pages in a
    namespace of their own: a zero-copy page is no legacy hit, nor the other way round (their
    byte orders differ); ``get`` and a ``batch_get`` with no targets return fresh flat pages."""
    kv = pools[0]
    store = _store(shm_dir / "arena", kv)
    try:
        flat = kv.get_data_page(0, flat=True).contiguous()
        assert store.zero_copy and store.set("flat", flat) is True
        assert store.batch_set_v1(["zero"], torch.arange(PAGE, 2 * PAGE)) == [True]
        assert store.batch_exists(["flat"]) == 0 and store.batch_exists(["zero"]) == 1
        assert store.get("zero") is None
        got = store.get("flat")
        assert torch.equal(got.view(torch.uint8), flat.view(torch.uint8))
        again, missing = store.batch_get(["flat", "zero"])
        assert missing is None and torch.equal(again.view(torch.uint8), flat.view(torch.uint8))
        assert again.data_ptr() != got.data_ptr()
    finally:
        store.close()


def test_empty_transfers_answer_as_hicache_file(sglang, shm_dir, pools):
    """A v1 call with no keys, and a v2 transfer with none (keys None or []), move nothing and
    answer with empty lists, as SGLang's own HiCacheFile does."""
    from sglang.srt.mem_cache.hicache_storage import PoolName, PoolTransfer

    kv, swa, _ = pools
    sidecars = [(PoolName.SWA, swa)]
    ours, theirs = _store(shm_dir / "arena", kv, sidecars=sidecars), _file_backend(shm_dir / "file", kv, sidecars)
    none = torch.arange(0, dtype=torch.int64)
    try:
        assert ours.batch_get_v1([], none) == [] and ours.batch_set_v1([], none) == []
        assert ours.batch_exists([]) == 0
        for keys in (None, []):
            transfers = [PoolTransfer(name=PoolName.SWA, host_indices=none, keys=keys)]
            for call in ("batch_set_v2", "batch_get_v2"):
                assert getattr(ours, call)(transfers) == getattr(theirs, call)(transfers) == {PoolName.SWA: []}
    finally:
        ours.close()


def test_a_pool_refused_at_its_registration_stays_refused_at_its_first_transfer(sglang, shm_dir, pools):
    """A sidecar registered after the attach whose pages exceed the slots is refused there; SGLang
    has kept it in its registered pools, and a transfer naming it later is refused again, never
    served (nor a KeyError)."""
    from sglang.srt.mem_cache.hicache_storage import PoolTransfer

    store = _store(shm_dir / "arena", pools[0])
    big = _build(_classes("mha")[0], "mha", _device("mha", layers=6).get_device_pool_infos()[0].buffer_info,
                 "page_first_direct", hicache=False)
    try:
        with pytest.raises(ArenaError, match="pool 'big' pages of"):
            store.register_mem_host_pool_v2(big, "big")
        for _ in range(2):
            with pytest.raises(ArenaError, match="pool 'big' pages of"):
                store.batch_set_v2([PoolTransfer(name="big", host_indices=torch.arange(PAGE), keys=["k"])])
        assert "big" not in store.pools
    finally:
        store.close()


def test_a_sidecar_finds_its_pages_whether_it_registered_before_or_after_the_attach(sglang, shm_dir, pools):
    """The pool's name in the namespace is SGLang's value ("swa"), however it arrived: an engine
    whose SWA pool registered before the attach stores pages, and a restarted one whose pool
    registers after it finds them."""
    from sglang.srt.mem_cache.hicache_storage import PoolName, PoolTransfer

    kv, swa, _ = pools
    first = _store(shm_dir / "arena", kv, sidecars=[(PoolName.SWA, swa)])
    try:
        put = [PoolTransfer(name=PoolName.SWA, host_indices=torch.arange(0, 2 * PAGE), keys=["a", "b"])]
        assert first.batch_set_v2(put) == {PoolName.SWA: [True, True]}
        assert first.pools["swa"].namespace.pool == "swa"
    finally:
        first.close()
    want = [_page(swa, i).clone() for i in range(2)]
    second = _store(shm_dir / "arena", kv, extra={"size_gb": None})
    try:
        second.register_mem_host_pool_v2(swa, PoolName.SWA)
        get = [PoolTransfer(name=PoolName.SWA, host_indices=torch.arange(4 * PAGE, 6 * PAGE), keys=["a", "b"])]
        assert second.batch_get_v2(get) == {PoolName.SWA: [True, True]}
        assert all(torch.equal(_page(swa, 4 + i), want[i]) for i in range(2))
    finally:
        second.close()


def test_size_gb_sizes_a_new_arena_in_decimal_gigabytes(sglang, shm_dir, pools):
    """``size_gb`` is 10**9 bytes a GB, as SGLang's own sizes are: the arena file is that many
    bytes rounded down to whole 4 KiB pages."""
    store = _store(shm_dir / "arena", pools[0])
    try:
        want = int(GB * 10**9) // 4096 * 4096
        assert store.store.arena.plan.total_bytes == want == os.path.getsize(shm_dir / "arena")
    finally:
        store.close()


@pytest.mark.parametrize("where, match", [
    ("missing", r"directory .*/nowhere does not exist"),
    ("fifo", r"is a FIFO, not an arena file"),
])
def test_a_bad_arena_path_is_refused_when_sglang_builds_the_store(sglang, shm_dir, where, match):
    """An arena in a directory that does not exist, or a FIFO at its path: SGLang's factory call
    raises the ArenaError naming it - before any pool is registered, nothing made, no FIFO opened."""
    from sglang.srt.mem_cache.storage.backend_factory import StorageBackendFactory

    path = shm_dir / "nowhere" / "arena"
    if where == "fifo":
        path = shm_dir / "arena"
        os.mkfifo(path)
    with pytest.raises(ArenaError, match=match):
        StorageBackendFactory.create_backend("dynamic", _config(_extra(path)), None)
    assert os.listdir(shm_dir) == ([] if where == "missing" else ["arena"])


def test_the_creations_log_says_its_progress_every_five_seconds_and_at_the_end(sglang, caplog):
    """The pre-fault's progress: a line once 5 s have passed since the last, none between, and
    one at the end whatever the time (the clock is a stand-in). The module imports SGLang."""
    from hicache.compat.sglang_store import _LoggedProgress

    now = [100.0]
    progress = _LoggedProgress(clock=lambda: now[0])
    said = []
    with caplog.at_level(logging.INFO, logger="hicache.compat.sglang_store"):
        for t, done in ((1.0, 1), (4.9, 2), (5.0, 3), (9.0, 4), (10.0, 5), (10.5, 10)):
            now[0] = 100.0 + t
            before = len(caplog.records)
            progress(done, 10)
            if len(caplog.records) > before:
                said.append(done)
    assert said == [3, 5, 10]
    assert "pre-faulted" in caplog.records[-1].getMessage()


def test_each_transfers_bandwidth_is_its_pages_bytes_over_its_time_in_binary_gb(sglang, shm_dir, pools):
    """With storage metrics on, a transfer's bandwidth is the pages it moved times the page's
    bytes over its time, over 2**30, as SGLang's Mooncake store computes it (``gb_per_page``);
    its pages are the ones moved (a miss moves none). The stopwatch is a stand-in."""
    store = _store(shm_dir / "arena", pools[0], metrics=True)
    ticks = iter([10.0, 10.5, 20.0, 20.25])
    store.stopwatch = lambda: next(ticks)
    try:
        page = store.pools["kv"].page_bytes
        assert store.batch_set_v1(["a", "b"], torch.arange(0, 2 * PAGE)) == [True, True]
        assert store.batch_get_v1(["a", "zz"], torch.arange(4 * PAGE, 6 * PAGE)) == [True, False]
        stats = store.get_stats()
        assert (stats.backup_pgs, stats.prefetch_pgs) == ([2], [1])
        assert stats.backup_bandwidth == [pytest.approx(2 * page / 0.5 / 2**30)]
        assert stats.prefetch_bandwidth == [pytest.approx(page / 0.25 / 2**30)]
    finally:
        store.close()


def test_a_batch_records_each_pages_depth_in_its_chain_from_sglangs_prefix_keys(sglang, shm_dir, pools):
    """SGLang's ``prefix_keys`` (the chain's keys before this batch) make the batch's first page
    that deep, and each next one deeper - what eviction reads to drop chains' tails first; with
    none, the batch starts at depth 0."""
    from sglang.srt.mem_cache.hicache_storage import HiCacheStorageExtraInfo

    from hicache.plan._store import DEPTH
    from hicache.store._keys import slot_keys

    store = _store(shm_dir / "arena", pools[0])
    try:
        info = HiCacheStorageExtraInfo(prefix_keys=["p0", "p1", "p2"])
        assert store.batch_set_v1(["a", "b"], torch.arange(0, 2 * PAGE), info) == [True, True]
        assert store.batch_set_v1(["c"], torch.arange(0, PAGE), HiCacheStorageExtraInfo()) == [True]
        namespace, index = store.pools["kv"].namespace, store.store.index
        found, _ = index.find(slot_keys(namespace.digest, ["a", "b", "c"]))
        assert [store.store.arena.records.record(slot)[DEPTH] for slot in found] == [3, 4, 0]
    finally:
        store.close()


def test_an_arena_of_smaller_slots_is_refused_whether_or_not_a_size_is_given(sglang, shm_dir, pools):
    """An arena made with slots smaller than this engine's pages: the attach is refused naming
    both sizes, whether the engine only attaches (no ``size_gb``) or would have created it - and
    the arena is left as it was."""
    from hicache.errors import ArenaGeometryError
    from hicache.store import open_store

    path = shm_dir / "arena"
    open_store(str(path), size_bytes=int(GB * 1e9), slot_bytes=1024).close()
    before = path.read_bytes()[:4096]
    for size_gb in (None, GB):
        with pytest.raises(ArenaGeometryError, match="slots hold 1024 bytes, a page of this engine is"):
            _store(path, pools[0], extra={"size_gb": size_gb})
    assert path.read_bytes()[:4096] == before


def test_a_pool_whose_pages_exactly_fill_the_slots_is_taken_after_the_attach(sglang, shm_dir, pools):
    """A sidecar registered after the attach whose pages are exactly the slots' size fits (one
    byte more would not): it stores and loads its pages."""
    from sglang.srt.mem_cache.hicache_storage import PoolName, PoolTransfer

    kv, swa, _ = pools
    store = _store(shm_dir / "arena", kv)
    try:
        assert store.store.arena.plan.slot_bytes == store.pools["kv"].page_bytes
        store.register_mem_host_pool_v2(swa, PoolName.SWA)
        assert store.pools["swa"].page_bytes == store.store.arena.plan.slot_bytes
        put = [PoolTransfer(name=PoolName.SWA, host_indices=torch.arange(0, PAGE), keys=["s"])]
        assert store.batch_set_v2(put) == {PoolName.SWA: [True]}
    finally:
        store.close()


def test_zero_copy_is_off_unless_asked_and_sidecars_always_take_it(sglang, shm_dir, pools):
    """Without ``interface_v1`` SGLang calls the legacy flat-page API, and the store's KV pages
    go flat (docs/store.md); a sidecar pool has no legacy calls and moves its segments either way."""
    from sglang.srt.mem_cache.hicache_storage import PoolName

    store = _store(shm_dir / "arena", pools[0], sidecars=[(PoolName.SWA, pools[1])], extra={"interface_v1": None})
    try:
        assert not store.zero_copy and not store.pools["kv"].zero_copy and store.pools["swa"].zero_copy
        assert store.batch_set([], []) is True  # HiCacheFile's answer for no keys
    finally:
        store.close()


def test_clear_and_close_before_the_attach_and_clear_after_close_do_nothing(sglang, shm_dir):
    """An engine torn down before its pools registered: ``get_stats`` counts nothing, ``clear``
    and ``close`` (twice) neither raise nor make an arena; a ``clear`` after ``close`` is no
    error either."""
    from sglang.srt.mem_cache.storage.backend_factory import StorageBackendFactory

    store = StorageBackendFactory.create_backend("dynamic", _config(_extra(shm_dir / "arena")), None)
    stats = store.get_stats()
    assert {k: stats[k] for k in ("pages", "bytes", "hits", "misses", "torn", "corrupt", "evictions", "writes")} == \
        dict.fromkeys(("pages", "bytes", "hits", "misses", "torn", "corrupt", "evictions", "writes"), 0)
    store.clear()
    store.close()
    store.close()
    store.clear()
    assert os.listdir(shm_dir) == [] and store.store is None


def test_a_bad_v2_transfer_is_logged_naming_the_call_and_fails_only_its_own_pages(sglang, shm_dir, pools, caplog):
    """A v2 transfer whose host indices do not cover its keys: an error in SGLang's log naming
    the call (as HiCacheFile logs its failures), all False for its pages, and the next transfer
    of the same call still served."""
    from sglang.srt.mem_cache.hicache_storage import PoolName, PoolTransfer

    kv, swa, _ = pools
    store = _store(shm_dir / "arena", kv, sidecars=[(PoolName.SWA, swa)])
    try:
        transfers = [PoolTransfer(name=PoolName.SWA, host_indices=torch.arange(0, PAGE), keys=["a", "b"]),
                     PoolTransfer(name=PoolName.KV, host_indices=torch.arange(0, PAGE), keys=["k"])]
        with caplog.at_level(logging.ERROR, logger="hicache.compat.sglang_store"):
            assert store.batch_set_v2(transfers) == {PoolName.SWA: [False, False], PoolName.KV: [True]}
        said = [r.getMessage() for r in caplog.records if r.levelno == logging.ERROR]
        assert len(said) == 1 and said[0].startswith("HiCacheNodeStore batch_set_v2: ")
    finally:
        store.close()


@pytest.mark.parametrize("swa_held, mamba_held, trailing, policy", [
    ({0, 2, 3, 5}, {0, 1, 2, 4}, 1, "ALL_PAGES"),
    ({1, 2, 4, 5}, {0, 1, 2, 3, 4, 5}, 2, "TRAILING_PAGES"),
    ({0}, {1, 2}, 1, "ALL_PAGES"),
    ({5}, {0}, 3, "TRAILING_PAGES"),
])
def test_batch_exists_v2_answers_as_hicache_file_at_the_edges(sglang, shm_dir, pools, swa_held, mamba_held,
                                                              trailing, policy):
    """Chosen holes (only the first page, only the last, gaps one page apart) under a trailing
    window of 1-3 pages and either policy for the second pool: the same kv hit, per-pool hits and
    restorable prefixes as SGLang's HiCacheFile - the random comparison rarely lands on these."""
    from sglang.srt.mem_cache.hicache_storage import PoolHitPolicy, PoolName, PoolTransfer

    kv, swa, mamba = pools
    sidecars = [(PoolName.SWA, swa), (PoolName.MAMBA, mamba)]
    ours, theirs = _store(shm_dir / "arena", kv, sidecars=sidecars), _file_backend(shm_dir / "file", kv, sidecars)
    keys = [f"e{i}" for i in range(6)]
    try:
        assert all(ours.batch_set_v1(keys, torch.arange(0, 6 * PAGE)))
        for i, key in enumerate(keys):
            assert theirs.set(key, kv.get_data_page(i * PAGE, flat=True))
        for name, held in ((PoolName.SWA, swa_held), (PoolName.MAMBA, mamba_held)):
            chosen = sorted(held)
            put = [PoolTransfer(name=name, host_indices=torch.cat([torch.arange(i * PAGE, (i + 1) * PAGE)
                                                                   for i in chosen]), keys=[keys[i] for i in chosen])]
            assert ours.batch_set_v2(put) == theirs.batch_set_v2(put)
        queries = ([PoolTransfer(name=PoolName.SWA, keys=keys[-trailing:], hit_policy=PoolHitPolicy.TRAILING_PAGES)],
                   [PoolTransfer(name=PoolName.MAMBA, keys=keys[-trailing:], hit_policy=PoolHitPolicy[policy])],
                   [PoolTransfer(name=PoolName.SWA, keys=keys[-trailing:], hit_policy=PoolHitPolicy.TRAILING_PAGES),
                    PoolTransfer(name=PoolName.MAMBA, keys=keys[-trailing:], hit_policy=PoolHitPolicy[policy])])
        for transfers in queries:
            a, b = ours.batch_exists_v2(keys, transfers), theirs.batch_exists_v2(keys, transfers)
            assert (a.kv_hit_pages, a.extra_pool_hit_pages, a.restorable_prefix_pages) == \
                   (b.kv_hit_pages, b.extra_pool_hit_pages, b.restorable_prefix_pages), transfers
    finally:
        ours.close()
