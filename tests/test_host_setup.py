"""The host set-up bundle (issue #34 item 5): `HostSetup` carries the host's pieces - runtime,
machine facts, limits, budget lock and figures, ledger, turnstile, copy engine - into
`bring_up(host=)` and every pool (``host=``); the old keywords still work and land in the same
fields, a piece given both ways is a TypeError, and `hicache.testing.fake_host_setup()` brings a
pool up with nothing of this machine's."""

from __future__ import annotations

import pytest

from hicache.effects import BudgetLock, HostLedger, HostSetup, bring_up
from hicache.errors import CapacityError
from hicache.plan import Limits, plan_pool
from hicache.pools import MHATokenToKVPoolHost
from hicache.testing import FakeRuntime, MHADevicePool, fake_host_setup, fake_machine

torch = pytest.importorskip("torch")
GB = 10**9


def _device():
    return MHADevicePool(size=64, layer_num=3, head_num=2, head_dim=8, page_size=4)


def test_a_pool_brings_up_with_its_host_setup_and_nothing_of_the_machines(tmp_path):
    """With ``host=fake_host_setup(dir)`` the pool registers through that runtime, claims under
    that lock (a peer in the same directory sees the claim) and copies with that engine."""
    setup = fake_host_setup(tmp_path)
    pool = MHATokenToKVPoolHost(_device(), 2.0, 0, 4, "page_first", host=setup)
    try:
        assert pool.host_setup.runtime is setup.runtime and pool.copy_engine is setup.copy_engine
        assert sum(size for _, size in setup.runtime.held()) == pool.pool_plan.total_bytes
        with BudgetLock(tmp_path) as peer:  # another process's view of the same directory
            assert sum(peer.snapshot().values()) == pool.pool_plan.total_bytes
    finally:
        pool.destroy()
    assert setup.runtime.held() == set()


def test_the_setups_budget_figures_decide_before_any_memory(tmp_path):
    """A stated host figure too small for the pool is the budget's CapacityError, and the setup's
    runtime never saw a call."""
    setup = fake_host_setup(tmp_path, host_memory_bytes=10**4, reserve_bytes=0)  # the pool: 24 KiB
    with pytest.raises(CapacityError):
        MHATokenToKVPoolHost(_device(), 2.0, 0, 4, "page_first", host=setup)
    assert setup.runtime.held() == set() and setup.runtime.cudart.log == []


def test_the_old_keywords_land_in_the_same_fields():
    """A pool's ``runtime=``, ``machine=``, ``budget_lock=``, ``ledger=``, ``limits=`` are its
    setup's runtime, machine, lock, ledger and limits."""
    runtime, machine, ledger = FakeRuntime(), fake_machine(available_bytes=100 * GB), HostLedger()
    lock, limits = BudgetLock(), Limits(chunk_limit_bytes=1 << 20, os_page_bytes=4096)
    pool = MHATokenToKVPoolHost(_device(), 2.0, 0, 4, "page_first", runtime=runtime, machine=machine,
                                budget_lock=lock, ledger=ledger, limits=limits)
    try:
        setup = pool.host_setup
        assert (setup.runtime, setup.machine, setup.lock, setup.ledger, setup.limits) == (runtime, machine, lock, ledger,
                                                                                          limits)
        assert runtime.held() and ledger.held()
    finally:
        pool.destroy()


@pytest.mark.parametrize("keyword, value", [("runtime", FakeRuntime), ("budget_lock", BudgetLock),
                                            ("machine", fake_machine)])
def test_a_piece_given_both_ways_is_a_type_error_naming_it(tmp_path, keyword, value):
    """``host=`` and a keyword for the same piece: Python's TypeError naming it, before any memory."""
    setup = fake_host_setup(tmp_path)
    with pytest.raises(TypeError, match="both in host= and as a keyword"):
        MHATokenToKVPoolHost(_device(), 2.0, 0, 4, "page_first", host=setup, **{keyword: value()})
    assert setup.runtime.held() == set()


@pytest.mark.parametrize("keyword", ["runtime", "machine", "lock", "ledger", "turnstile", "host_memory_bytes",
                                     "ranks_per_host", "reserve_bytes", "progress", "prefault_progress", "trace"])
def test_bring_up_takes_the_host_and_the_report_as_one_value_each(tmp_path, keyword):
    """`bring_up(host=setup)` brings a plan up with the setup's pieces; each of the eleven
    keywords that once spelt a piece of the host or the report is now Python's TypeError naming
    it (issue #55: one door per concern), before any memory is taken."""
    plan = plan_pool(_device_layout(), Limits(chunk_limit_bytes=1 << 20, os_page_bytes=4096))
    setup = fake_host_setup(tmp_path)
    handle = bring_up(plan, host=setup)
    try:
        assert setup.runtime.cudart.log and handle.total_bytes == plan.total_bytes
    finally:
        handle.release()
    other = fake_host_setup(tmp_path)
    with pytest.raises(TypeError, match=f"unexpected keyword argument '{keyword}'"):
        bring_up(plan, host=other, **{keyword: None})
    assert other.runtime.cudart.log == []


def _device_layout():
    from hicache.plan import MHALayout

    return MHALayout("page_first", layer_num=3, head_num=2, head_dim=8, page_size=4, page_num=8, itemsize=2)


def test_probe_fills_every_piece_it_can_make():
    """`HostSetup.probe()` makes the runtime, machine facts, limits, budget lock and copy engine
    now; what is given is kept; the ledger stays the process's and the turnstile "auto"."""
    runtime = FakeRuntime()
    setup = HostSetup.probe(runtime=runtime)
    assert setup.runtime is runtime
    assert all(getattr(setup, name) is not None for name in ("machine", "limits", "lock", "copy_engine"))
    assert setup.ledger is None and setup.turnstile == "auto"


def test_the_reporting_concern_is_one_report(tmp_path):
    """``report=Report(progress=...)`` hears every call and shows the pool to the metrics;
    ``Report(metrics=False, progress=...)`` hears every call without showing it; ``report=None``
    shows nothing."""
    from hicache.effects import Report

    plan = plan_pool(_device_layout(), Limits(chunk_limit_bytes=1 << 12, os_page_bytes=4096))
    heard = {"shown": [], "hidden": []}
    for way, report in (("shown", Report("grouped", progress=heard["shown"].append)),
                        ("hidden", Report(metrics=False, progress=heard["hidden"].append)), ("none", None)):
        handle = bring_up(plan, host=fake_host_setup(tmp_path), mode="blocking", report=report)
        try:
            assert len(heard.get(way, [0, 0])) == plan.buffers[0].plan.call_count > 1 or way == "none"
            assert handle.report.metrics is (way == "shown")
        finally:
            handle.release()
