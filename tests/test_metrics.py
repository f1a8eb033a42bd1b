"""Prometheus metrics (#21 item 2; docs/metrics.md): after a fake bring-up the default registry
holds every documented name with the values the pool's handle reports (tiers as the kernel
reports them, registered bytes, calls, phase seconds, pages, budget claims), progressive pools'
pages move as they register, a failed bring-up counts, a released pool reads nothing held; and
`hicache apply --metrics-port` serves them over HTTP on 127.0.0.1 while it holds the memory."""

from __future__ import annotations

import os
import socket
import sys
import time
import urllib.request
from pathlib import Path

import pytest
from doors import doors
from machine import ROOMY

from hicache.plan import Limits
from hicache.testing import FakeRuntime, MHADevicePool

prometheus_client = pytest.importorskip("prometheus_client")
torch = pytest.importorskip("torch")
from prometheus_client import REGISTRY  # noqa: E402

from hicache import metrics  # noqa: E402
from hicache.effects import HostSetup

pytestmark = pytest.mark.concurrency  # processes, threads, signals or waits: `make test-loaded`

P = 4
NAMES = ("hicache_host_pool_bytes", "hicache_registered_bytes", "hicache_registration_calls_total",
         "hicache_bringup_seconds", "hicache_prefault_bytes_per_second", "hicache_register_bytes_per_second",
         "hicache_ready_pages", "hicache_pages", "hicache_budget_bytes", "hicache_turnstile_wait_seconds_count")


def _value(name: str, **labels):
    return REGISTRY.get_sample_value(name, labels)


def _pool(label: str, runtime, tmp_path, *, tokens: int = 64, chunk: int = 64 * 1024, **kw):
    from hicache.effects import BudgetLock
    from hicache.pools import MHATokenToKVPoolHost

    device = MHADevicePool(size=tokens, layer_num=2, head_num=2, head_dim=64, page_size=P)
    return MHATokenToKVPoolHost(device, 2.0, 0, P, "page_first_direct", True, "cpu", pool_label=label,
                                **doors(runtime=runtime, machine=ROOMY, budget_lock=BudgetLock(tmp_path),
                                        limits=Limits(chunk_limit_bytes=chunk), **kw))


def test_a_bring_up_shows_every_documented_name_with_the_handles_values(tmp_path):
    """After a pool's bring-up every documented family is served, with the handle's own tiers,
    bytes, calls and timings."""
    runtime = FakeRuntime()
    pool = _pool("metrics-a", runtime, tmp_path)
    name = pool.metrics_name
    handle = pool._host
    try:
        sampled = {metric.name for family in REGISTRY.collect() for metric in family.samples}
        assert set(NAMES) <= sampled, set(NAMES) - sampled
        tiers = {tier: _value("hicache_host_pool_bytes", pool=name, numa_node="none", tier=tier)
                 for tier in ("hugetlb", "thp", "4k")}
        obtained = [t for _, t in handle.tiers()]
        assert tiers == {"hugetlb": sum(t.hugetlb for t in obtained), "thp": sum(t.thp for t in obtained),
                         "4k": sum(t.base for t in obtained)}
        assert sum(tiers.values()) >= handle.total_bytes  # pre-faulted: all of it resident
        assert _value("hicache_registered_bytes", pool=name) == sum(s for _, s in handle.registered_ranges()) \
            == sum(s for _, s in runtime.held()) > 0
        assert _value("hicache_registration_calls_total", pool=name, result="ok") == len(handle.calls) > 1
        assert _value("hicache_bringup_seconds", pool=name, phase="register") == pytest.approx(handle.timings["register_s"])
        assert _value("hicache_bringup_seconds", pool=name, phase="ready") == pytest.approx(handle.timings["ready_s"])
        assert _value("hicache_bringup_seconds", pool=name, phase="prefault") > 0
        assert _value("hicache_pages", pool=name) == pool.page_num
        assert _value("hicache_ready_pages", pool=name) == pool.ready_pages() == pool.page_num
        claims = handle.budget_claims()
        assert claims.get(os.getpid()) == handle.total_bytes
        assert _value("hicache_budget_bytes", holder=f"pid:{os.getpid()}") == handle.total_bytes
    finally:
        pool.destroy()
    assert _value("hicache_registered_bytes", pool=name) == 0 and _value("hicache_pages", pool=name) == 0
    assert _value("hicache_registration_calls_total", pool=name, result="ok") == len(handle.calls)  # kept


def test_each_tier_is_reported_under_its_own_label(tmp_path, monkeypatch):
    """What the kernel gave goes out by tier as obtained - hugetlbfs, THP and base-page bytes
    each under their own label, summed over the pool's buffers (three distinct figures here,
    so a tier reported under another's label shows)."""
    from hicache.effects._host._tiers import PageTiers

    pool = _pool("metrics-tiers", FakeRuntime(), tmp_path)
    try:
        monkeypatch.setattr(pool._host, "tiers", lambda **_: [("k", PageTiers(2 * 2**21, 5 * 2**21, 5 * 4096)),
                                                         ("v", PageTiers(2**21, 0, 7 * 4096))])
        got = {tier: _value("hicache_host_pool_bytes", pool=pool.metrics_name, numa_node="none", tier=tier)
               for tier in ("hugetlb", "thp", "4k")}
        assert got == {"hugetlb": 3 * 2**21, "thp": 5 * 2**21, "4k": 12 * 4096}
    finally:
        pool.destroy()


def _gated_progressive_pool(label: str, tmp_path):
    """A progressive pool whose background registration waits at a gate (an event: no timing)
    until the test sets it: ``(pool, gate, runtime)``."""
    import threading

    runtime = FakeRuntime()
    gate = threading.Event()
    register = runtime.cudart.cudaHostRegister

    def gated(ptr, size, flags):
        if threading.current_thread() is not threading.main_thread():  # the background registration
            assert gate.wait(60), "hang guard"
        return register(ptr, size, flags)

    runtime.cudart.cudaHostRegister = gated
    pool = _pool(label, runtime, tmp_path, tokens=256, chunk=16 * 1024, progressive=True, max_stall_s=None)
    return pool, gate, runtime


@pytest.mark.concurrency
def test_once_a_pool_is_all_registered_its_tiers_are_kept_and_smaps_is_read_no_more(tmp_path, monkeypatch):
    """Pinned pages keep their backing (the kernel neither migrates, collapses, splits nor
    swaps a pinned page), so once every byte of a pool is registered its page tiers are kept
    from the scrape that first saw it so: /proc/self/smaps walks every page table of the
    process under its mmap lock - 90 ms for 8 GiB of 4 KiB pages, over a second for a 100 GB
    pool - and the multiprocess publisher scraped every 5 s. A progressive pool's are read at
    each scrape until its last call (its registration held at a gate: events, no timing). Told
    from this pool's own reads - the tiers its record is asked for - not from the process's
    smaps reads, which a pool another test left behind may still need."""
    pool, gate, _ = _gated_progressive_pool("metrics-kept", tmp_path)
    name = pool.metrics_name
    asked: list = []  # per scrape of this pool: whether its tiers were read from smaps
    record = pool._host.record
    monkeypatch.setattr(pool._host, "record", lambda **kw: asked.append(kw.get("tiers", True)) or record(**kw))

    def tiers():
        return {tier: _value("hicache_host_pool_bytes", pool=name, numa_node="none", tier=tier)
                for tier in ("hugetlb", "thp", "4k")}

    try:
        tiers()
        assert asked and all(asked)  # registering still: read at every scrape
        gate.set()
        assert pool.wait_ready(timeout=30)
        first = tiers()
        assert sum(first.values()) >= pool._host.total_bytes
        settled = len(asked)
        assert [tiers() for _ in range(5)] == [first] * 5
        assert len(asked) > settled and not any(asked[settled:])  # scraped, its tiers kept: no smaps for it
    finally:
        gate.set()
        pool.destroy()


@pytest.mark.concurrency
def test_a_progressive_pools_ready_pages_move_as_it_registers(tmp_path):
    """The gauge shows the head pages registered before the pool serves, while the background
    registration is held at a gate (an event: no timing), then every page once it is let go."""
    pool, gate, runtime = _gated_progressive_pool("metrics-p", tmp_path)
    name = pool.metrics_name
    try:
        first = _value("hicache_ready_pages", pool=name)
        assert 0 < first < pool.page_num
        gate.set()
        assert pool.wait_ready(timeout=30)
        assert _value("hicache_ready_pages", pool=name) == pool.page_num
        assert _value("hicache_registered_bytes", pool=name) == sum(s for _, s in runtime.held())
    finally:
        gate.set()
        pool.destroy()


@pytest.mark.concurrency
def test_a_progressive_pools_prefault_seconds_and_rates_follow_it_to_its_last_call(tmp_path):
    """A progressive pool returns after its first calls while its background registration is
    held at a gate (an event: no timing): once let go and done, a scrape shows the pre-fault
    phase as the whole background pre-fault took and both rate gauges as of the last call -
    not the figures of the moment the bring-up returned (issue #54: "252 GB/s" pre-fault)."""
    import threading

    runtime = FakeRuntime()
    gate = threading.Event()
    register = runtime.cudart.cudaHostRegister

    def gated(ptr, size, flags):
        if threading.current_thread() is not threading.main_thread():
            assert gate.wait(60), "hang guard"
        return register(ptr, size, flags)

    runtime.cudart.cudaHostRegister = gated
    pool = _pool("metrics-r", runtime, tmp_path, tokens=256, chunk=16 * 1024, progressive=True, max_stall_s=None)
    name, handle = pool.metrics_name, pool._host
    try:
        early = _value("hicache_register_bytes_per_second")
        gate.set()
        assert pool.wait_ready(timeout=30)
        faulter = handle._books.faulting.faulter
        faulter.join()  # every piece faulted (the registration waited for them all): ends at once
        record = handle.record(tiers=False)
        registered = sum(s for _, s in runtime.held())
        assert record.register_s == pytest.approx(sum(call[2] for call in handle.calls))
        assert _value("hicache_register_bytes_per_second") == pytest.approx(registered / record.register_s)
        assert _value("hicache_bringup_seconds", pool=name, phase="prefault") == pytest.approx(faulter.seconds)
        assert _value("hicache_prefault_bytes_per_second") == pytest.approx(handle.total_bytes / faulter.seconds)
        assert early != _value("hicache_register_bytes_per_second")  # it moved after the bring-up returned
    finally:
        gate.set()
        pool.destroy()


def test_a_failed_bring_up_counts_as_failed(tmp_path):
    """A pool bring-up that fails and rolls back counts one result=failed bring-up, with nothing
    registered."""
    runtime = FakeRuntime(fail_register={1: 2})
    label = "metrics-f"
    before = _value("hicache_registration_calls_total", pool=f"MHATokenToKVPoolHost:{label}", result="failed") or 0
    with pytest.raises(Exception):
        _pool(label, runtime, tmp_path)
    assert _value("hicache_registration_calls_total", pool=f"MHATokenToKVPoolHost:{label}", result="failed") == before + 1
    assert runtime.held() == set()


def test_without_prometheus_client_tracking_does_nothing(monkeypatch, tmp_path):
    """Without prometheus_client the pools build and nothing is collected."""
    monkeypatch.setattr(metrics, "install", lambda registry=None: False)
    runtime = FakeRuntime()
    pool = _pool("metrics-off", runtime, tmp_path)
    try:
        assert _value("hicache_pages", pool=pool.metrics_name) is None
    finally:
        pool.destroy()


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def test_apply_serves_the_metrics_over_http_on_localhost(tmp_path, fork_server):
    """apply --metrics-port serves every documented family on 127.0.0.1 while it holds, with
    registered bytes above 0."""
    port = _free_port()
    env = dict(os.environ, XDG_RUNTIME_DIR=str(tmp_path), PYTHONWARNINGS="ignore")
    command = [sys.executable, "-m", "hicache", "apply", "--fake-cuda", "--model", "llama-3.1-8b", "--host-gb", "0.25",
               "--host-memory", "1TB", "--ranks-per-host", "1", "--hold", "30", "--metrics-port", str(port)]
    process = fork_server.spawn(command, env=env, cwd=Path(__file__).parent.parent)  # tests/forked.py
    try:
        body, deadline = "", time.monotonic() + 60
        while time.monotonic() < deadline:
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=2) as response:
                    body = response.read().decode()
                if 'hicache_registered_bytes{pool="apply"}' in body and ' 0.0' not in _line(body, "hicache_registered_bytes"):
                    break
            except OSError:
                pass
            assert process.poll() is None, process.communicate()
            time.sleep(0.2)
        for name in NAMES[:-1]:
            assert name in body, name
        assert float(_line(body, "hicache_registered_bytes").split()[-1]) > 0
    finally:
        process.terminate()
        process.communicate(timeout=30)


def _line(body: str, name: str) -> str:
    return next((line for line in body.splitlines() if line.startswith(name + "{")), "")


def test_a_port_that_is_taken_is_a_clear_error(tmp_path, capsys):
    """A --metrics-port in use or out of range is error[bad-port] / bad-number naming the port,
    before any memory."""
    from hicache.cli import main

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        code = main(["apply", "--fake-cuda", "--model", "llama-3.1-8b", "--host-gb", "0.01", "--host-memory", "1TB",
                     "--ranks-per-host", "1", "--metrics-port", str(port)])
    err = capsys.readouterr().err
    assert code != 0 and f"--metrics-port {port}" in err and "bad-port" in err
    assert main(["apply", "--fake-cuda", "--model", "llama-3.1-8b", "--host-gb", "0.01", "--metrics-port", "70000"]) != 0


def test_every_bring_up_is_shown_by_the_bring_up_itself_and_a_replaced_one_never_hides_its_successor(tmp_path):
    """A plain bring_up (no pool, no CLI) is shown under its Report's name; two bring-ups of one
    name: releasing the earlier leaves the later one's registered bytes shown, releasing the later
    shows 0 - and a bring-up with report=None is not shown at all."""
    from hicache.effects import Report, bring_up
    from hicache.effects import HostSetup
    from hicache.effects import BudgetLock
    from hicache.plan import MHALayout, plan_pool

    plan = plan_pool(MHALayout("page_first_direct", layer_num=2, head_num=2, head_dim=64, page_size=4, page_num=8,
                               itemsize=2), Limits(chunk_limit_bytes=64 * 1024))
    lock, name = BudgetLock(tmp_path), "plain-bring-up"
    first = bring_up(plan, host=HostSetup(runtime=FakeRuntime(), machine=ROOMY, lock=lock), report=Report(name, page_num=8))
    second = bring_up(plan, host=HostSetup(runtime=FakeRuntime(), machine=ROOMY, lock=lock), report=Report(name, page_num=8))
    hidden = bring_up(plan, host=HostSetup(runtime=FakeRuntime(), machine=ROOMY, lock=lock), report=None)
    try:
        assert _value("hicache_pages", pool=name) == 8
        first.release()
        assert _value("hicache_registered_bytes", pool=name) == plan.total_bytes  # the later one's
        second.release()
        assert _value("hicache_registered_bytes", pool=name) == 0
        assert all(entry.handle() is not hidden for entry in metrics._STATE.entries.values())
    finally:
        for handle in (first, second, hidden):
            handle.release()


def test_a_handed_on_registrations_tiers_are_read_at_each_scrape_and_never_once_it_is_released():
    """The seam's tracked registration (`track_registration` with a tiers reader): each read asks
    the reader again (the tiers as they are now, not at bring-up), and once the registration is
    released the reader is not called at all - that memory may be someone else's by then."""
    from types import SimpleNamespace

    calls: list = []

    def reader(smaps_text=None):
        calls.append(smaps_text)
        return [("kv", SimpleNamespace(hugetlb=0, thp=0, base=4096))]

    class Registration:
        state = "active"

        def status(self):
            return SimpleNamespace(state=self.state, ranges=[], register_seconds=0.0)

    registration = Registration()
    tracked = metrics.track_registration("test-reader:buffer0", registration, tiers=reader, total_bytes=4096)
    try:
        assert tracked.tiers() == reader() and tracked.tiers("smaps text") == reader()
        assert calls == [None, None, "smaps text", None]
        registration.state = "released"
        assert tracked.tiers() == [] and len(calls) == 4
    finally:
        metrics.released("test-reader:buffer0", tracked)
