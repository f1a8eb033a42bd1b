"""hicache's metrics on SGLang's own `/metrics` (issue #33 item 6). SGLang serves `/metrics` from
its HTTP process with prometheus_client's MultiProcessCollector over PROMETHEUS_MULTIPROC_DIR
(`sglang.srt.utils.common.add_prometheus_middleware`), while pools live in scheduler processes.
Three such processes (tests/metrics_child.py, SGLang's real code and the plug-in, forked from
one zygote that imported SGLang with PROMETHEUS_MULTIPROC_DIR set - tests/store_child.py): two build
SGLang's own host pool (seam mode), one hicache's (HICACHE_SGLANG_POOLS=1). What SGLang's
endpoint would serve - SGLang's own middleware's registry, rendered - holds one series per
process (its pid) whose registered bytes and calls are what that process's fake driver holds
and made, and whose every sample equals what that process's own collector said."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from sglang_support import need_sglang
from store_support import Zygote


def _served(directory: Path) -> dict:
    """The text SGLang's /metrics serves over ``directory``, parsed: (name, labels) -> value.
    Through SGLang's own middleware where it can be had, else its two lines (the same registry)."""
    from prometheus_client import CollectorRegistry, generate_latest, multiprocess
    from prometheus_client.parser import text_string_to_metric_families

    registry = CollectorRegistry()
    multiprocess.MultiProcessCollector(registry, path=str(directory))  # add_prometheus_middleware's registry
    text = generate_latest(registry).decode()
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


def test_every_process_of_a_server_reaches_its_metrics_endpoint(tmp_path):
    """Seam mode x2 and pools mode: each child's registered bytes == its fake driver's held
    bytes, its calls == the driver's register calls, every sample (phase seconds, pages,
    ready pages included) equal to its own collector's, labelled with its pid; nothing else."""
    need_sglang()
    directory = tmp_path / "prometheus"
    directory.mkdir()
    runtime = tmp_path / "runtime"
    runtime.mkdir(mode=0o700)
    env = {"PROMETHEUS_MULTIPROC_DIR": str(directory), "HICACHE_RUNTIME_DIR": str(runtime)}
    with Zygote(sglang=True, env=env) as zygote:  # SGLang imported once, each process forked from it
        for i in range(3):
            zygote.start(f"scheduler{i}", "metrics_rank", tokens=256 * (i + 1), hicache_pools=i == 2)
        reports = [zygote.result(f"scheduler{i}") for i in range(3)]
    assert [r["pool_module"] for r in reports] == ["sglang", "sglang", "hicache"]
    assert all(r["multiprocess"] for r in reports)
    served = _served(directory)
    for report in reports:
        pid = str(report["pid"])
        registered = {k: v for k, v in served.items() if k[0] == "hicache_registered_bytes" and ("pid", pid) in k[1]}
        assert list(registered.values()) == [report["held_bytes"]] and report["held_bytes"] > 0, (report, registered)
        calls = sum(v for k, v in served.items()
                    if k[0] == "hicache_registration_calls_total" and ("pid", pid) in k[1] and ("result", "ok") in k[1])
        assert calls == report["register_calls"] >= 1
        for name, labels, value in report["samples"]:  # what its own registry would have served
            key = (name, tuple(sorted({**labels, "pid": pid}.items())))
            assert served.get(key) == value, (key, value, served.get(key))
        phases = {dict(k[1])["phase"] for k in served if k[0] == "hicache_bringup_seconds" and ("pid", pid) in k[1]}
        assert {"prefault", "register", "ready"} <= phases, phases
    pids = {dict(k[1]).get("pid") for k in served if k[0].startswith("hicache_")}
    assert pids == {str(r["pid"]) for r in reports}  # one series per process, none from elsewhere


@pytest.fixture
def multiprocess_values(tmp_path, monkeypatch):
    """prometheus_client's mmap-backed values in this process, over a fresh directory - as if it
    had been imported with PROMETHEUS_MULTIPROC_DIR set (what SGLang's processes see)."""
    from prometheus_client import values

    directory = tmp_path / "prometheus"
    directory.mkdir()
    monkeypatch.setenv("PROMETHEUS_MULTIPROC_DIR", str(directory))
    monkeypatch.setattr(values, "ValueClass", values.MultiProcessValue())
    yield directory
    _close_value_files(directory)


def _close_value_files(directory) -> None:
    """Close the test's value files now: prometheus_client before 0.26 keeps them in its value
    class's closure with no way to close them, so they were left to the collector, whose
    ResourceWarning then failed whichever later test it ran in."""
    import gc

    from prometheus_client.mmap_dict import MmapedDict

    for thing in gc.get_objects():
        if type(thing) is MmapedDict and str(thing._fname).startswith(str(directory)):  # type(): no proxy asked
            thing.close()


def test_each_family_kind_is_served_as_the_process_collected_it(multiprocess_values):
    """A gauge, a counter and a histogram written by the publisher come out of SGLang's
    endpoint's collector as they went in (the histogram's cumulative buckets, count and sum),
    each with this process's pid; written again, the new values replace the old ones."""
    from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily

    from hicache import _metrics_publish as mp

    assert mp.active()
    pid = str(os.getpid())

    def families(scale):
        gauge = GaugeMetricFamily("t_bytes", "bytes", labels=("pool",))
        gauge.add_metric(["a"], 10.0 * scale)
        counter = CounterMetricFamily("t_calls", "calls", labels=("pool",))
        counter.add_metric(["a"], 3 * scale)
        histogram = HistogramMetricFamily("t_wait_seconds", "waits", buckets=[
            ("0.001", 1 * scale), ("0.01", 3 * scale), ("+Inf", 4 * scale)], sum_value=0.02 * scale)
        return [gauge, counter, histogram]

    publisher = mp.Publisher()
    for scale in (1, 2):
        publisher.write(families(scale))
        served = _served(multiprocess_values)
        assert served[("t_bytes", (("pid", pid), ("pool", "a")))] == 10.0 * scale
        assert served[("t_calls_total", (("pid", pid), ("pool", "a")))] == 3 * scale
        buckets = {dict(k[1])["le"]: v for k, v in served.items() if k[0] == "t_wait_seconds_bucket"}
        assert buckets == {"0.001": 1 * scale, "0.01": 3 * scale, "+Inf": 4 * scale}
        assert served[("t_wait_seconds_count", (("pid", pid),))] == 4 * scale
        assert served[("t_wait_seconds_sum", (("pid", pid),))] == pytest.approx(0.02 * scale)


def test_values_collected_before_the_last_write_never_replace_it(multiprocess_values):
    """Two collects overlap (the publisher's thread began one, then a bring-up collected and
    wrote its own): the older one's write, landing last, is dropped - the served value stays
    the newer one, and a later collect writes again."""
    from prometheus_client.core import GaugeMetricFamily

    from hicache import _metrics_publish as mp

    def gauge(value):
        family = GaugeMetricFamily("t_registered", "bytes", labels=("pool",))
        family.add_metric(["a"], value)
        return [family]

    key = ("t_registered", (("pid", str(os.getpid())), ("pool", "a")))
    publisher = mp.Publisher()
    older, newer = publisher.ticket(), publisher.ticket()
    publisher.write(gauge(811008.0), newer)
    publisher.write(gauge(0.0), older)
    assert _served(multiprocess_values)[key] == 811008.0
    publisher.write(gauge(4096.0), publisher.ticket())
    assert _served(multiprocess_values)[key] == 4096.0


def test_a_stopped_publisher_ends_its_thread_and_starts_no_other():
    """stop() ends the publisher's thread (it writes until then, when woken) and a later start()
    starts none: a test's publisher no longer outlives it, writing into value files it closed."""
    import threading

    from hicache import _metrics_publish as mp

    collected = threading.Event()

    def collect():
        collected.set()
        return []

    publisher = mp.Publisher()
    publisher.start(collect)
    publisher.wake()
    assert collected.wait(60), "the thread never collected"  # a hang guard, not a timing
    thread = publisher._thread
    assert publisher.stop(60) and not thread.is_alive()
    publisher.start(collect)
    assert publisher._thread is thread and not thread.is_alive()
    assert publisher.stop(0)  # a second stop: nothing left to end


def test_a_failing_collect_is_a_log_line_never_the_callers(multiprocess_values, caplog):
    """A diagnostic never fails the work it observes: publish() swallows and logs."""
    from hicache import _metrics_publish as mp

    def broken():
        raise RuntimeError("scrape broke")

    mp.publish(mp.Publisher(), broken)
    assert "could not write the multiprocess values" in caplog.text


def test_a_bring_up_writes_its_values_at_once_without_reading_smaps_and_the_thread_adds_the_tiers(
        multiprocess_values, monkeypatch, tmp_path):
    """Under multiprocess mode a pool's constructor writes this process's values itself but reads
    no /proc/self/smaps (53-60 ms a read with SGLang loaded: the page tiers are left out of that
    write); the publisher's thread, woken by the bring-up, then writes everything, page tiers
    included - they add up to the pool's bytes, all pre-faulted."""
    import builtins
    import threading

    from doors import doors
    from machine import ROOMY

    from hicache import _metrics_publish as mp
    from hicache.effects import BudgetLock
    from hicache.plan import Limits
    from hicache.pools import MHATokenToKVPoolHost
    from hicache.testing import FakeRuntime, MHADevicePool

    assert mp.active()
    publisher = mp.Publisher()
    monkeypatch.setattr(mp, "PUBLISHER", publisher)  # its thread starts with this bring-up
    monkeypatch.setattr(mp, "PUBLISH_EVERY_S", 3600.0)  # so only the bring-up's wake makes it write
    written = threading.Event()
    real_publish = mp.publish

    def recording_publish(publisher, collect):
        real_publish(publisher, collect)
        if threading.current_thread().name == "hicache-metrics":
            written.set()

    monkeypatch.setattr(mp, "publish", recording_publish)
    opened: list = []
    real_open = builtins.open

    def recording_open(file, *args, **kwargs):
        if threading.current_thread().name != "hicache-metrics":  # the publisher's own thread may
            opened.append(str(file))
        return real_open(file, *args, **kwargs)

    device = MHADevicePool(size=64, layer_num=2, head_num=2, head_dim=64, page_size=4)
    monkeypatch.setattr(builtins, "open", recording_open)
    try:
        pool = MHATokenToKVPoolHost(device, 2.0, 0, 4, "page_first_direct", True, "cpu", pool_label="mp-tiers",
                                    **doors(runtime=FakeRuntime(), machine=ROOMY, budget_lock=BudgetLock(tmp_path),
                                            limits=Limits(chunk_limit_bytes=64 * 1024)))
    finally:
        monkeypatch.setattr(builtins, "open", real_open)
    try:
        assert not [path for path in opened if path.endswith("smaps")], opened
        pid = str(os.getpid())
        served = _served(multiprocess_values)
        assert served[("hicache_registered_bytes", (("pid", pid), ("pool", pool.metrics_name)))] > 0
        assert written.wait(60), "the publisher's thread never wrote"  # a hang guard, not a timing
        served = _served(multiprocess_values)
        tiers = {dict(k[1])["tier"]: v for k, v in served.items()
                 if k[0] == "hicache_host_pool_bytes" and dict(k[1]).get("pool") == pool.metrics_name}
        assert set(tiers) == {"hugetlb", "thp", "4k"} and sum(tiers.values()) >= pool._host.total_bytes
    finally:
        pool.destroy()
        # else it outlives the test, writing every 5 s into the value files the fixture closes
        assert publisher.stop(60), "the publisher's thread did not end"
