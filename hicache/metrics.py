"""Prometheus metrics of host-pool bring-ups (issue #21): what a server's `/metrics` shows about
hicache's pools - bytes by the tier the kernel gave, registration, calls, phase seconds, rates,
pages ready, this host's budget claims. Names and labels: docs/metrics.md.

Optional: with `prometheus_client` installed (``pip install "hicache[metrics]"``) a collector in
its default registry (a server's existing `/metrics` endpoint shows it) reports every pool this
process brought up; without it every function here does nothing. Values are read from the
pools' bring-up handles when scraped - a pool's constructor only adds an entry, so tracking
costs a bring-up nothing, and a progressive pool's pages and registered bytes move as it
registers. Each value is re-derivable from the pool's plan dump and its handle's report: this
module copies them, it measures nothing.

Under prometheus_client's multiprocess mode (``PROMETHEUS_MULTIPROC_DIR``: SGLang serves
`/metrics` from its HTTP process, the pools live in its schedulers) the same families are also
written to this process's value files (`hicache._metrics_publish`), one series per process.
The plug-in's seam mode - SGLang's own pool classes allocating through hicache - is tracked
too (`track_registration`): every bring-up in a server is visible.
"""

from __future__ import annotations

import logging
import threading
import weakref

import attrs

logger = logging.getLogger(__name__)

from hicache._metrics_rows import (
    POOL_METRICS,
    STORE_METRICS,
    TIERS_FAMILY,
    PoolScrape,
    PoolView,
    StoreView,
    families,
)


class _Entry:
    """One tracked bring-up: its handle (weakly: tracking keeps no memory alive) and readers."""

    def __init__(self, handle, numa_node, page_num, ready_pages, phases) -> None:
        self.handle = weakref.ref(handle)
        self.numa_node = "none" if numa_node is None else str(numa_node)
        self.page_num = page_num
        self.ready_pages = _weakly(ready_pages) if ready_pages is not None else None
        self.phases = dict(phases or {})
        self.released = False
        self.kept_tiers = None  # the page tiers once every byte is registered: pinned pages keep their backing


class _State:
    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.entries: dict[str, _Entry] = {}
        self.calls: dict[tuple[str, str], int] = {}  # (pool, result) -> calls of bring-ups no longer tracked
        self.last_rates = (0.0, 0.0)  # (pre-fault, register) bytes/s of the last bring-up
        self.last_pool: str | None = None  # its name: a scrape reads its rates again while it is tracked
        self.registered: set = set()  # ids of the registries the collector is in
        self.turnstile_waits = None  # the handles' reader of this process's turnstile waits
        self.stores: dict[str, tuple] = {}  # arena path -> (this process's NodeStore over it, its census's source)


_STATE = _State()


def available() -> bool:
    """Whether `prometheus_client` is importable (``hicache[metrics]``)."""
    try:
        import prometheus_client  # noqa: F401
    except ImportError:
        return False
    return True


def _weakly(read):
    """``read`` as a scrape callback that keeps no pool alive: a bound method is held weakly
    (0 once its pool is gone)."""
    if not hasattr(read, "__self__"):
        return read
    method = weakref.WeakMethod(read)

    def value():
        bound = method()
        return bound() if bound is not None else 0

    return value


def install(registry=None) -> bool:
    """Put the collector in ``registry`` (default: prometheus_client's) once; False without
    prometheus_client. Pools call it; a server's `/metrics` then shows hicache's families."""
    try:
        import prometheus_client
    except ImportError:
        return False
    registry = prometheus_client.REGISTRY if registry is None else registry
    with _STATE.lock:
        if id(registry) in _STATE.registered:
            return True
        _STATE.registered.add(id(registry))
    registry.register(_Collector())
    return True


def _rates(record) -> tuple[float, float]:
    """(pre-fault, register) bytes/s of a bring-up's record: as of now for a progressive one
    (its background pre-fault and calls go on after it returned), so each scrape asks again."""
    prefault, register_s = record.prefault_s, record.register_s
    registered = record.registered_bytes if register_s else 0
    return (record.total_bytes / prefault if prefault else 0.0, registered / register_s if register_s else 0.0)


def track(pool: str, handle, *, numa_node=None, page_num=None, ready_pages=None, phases=None) -> None:
    """Report ``handle`` (a `HostPools`) as pool ``pool`` from now on: ``page_num`` its pages,
    ``ready_pages`` a callable giving those ready now (held weakly), ``phases`` seconds of
    phases the handle does not time itself (``plan``). A second bring-up under the same name
    replaces the first (its calls stay counted)."""
    try:
        if not install():
            return
        entry = _Entry(handle, numa_node, page_num, ready_pages, phases)
        rates = _rates(handle.record(tiers=False))
    except Exception:  # metrics never fail a bring-up (an interrupt still propagates)
        logger.exception("hicache metrics: could not track %s", pool)
        return
    with _STATE.lock:
        _retire(pool)
        _STATE.entries[pool] = entry
        _STATE.last_rates, _STATE.last_pool = rates, pool
        _STATE.turnstile_waits = getattr(type(handle), "turnstile_waits", None) or _STATE.turnstile_waits
    _published()


class _Detached:
    """What the collector reads of a bring-up whose registration its handle handed on (the
    plug-in's seam mode: SGLang's own pool owns the tensor and releases it): the registration
    itself, the handle's timings and the page tiers - a list as obtained, or a reader
    ``tiers(smaps_text)`` called at each scrape while the registration is active (the seam's:
    a bring-up reads no smaps)."""

    mode = "blocking"

    def __init__(self, registration, *, timings, allocator, total_bytes: int, tiers) -> None:
        self.registration = registration
        self.timings, self.allocator, self.total_bytes = dict(timings), allocator, total_bytes
        self._tiers = tiers if callable(tiers) or tiers is None else list(tiers)

    @property
    def state(self) -> str:
        return "released" if self.registration is None else self.registration.status().state

    @property
    def calls(self) -> list:
        return [] if self.registration is None else list(self.registration.status().ranges)

    def registered_ranges(self):
        if self.registration is None or self.registration.status().state != "active":
            return ()
        return tuple((r.ptr, r.size) for r in self.registration.status().ranges)

    def tiers(self, smaps_text=None) -> list:
        if callable(self._tiers):  # read now; memory no longer registered may be someone else's
            return self._tiers(smaps_text) if self.state == "active" else []
        return self._tiers or []

    def budget_claims(self) -> dict:
        return {}  # SGLang's admission took the budget (hicache.effects.admission), not this buffer

    def record(self, *, tiers: bool = True, smaps_text=None):
        """This registration as the `BringupRecord` every bring-up gives (`HostPools.record`)."""
        from hicache._bringup_record import make_record

        return make_record(state=self.state, total_bytes=self.total_bytes,
                           registered_bytes=sum(size for _, size in self.registered_ranges()), calls=self.calls,
                           timings=self.timings, allocator=self.allocator,
                           tiers=self.tiers(smaps_text) if tiers else ())


def track_registration(pool: str, registration, *, timings=None, allocator=None, total_bytes: int = 0,
                       tiers=None, page_num=None) -> object | None:
    """Report a registration made for a tensor someone else owns (`hicache.compat.sglang`: the
    plug-in's seam mode) as pool ``pool``: registered bytes and calls from ``registration``,
    phase seconds from ``timings``, ``tiers`` as obtained (a list, or a reader ``tiers(smaps_text)``
    of them now, called at each scrape). Returns the tracked object (keep it
    while the tensor lives: the entry holds it weakly); None when metrics are off."""
    try:
        if not available():
            return None
        detached = _Detached(registration, timings=timings or {}, allocator=allocator, total_bytes=total_bytes,
                             tiers=tiers)
    except Exception:  # metrics never fail a bring-up
        logger.exception("hicache metrics: could not track %s", pool)
        return None
    track(pool, detached, page_num=page_num, ready_pages=(lambda: page_num or 0) if page_num else None)
    return detached


def _retire(pool: str) -> None:
    """Move a replaced or released entry's calls into the running tally (under the lock)."""
    entry = _STATE.entries.pop(pool, None)
    handle = entry.handle() if entry is not None else None
    if handle is not None:
        key = (pool, "ok")
        _STATE.calls[key] = _STATE.calls.get(key, 0) + len(handle.calls)


def failed(pool: str) -> None:
    """A bring-up of ``pool`` that failed and was rolled back."""
    if not install():
        return
    with _STATE.lock:
        key = (pool, "failed")
        _STATE.calls[key] = _STATE.calls.get(key, 0) + 1
    _published()


def released(pool: str, handle=None) -> None:
    """``pool`` gave its memory back: it reports nothing held from now on (its calls stay).
    ``handle``: only if it is the one tracked under that name (a later bring-up of the same
    name replaced it otherwise, and stays reported)."""
    with _STATE.lock:
        entry = _STATE.entries.get(pool)
        if entry is not None and handle is not None and entry.handle() is not handle:
            return
        if entry is not None and not entry.released:
            _retire(pool)
            entry.released = True
            _STATE.entries[pool] = entry
    _published()


def track_store(arena: str, store, *, census=None) -> None:
    """Report ``store`` (a `hicache.store.NodeStore`, held weakly) as the node store over the
    arena at ``arena`` from now on; its families read the arena and the store when scraped.
    ``census``: where a scrape gets the arena's census (a callable returning a `Census`, or None
    to skip the store this time; a bound method is held weakly) - the SGLang L3 seam's, which
    `get_stats` shares; default: the store's own `census()`, read at each scrape."""
    try:
        if not install():
            return
        read = weakref.WeakMethod(census) if hasattr(census, "__self__") else (lambda: census)
        with _STATE.lock:
            _STATE.stores[arena] = (weakref.ref(store), read)
    except Exception:  # metrics never fail the work they observe
        logger.exception("hicache metrics: could not track the store at %s", arena)
    _published()


def untrack_store(arena: str) -> None:
    with _STATE.lock:
        _STATE.stores.pop(arena, None)
    _published()


def _published() -> None:
    """Under prometheus multiprocess mode: this process's values written now, and every few
    seconds from then on (`hicache._metrics_publish`); otherwise nothing. Written here without
    the page tiers - this runs inside the bring-up that was tracked, and reading
    /proc/self/smaps walks every page table of the process (53-60 ms with SGLang loaded) - and
    at once again by the publisher's thread, tiers included."""
    try:
        from hicache import _metrics_publish as mp

        if mp.active():
            mp.publish(mp.PUBLISHER, _Collector(tiers=False).collect)
            mp.PUBLISHER.start(_Collector().collect)
            mp.PUBLISHER.wake()
    except Exception:  # a diagnostic never fails the work it observes
        logger.exception("hicache metrics: could not publish")



def _store_views() -> list:
    """Every live node store of this process with its census, read once for the scrape."""
    with _STATE.lock:
        stores = list(_STATE.stores.items())
    views = []
    for arena, (ref, read) in stores:
        store, census = ref(), read()
        if store is None or store.closed:
            continue
        try:
            taken = census() if census is not None else store.census()
        except Exception:  # a store closing under the scrape: skip it this time
            continue
        if taken is not None:
            views.append(StoreView(arena, store, taken))
    return views


def _pool_scrape(*, tiers: bool = True) -> PoolScrape:
    """Every tracked bring-up read once: its frozen record (one smaps read for all of them;
    none and no tiers with ``tiers=False``), the calls tallied, the budget claims, the last
    rates, the turnstile's waits."""
    with _STATE.lock:
        entries = list(_STATE.entries.items())
        tally = dict(_STATE.calls)
        rates, last_pool = _STATE.last_rates, _STATE.last_pool
        read_waits = _STATE.turnstile_waits
    claims: dict = {}
    smaps = None
    views = []
    for pool, entry in entries:
        handle = entry.handle()
        alive = handle is not None and not entry.released and handle.state != "released"
        read = tiers and entry.kept_tiers is None  # smaps walks every page table: kept tiers are not read again
        if read and alive and smaps is None and hasattr(handle, "read_smaps"):
            smaps = handle.read_smaps()  # once per scrape, however many pools (it grows with the mappings)
        record = handle.record(tiers=read, smaps_text=smaps) if alive else None  # the bring-up's own frozen record
        if record and tiers:
            if entry.kept_tiers is not None:
                record = attrs.evolve(record, tiers=entry.kept_tiers)
            elif record.total_bytes and record.registered_bytes == record.total_bytes and record.tiers:
                entry.kept_tiers = record.tiers  # all pinned now: the kernel moves none of these pages
        if record:
            key = (pool, "ok")
            tally[key] = tally.get(key, 0) + record.calls
            claims.update(dict(record.claims))
            if pool == last_pool:  # the last bring-up's rates as of this scrape (progressive: still moving)
                rates = _rates(record)
                with _STATE.lock:
                    _STATE.last_rates = rates  # kept once it is released
        views.append(PoolView(pool, entry, record))
    waits = read_waits() if read_waits is not None else {"buckets": [(float("inf"), 0)], "sum": 0.0}
    return PoolScrape(tuple(views), tally, claims, rates, waits)


class _Collector:
    """Reads every tracked bring-up and store once when the registry is scraped, then makes each
    family from its row of the table (`hicache._metrics_rows`); ``tiers=False``: without the
    page tiers' family (no smaps read)."""

    def __init__(self, *, tiers: bool = True) -> None:
        self.tiers = tiers

    def describe(self):
        return []  # families are made at collect time (prometheus_client then skips the dry run)

    def collect(self):
        rows = POOL_METRICS if self.tiers else [row for row in POOL_METRICS if row.name != TIERS_FAMILY]
        yield from families(rows, _pool_scrape(tiers=self.tiers))
        yield from families(STORE_METRICS, _store_views())


def serve(port: int, *, addr: str = "127.0.0.1", registry=None):
    """Serve the registry over HTTP on ``addr:port`` (``/metrics``) in a daemon thread; returns
    ``(server, thread)`` (``server.shutdown()`` stops it). Needs ``hicache[metrics]``."""
    from prometheus_client import REGISTRY, start_http_server

    install(registry)
    return start_http_server(port, addr=addr, registry=REGISTRY if registry is None else registry)
