"""`HiCacheNodeStore`: hicache's node store as SGLang 0.5.23's L3 back end, through its public
dynamic seam (`--hicache-storage-backend dynamic`, docs/store.md) - no patching.

SGLang's factory constructs it as ``cls(storage_config, {})`` (`storage/backend_factory.py`);
the arena comes from ``storage_config.extra_config`` (`CONFIG_KEYS`, checked by
`_store_config` before any memory is taken). Pools arrive through `register_mem_pool_host` /
`register_mem_host_pool_v2`; `on_host_pools_registered` sizes each pool's page, opens (or
creates) the arena and checks its geometry - raising there fails SGLang's attach cleanly. Pages
move zero-copy between the pool's `get_page_buffer_meta` segments and the arena (every segment
bounds-checked against the pool's own buffers first); pools without those segments, and SGLang's
legacy calls, go through its flat data pages. Only this module knows SGLang; the store itself is
`hicache.store`.
"""

from __future__ import annotations

import collections
import logging
import time

from sglang.srt.mem_cache.hicache_storage import (
    HiCacheStorage,
    PoolHitPolicy,
    PoolName,
    PoolTransferResult,
)

from hicache.compat._census_refresh import LatestCensus
from hicache.compat._store_config import CONFIG_KEYS, check_config  # noqa: F401 - CONFIG_KEYS: docs/store.md's table
from hicache.compat._store_views import PoolView as _PoolView
from hicache.compat._store_views import flat_segments as _flat_segments
from hicache.errors import ArenaError, NamespaceTableFullError, StoreClosedError, TransferError
from hicache.plan.store_format import fitted_label
from hicache.store import Namespace, open_store, shard_of

logger = logging.getLogger(__name__)

GB = 10**9
#: how old `get_stats`' census of the arena may be before one is retaken (beside the caller:
#: SGLang asks on every scheduler step when --enable-metrics is on, and a census reads every slot)
CENSUS_MAX_AGE_S = 10.0
#: each transfer's pages and bandwidth kept for SGLang's storage metrics until `get_stats` drains
#: them (every scheduler step where they are on): the latest this many, should nothing drain them
KEPT_TRANSFERS = 4096
#: a full namespace table fails every backup batch: said once, then at most this often
FULL_TABLE_LOG_EVERY_S = 60.0


def _make_stats():
    """The stats object: a dict (pages, bytes, hits, ...) that is also SGLang's StorageMetrics
    (its metrics collector asserts that type), so `--enable-storage-metrics` works too."""
    try:
        from sglang.srt.observability.metrics_collector import StorageMetrics
    except ImportError:  # pragma: no cover - every 0.5.23 wheel has it
        return dict()

    class NodeStoreStats(StorageMetrics, dict):
        __hash__ = None

    return NodeStoreStats()


class _LoggedProgress:
    """A creating engine's pre-fault progress in SGLang's log: a line every 5 s and at the end
    (a TB arena pre-faults for minutes: still working, not hung)."""

    def __init__(self, every_s: float = 5.0, clock=time.monotonic) -> None:
        self.every_s, self.clock = every_s, clock
        self.start = self.last = clock()

    def __call__(self, done: int, total: int) -> None:
        from hicache.plan import format_progress

        now = self.clock()
        if now - self.last >= self.every_s or done >= total:
            self.last = now
            logger.info("HiCacheNodeStore: creating the arena: %s", format_progress("pre-faulted", done, total,
                                                                                     now - self.start))


class HiCacheNodeStore(HiCacheStorage):
    """SGLang's `HiCacheStorage` over hicache's node-shared arena (docs/store.md)."""

    def __init__(self, storage_config, kwargs=None) -> None:
        self.storage_config = storage_config
        self.extra = check_config(dict(getattr(storage_config, "extra_config", None) or {}))
        self.path = self.extra["arena"]
        from hicache.effects import arena as _arena

        _arena.backing_of(self.path)  # a disk path or a missing directory fails here, before any pool exists
        self.zero_copy = bool(self.extra.get("interface_v1", 0))
        self.store = None
        self.pools: dict[str, _PoolView] = {}
        self.registered_pools = {}
        self.mem_pool_host = None
        # SGLang drains these through get_stats only under --enable-metrics (as its Mooncake store, kept only then)
        self._metrics = bool(getattr(storage_config, "enable_storage_metrics", False))
        self._pending = {name: collections.deque(maxlen=KEPT_TRANSFERS)
                         for name in ("prefetch_pgs", "prefetch_bandwidth", "backup_pgs", "backup_bandwidth")}
        self._closed = False
        self.attach_s = None
        self.clock = time.monotonic  # the census's age, the full-table log's pace (tests put a stand-in here)
        self.stopwatch = time.perf_counter  # each transfer's time, for SGLang's bandwidth metric (tests put a stand-in here)
        self.census_refresh = None  # the census get_stats and the metrics read (LatestCensus), once attached
        self._full_said = None  # when a full namespace table was last logged
        self._full_batches = 0  # batches it refused since

    # -- registration ----------------------------------------------------------------------------
    def register_mem_host_pool_v2(self, host_pool, host_pool_name) -> None:
        super().register_mem_host_pool_v2(host_pool, host_pool_name)
        if self.store is not None:  # a sidecar registered after the attach (SGLang allows it)
            self._add_pool(str(getattr(host_pool_name, "value", host_pool_name)), host_pool)

    def _namespace(self, view: _PoolView) -> Namespace:
        config = self.storage_config
        pool = view.pool
        model = config.model_name or ""
        tag = getattr(pool, "storage_format_tag", None)
        shard = shard_of(is_mla=bool(config.is_mla_model), pool=view.name, tp_rank=config.tp_rank,
                         tp_size=config.tp_size, pp_rank=config.pp_rank, pp_size=config.pp_size,
                         cp_rank=config.attn_cp_rank, cp_size=config.attn_cp_size,
                         dcp_rank=getattr(config, "dcp_rank", 0), dcp_size=getattr(config, "dcp_size", 1))
        layout = f"{getattr(pool, 'layout', '-')}/{'segments' if view.zero_copy else 'flat'}" + (f"/{tag}" if tag else "")
        return Namespace(model=model, dtype=str(getattr(pool, "dtype", "-")), page_tokens=view.page_size,
                         layout=layout, pool=view.name, page_bytes=view.page_bytes, shard=shard)

    def _add_pool(self, name: str, pool) -> _PoolView:
        zero_copy = self.zero_copy if name == PoolName.KV.value else True
        view = _PoolView(name, pool, zero_copy=zero_copy, namespace_of=self._namespace)
        if self.store is not None and view.page_bytes > self.store.arena.plan.slot_bytes:
            raise ArenaError(f"HiCacheNodeStore: pool {name!r} pages of {view.page_bytes} bytes do not fit the arena's "
                             f"{self.store.arena.plan.slot_bytes}-byte slots ({self.path})")
        self.pools[name] = view
        return view

    def on_host_pools_registered(self) -> None:
        """Open the arena for the pools registered so far (creating it when asked and missing);
        raises - failing SGLang's attach, nothing left open - on a geometry that does not fit."""
        if self.store is not None:
            return
        views = []
        if self.mem_pool_host is not None:
            views.append(self._add_pool(PoolName.KV.value, self.mem_pool_host))
        for name, pool in getattr(self, "registered_pools", {}).items():
            name = str(getattr(name, "value", name))
            if name not in self.pools:
                views.append(self._add_pool(name, pool))
        if not views:
            raise ArenaError("HiCacheNodeStore: no host pool was registered before on_host_pools_registered()")
        largest = max(view.page_bytes for view in views)
        size_gb = self.extra.get("size_gb")
        slot_bytes = self.extra.get("slot_bytes") or largest
        if slot_bytes < largest:
            raise ArenaError(f"HiCacheNodeStore extra_config: 'slot_bytes' {slot_bytes} is below this engine's largest "
                             f"page of {largest} bytes")
        began = time.perf_counter()
        label = self.extra.get("label") or fitted_label(self.storage_config.model_name or "")
        self.store = open_store(self.path, size_bytes=None if size_gb is None else int(size_gb * GB),
                                slot_bytes=slot_bytes, label=label, threads=self.extra.get("prefault_threads"),
                                progress=_LoggedProgress())  # an arena of smaller slots: refused in there
        self.attach_s = time.perf_counter() - began
        from hicache import metrics

        self.census_refresh = LatestCensus(lambda: self.store.census(), max_age_s=CENSUS_MAX_AGE_S,
                                           clock=lambda: self.clock())
        metrics.track_store(self.path, self.store, census=self._recent_census)  # one census for both
        logger.info("HiCacheNodeStore: %s arena %s (%d slots of %d bytes) in %.3f s", "created" if
                    self.store.arena.created else "attached", self.path, self.store.arena.plan.slots,
                    self.store.arena.plan.slot_bytes, self.attach_s)

    @property
    def attach_resident(self) -> int | None:
        """Bytes of the arena this process has faulted in (its mapping's Rss): right after the
        attach, the header and index pages only - read on demand (/proc/self/smaps is long)."""
        return None if self.store is None else self.store.arena.resident_bytes()

    def _ready(self) -> None:
        if self._closed:
            raise StoreClosedError(f"HiCacheNodeStore {self.path}: closed")
        if self.store is None:  # a caller that never fired on_host_pools_registered
            self.on_host_pools_registered()

    def _view(self, name) -> _PoolView:
        self._ready()
        name = str(getattr(name, "value", name))
        if name not in self.pools:
            pool = self.registered_pools.get(name) if hasattr(self, "registered_pools") else None
            if pool is None:
                raise TransferError(f"HiCacheNodeStore: no host pool named {name!r} was registered")
            self._add_pool(name, pool)
        return self.pools[name]

    # -- existence -------------------------------------------------------------------------------
    def batch_exists(self, keys, extra_info=None) -> int:
        view = self._view(PoolName.KV.value)
        return self.store.exists(view.namespace, list(keys))

    def exists(self, key) -> bool:
        return self.batch_exists([key]) == 1

    def batch_exists_v2(self, keys, pool_transfers=None, extra_info=None) -> PoolTransferResult:
        """As SGLang's HiCacheFile answers it: the longest KV prefix held, then each pool's
        policy (ALL_PAGES, TRAILING_PAGES) narrowing the restorable prefix lengths; any other
        policy is a ValueError, as there."""
        keys = list(keys)
        kv_present = self.store_present(PoolName.KV.value, keys)
        kv_pages = next((i for i, held in enumerate(kv_present) if not held), len(keys))
        hit_count = {PoolName.KV: kv_pages} if kv_pages else {}
        restorable = list(range(1, kv_pages + 1))
        for transfer in pool_transfers or []:
            if not restorable:
                break
            name = transfer.name
            present = self.store_present(name, keys[:kv_pages])
            if transfer.hit_policy == PoolHitPolicy.ALL_PAGES:
                boundary = next((i for i in range(kv_pages) if not present[i]), kv_pages)
                pool_restorable = set(range(1, boundary + 1))
            elif transfer.hit_policy == PoolHitPolicy.TRAILING_PAGES:
                trailing = max(1, len(transfer.keys) if transfer.keys else 1)
                pool_restorable = {n for n in range(1, kv_pages + 1)
                                   if all(present[i] for i in range(max(0, n - trailing), n))}
                boundary = max(pool_restorable, default=0)
            else:
                raise ValueError(f"Unsupported pool hit policy: {transfer.hit_policy}")
            if boundary:
                hit_count[name] = boundary
            restorable = [p for p in restorable if p in pool_restorable]
        return PoolTransferResult(restorable[-1] if restorable else 0, hit_count, restorable)

    def store_present(self, name, keys) -> list[bool]:
        view = self._view(name)
        return self.store.present(view.namespace, keys) if keys else []

    # -- zero-copy -------------------------------------------------------------------------------
    def _depth(self, extra_info) -> int:
        prefix = getattr(extra_info, "prefix_keys", None)
        return len(prefix) if prefix else 0

    def _transfer(self, view: _PoolView, keys, host_indices, *, write: bool, depth: int) -> list[bool]:
        keys = list(keys)
        if not keys:
            return []
        starts = view.starts(host_indices, len(keys))
        began = self.stopwatch()
        if view.zero_copy:  # the caller's indices, checked by starts(): no rebuilt index tensor
            pages = view.segments(starts, host_indices.reshape(-1))
            ok = (self._put(view, keys, pages, depth) if write else self.store.get(view.namespace, keys, pages))
        else:  # SGLang's flat data pages: one staging copy each way
            if write:
                flats = [_flat_segments(view.flat_page(s)) for s in starts]
                ok = self._put(view, keys, [seg for seg, _ in flats], depth)
            else:
                flats = [_flat_segments(view.staging_page()) for _ in starts]
                ok = [hit and view.set_flat_page(start, tensor) for start, hit, (_, tensor)
                      in zip(starts, self.store.get(view.namespace, keys, [seg for seg, _ in flats]), flats)]
        if self._metrics:
            seconds = max(self.stopwatch() - began, 1e-9)
            moved = sum(ok)
            kind = "backup" if write else "prefetch"
            self._pending[f"{kind}_pgs"].append(moved)
            self._pending[f"{kind}_bandwidth"].append(moved * view.page_bytes / seconds / 2**30)
        return ok

    def _put(self, view: _PoolView, keys, pages, depth: int) -> list[bool]:
        """Store pages; a full namespace table fails this batch's pages (False, logged once, then
        at most every `FULL_TABLE_LOG_EVERY_S`), as SGLang's backup expects of a store that cannot
        take them - it never crashes the thread."""
        try:
            return self.store.put(view.namespace, keys, pages, first_depth=depth)
        except NamespaceTableFullError as error:
            self._full_batches += 1
            now = self.clock()
            if self._full_said is None or now - self._full_said >= FULL_TABLE_LOG_EVERY_S:
                since = "" if self._full_said is None else f" ({self._full_batches} batches refused since last said)"
                logger.error("HiCacheNodeStore: %s%s", error, since)
                self._full_said, self._full_batches = now, 0
            return [False] * len(keys)

    def batch_get_v1(self, keys, host_indices, extra_info=None) -> list[bool]:
        return self._transfer(self._view(PoolName.KV.value), keys, host_indices, write=False, depth=0)

    def batch_set_v1(self, keys, host_indices, extra_info=None) -> list[bool]:
        return self._transfer(self._view(PoolName.KV.value), keys, host_indices, write=True,
                              depth=self._depth(extra_info))

    def _batch_v2(self, transfers, extra_info, *, write: bool) -> dict:
        results = {}
        for transfer in transfers:
            view = self._view(transfer.name)
            keys = list(transfer.keys or [])
            try:
                results[transfer.name] = self._transfer(view, keys, transfer.host_indices, write=write,
                                                        depth=self._depth(extra_info))
            except TransferError as error:  # as HiCacheFile: a bad transfer fails its pages, not the call
                logger.error("HiCacheNodeStore %s: %s", "batch_set_v2" if write else "batch_get_v2", error)
                results[transfer.name] = [False] * len(keys)
        return results

    def batch_get_v2(self, transfers, extra_info=None) -> dict:
        return self._batch_v2(transfers, extra_info, write=False)

    def batch_set_v2(self, transfers, extra_info=None) -> dict:
        return self._batch_v2(transfers, extra_info, write=True)

    # -- legacy (flat pages) ---------------------------------------------------------------------
    def _flat_view(self) -> _PoolView:
        view = self._view(PoolName.KV.value)
        if view.zero_copy:  # legacy calls move flat pages: their own namespace
            key = PoolName.KV.value + "/flat"
            if key not in self.pools:
                self.pools[key] = _PoolView(PoolName.KV.value, view.pool, zero_copy=False, namespace_of=self._namespace)
            return self.pools[key]
        return view

    def get(self, key, target_location=None, target_sizes=None):
        return self.batch_get([key], [target_location])[0]

    def batch_get(self, keys, target_locations=None, target_sizes=None):
        view = self._flat_view()
        keys = list(keys)
        targets = list(target_locations) if target_locations is not None else [None] * len(keys)
        targets = [t if t is not None else view.staging_page() for t in targets]
        for t in targets:
            if t.nbytes != view.page_bytes or not t.is_contiguous():
                raise TransferError(f"HiCacheNodeStore.batch_get: a target of {t.nbytes} bytes (contiguous: "
                                    f"{t.is_contiguous()}) is not one flat page of {view.page_bytes} bytes")
        ok = self.store.get(view.namespace, keys, [[(t.data_ptr(), t.nbytes)] for t in targets]) if keys else []
        return [t if hit else None for t, hit in zip(targets, ok)]

    def set(self, key, value=None, target_location=None, target_sizes=None) -> bool:
        return self.batch_set([key], [value])

    def batch_set(self, keys, values=None, target_locations=None, target_sizes=None) -> bool:
        view = self._flat_view()
        keys, values = list(keys), list(values or [])
        if len(values) != len(keys):
            raise TransferError(f"HiCacheNodeStore.batch_set: {len(keys)} keys but {len(values)} values")
        flats = [_flat_segments(v) for v in values]
        for (segments, _), key in zip(flats, keys):
            if segments[0][1] != view.page_bytes:
                raise TransferError(f"HiCacheNodeStore.batch_set: value for {key!r} has {segments[0][1]} bytes, a "
                                    f"flat page is {view.page_bytes}")
        return all(self._put(view, keys, [seg for seg, _ in flats], 0)) if keys else True

    # -- the rest --------------------------------------------------------------------------------
    def clear(self) -> None:
        """Empty this engine's pages (its namespaces); other engines' pages in the arena stay."""
        if self.store is not None and not self._closed:
            self.store.clear([view.namespace for view in self.pools.values()])
            if self.census_refresh is not None:
                self.census_refresh.expire()  # the next get_stats starts counting what is left

    def get_stats(self):
        stats = _make_stats()
        for name, values in self._pending.items():
            setattr(stats, name, list(values))
            values.clear()
        census = None if self.store is None else self._recent_census()
        if census is None:  # no arena (yet), or closed (under the census too)
            stats.update(pages=0, bytes=0, hits=0, misses=0, torn=0, corrupt=0, evictions=0, writes=0)
            return stats
        counts = self.store.counts
        stats.update(pages=census.pages, bytes=census.bytes, hits=counts.hits, misses=counts.misses,
                     torn=counts.torn, corrupt=counts.corrupt, evictions=counts.evictions, writes=counts.writes,
                     slots=census.slots, torn_slots=census.torn, arena=self.path,
                     backing=self.store.arena.backing.kind, attach_s=self.store.arena.attach_s,
                     reclaimed=self.store.reclaimed)
        return stats

    def _recent_census(self):
        """The arena's census (get_stats' and the metrics scrape's), retaken beside the caller
        once `CENSUS_MAX_AGE_S` have passed; None once closed."""
        return None if self._closed or self.census_refresh is None else self.census_refresh.get()

    def close(self) -> None:
        """Unmap the arena once the transfers in flight on SGLang's other threads are done;
        idempotent. Later calls raise `StoreClosedError` (a RuntimeError), never touch unmapped
        memory: the closed store stays in place, so a thread past `_ready` meets its error.
        The arena's pages stay for the next engine."""
        self._closed = True
        if self.store is not None and not self.store.closed:
            from hicache import metrics

            metrics.untrack_store(self.path)
            self.store.close()
