"""The metrics as one table (issue #34 item 7): one `Metric` row per family - name, type, help,
labels, and how its samples are read from one scrape - for the host pools (`POOL_METRICS`) and
the node store (`STORE_METRICS`). `hicache.metrics`' collector reads a scrape once and makes every
family from its row; docs/metrics.md names exactly these rows (a test keeps them equal). A new
metric is a row here, nowhere else. Needs prometheus_client only when families are made.
"""

from __future__ import annotations

from typing import Callable, Iterable, NamedTuple

GAUGE, COUNTER, HISTOGRAM = "gauge", "counter", "histogram"
PHASES = ("plan", "map", "prefault", "register", "ready")
TIERS = ("hugetlb", "thp", "4k")


class Metric(NamedTuple):
    """One family: ``samples(scrape)`` gives ``(label values, value)`` pairs (a histogram's
    value: ``(buckets, sum)``)."""

    name: str
    kind: str
    help: str
    labels: tuple
    samples: Callable[[object], Iterable[tuple[tuple, object]]]


class PoolView(NamedTuple):
    """One tracked bring-up at a scrape: its label, entry and frozen record (None: released)."""

    pool: str
    entry: object
    record: object


class PoolScrape(NamedTuple):
    """What one scrape read of the pools, once: each bring-up, the calls tallied (retired ones
    included), this host's budget claims, the last rates and the turnstile's waits."""

    pools: tuple
    calls: dict
    claims: dict
    rates: tuple
    waits: dict


def _tiers(view: PoolView):
    tiers = dict.fromkeys(TIERS, 0)
    for _, tier in view.record.tiers if view.record else ():  # as obtained: the kernel's numbers
        tiers["hugetlb"] += tier.hugetlb
        tiers["thp"] += tier.thp
        tiers["4k"] += tier.base
    return [((view.pool, view.entry.numa_node, tier), nbytes) for tier, nbytes in tiers.items()]


def _phases(view: PoolView):
    if view.record is None:
        return []
    record = view.record
    phase = {"map": record.map_s, "prefault": record.prefault_s, "register": record.register_s,
             "ready": record.ready_s, **view.entry.phases}
    return [((view.pool, name), float(phase[name])) for name in PHASES if phase.get(name) is not None]


def _each(read):
    """A per-pool reader over every bring-up of the scrape."""
    return lambda scrape: [sample for view in scrape.pools for sample in read(view)]


#: the family of page tiers: the one whose values need a read of /proc/self/smaps
TIERS_FAMILY = "hicache_host_pool_bytes"

POOL_METRICS = (
    Metric(TIERS_FAMILY, GAUGE, "Host pool bytes by the page tier the kernel backs them with "
           "(/proc/self/smaps)", ("pool", "numa_node", "tier"), _each(_tiers)),
    Metric("hicache_page_size_rule_bytes", GAUGE, "Bytes of each buffer whose pre-fault page size each "
           "hugepages=auto rule decided (free, no-free-blocks, brake, ...)", ("pool", "buffer", "rule"),
           _each(lambda v: [((v.pool, buffer, rule), nbytes) for buffer, rule, nbytes in v.record.page_rules]
                 if v.record else [])),
    Metric("hicache_registered_bytes", GAUGE, "Bytes registered with CUDA now", ("pool",),
           _each(lambda v: [((v.pool,), v.record.registered_bytes if v.record else 0)])),
    Metric("hicache_registration_calls", COUNTER, "cudaHostRegister calls of bring-ups, by result",
           ("pool", "result"), lambda s: [(key, count) for key, count in sorted(s.calls.items())]),
    Metric("hicache_bringup_seconds", GAUGE, "Seconds of each bring-up phase (ready: the bring-up's start to a "
           "usable pool, budget wait included)", ("pool", "phase"), _each(_phases)),
    Metric("hicache_prefault_bytes_per_second", GAUGE, "Pre-fault rate of the last bring-up", (),
           lambda s: [((), s.rates[0])]),
    Metric("hicache_register_bytes_per_second", GAUGE, "Registration rate of the last bring-up", (),
           lambda s: [((), s.rates[1])]),
    Metric("hicache_ready_pages", GAUGE, "Pages registered in every buffer", ("pool",),
           _each(lambda v: [((v.pool,), float(v.entry.ready_pages()) if v.record and v.entry.ready_pages else 0.0)])),
    Metric("hicache_pages", GAUGE, "Pages of the pool", ("pool",),
           _each(lambda v: [((v.pool,), float(v.entry.page_num or 0) if v.record else 0.0)])),
    Metric("hicache_budget_bytes", GAUGE, "This host's host-memory budget claims, by process", ("holder",),
           lambda s: [((f"pid:{pid}",), nbytes) for pid, nbytes in sorted(s.claims.items())]),
    Metric("hicache_turnstile_wait_seconds", HISTOGRAM, "Seconds register calls waited for their turn at the "
           "host's registration turnstile", (), lambda s: [((), (s.waits["buckets"], s.waits["sum"]))]),
)


class StoreView(NamedTuple):
    """One node store at a scrape: its arena path, the store and its census."""

    arena: str
    store: object
    census: object


def _slots(view: StoreView):
    plan, census = view.store.arena.plan, view.census
    used = sum(census.by_namespace.values())
    return [((view.arena, state), value)
            for state, value in (("used", used), ("torn", census.torn), ("free", plan.slots - used - census.torn))]


def _count(name: str, field: str, help_text: str) -> Metric:
    return Metric(f"hicache_store_{name}", COUNTER, help_text, ("arena",),
                  lambda stores: [((v.arena,), getattr(v.store.counts, field)) for v in stores])


STORE_METRICS = (
    Metric("hicache_store_bytes", GAUGE, "Bytes of a node store's arena, by its backing", ("arena", "backing"),
           lambda stores: [((v.arena, v.store.arena.backing.kind), v.store.arena.plan.total_bytes) for v in stores]),
    Metric("hicache_store_slots", GAUGE, "Slots of a node store's arena: used (a page held), torn (being written, "
           "or a dead writer's), free", ("arena", "state"), lambda stores: [s for v in stores for s in _slots(v)]),
    Metric("hicache_store_pages", GAUGE, "Distinct pages the arena holds", ("arena",),
           lambda stores: [((v.arena,), v.census.pages) for v in stores]),
    _count("hits", "hits", "Pages this process read from the store"),
    _count("misses", "misses", "Pages this process looked for and missed"),
    _count("torn_reads", "torn", "Reads that found their page rewritten while copying (a miss)"),
    _count("corrupt_reads", "corrupt", "Reads whose checksum failed (a miss; the slot is reclaimed)"),
    _count("evictions", "evictions", "Pages this process's writes evicted"),
    _count("writes", "writes", "Pages this process wrote"),
    Metric("hicache_store_attach_seconds", GAUGE, "Seconds this process's attach (or creation) of the arena took",
           ("arena",), lambda stores: [((v.arena,), v.store.arena.attach_s) for v in stores]),
)


def families(rows, scrape) -> list:
    """The prometheus_client families of ``rows`` for one ``scrape``, in the rows' order."""
    from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily

    made = []
    for row in rows:
        if row.kind == HISTOGRAM:
            family = HistogramMetricFamily(row.name, row.help, labels=row.labels)
            for labels, (buckets, total) in row.samples(scrape):
                family.add_metric(list(labels), [("+Inf" if b == float("inf") else str(b), c) for b, c in buckets],
                                  total)
        else:
            family = (GaugeMetricFamily if row.kind == GAUGE else CounterMetricFamily)(row.name, row.help,
                                                                                       labels=row.labels)
            for labels, value in row.samples(scrape):
                family.add_metric(list(labels), value)
        made.append(family)
    return made
