"""The host set-up bundle (issue #34 item 5, #55 item 2): `HostSetup` carries the host's pieces -
runtime, machine facts, limits, budget lock and figures, ledger, turnstile, copy engine, the
allocator the memory comes from - into `bring_up(host=)` and every pool (``host=``); the keywords
that once spelt them one by one are Python's TypeError naming the word, and
`hicache.testing.fake_host_setup()` brings a pool up with nothing of this machine's."""

from __future__ import annotations

import re

import attrs
import pytest

from hicache.effects import BudgetLock, BufferRequest, HostLedger, HostSetup, HostTensorAllocator, bring_up
from hicache.errors import CapacityError, PlanError
from hicache.plan import Limits, plan_pool
from hicache.pools import MHATokenToKVPoolHost
from hicache.testing import FakeRuntime, MHADevicePool, fake_host_setup, fake_machine
from hicache.pools import HostPoolOptions, NoServer

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


@pytest.mark.parametrize("device", ["cuda", "cuda:0", "meta", "npu"])
def test_a_host_pool_on_another_device_than_the_cpu_is_refused_before_any_memory(tmp_path, device):
    """``device=`` names where the host pool's memory lives: host memory, "cpu" - SGLang's call
    sites always pass it. Another device (its GPU's, say) is a PlanError naming the field and
    the value, from the constructor and from `from_geometry`, before the budget or the runtime
    saw anything (SGLang's own pool would allocate GPU memory and register it as host memory)."""
    import torch

    setup = fake_host_setup(tmp_path)
    with pytest.raises(PlanError, match=rf"device must be 'cpu' .* got {device!r}"):
        MHATokenToKVPoolHost(_device(), 2.0, 0, 4, "page_first", True, device, host=setup)
    geometry = MHATokenToKVPoolHost.geometry_of(_device(), 2.0, 0, 4, "page_first")
    with pytest.raises(PlanError, match=rf"device must be 'cpu' .* got {device!r}"):
        MHATokenToKVPoolHost.from_geometry(geometry, device=device, host=setup)
    assert setup.runtime.cudart.log == []
    with BudgetLock(tmp_path) as peer:
        assert sum(peer.snapshot().values()) == 0
    pool = MHATokenToKVPoolHost(_device(), 2.0, 0, 4, "page_first", device=torch.device("cpu"), host=setup)
    try:
        assert pool.device == "cpu" and pool.kv_buffer.device.type == "cpu"
    finally:
        pool.destroy()


@pytest.mark.parametrize("field, value, message", [
    ("host_memory_bytes", -1, "HostSetup.host_memory_bytes must be positive, got -1"),
    ("host_memory_bytes", 0, "HostSetup.host_memory_bytes must be positive, got 0"),
    ("host_memory_bytes", 1.5e12, "HostSetup.host_memory_bytes must be an integer, got 1500000000000.0 (float)"),
    ("ranks_per_host", 0, "HostSetup.ranks_per_host must be positive, got 0"),
    ("ranks_per_host", True, "HostSetup.ranks_per_host must be an integer, got True (bool)"),
    ("reserve_bytes", -1, "HostSetup.reserve_bytes must be >= 0, got -1"),
    ("reserve_bytes", "1GiB", "HostSetup.reserve_bytes must be an integer, got '1GiB' (str)"),
])
def test_a_setups_budget_figures_are_checked_when_it_is_made(field, value, message):
    """The budget's figures of a `HostSetup` are refused when the setup is made, naming the field
    and the value - not at a bring-up's budget check, under another name (a negative stated host
    figure read as '0.0 GB available'); numpy integers are taken as plain ints, None as unset."""
    import numpy

    with pytest.raises(PlanError) as raised:
        HostSetup(**{field: value})
    assert str(raised.value) == message
    made = HostSetup(host_memory_bytes=numpy.int64(2**40), ranks_per_host=numpy.int32(8), reserve_bytes=0)
    assert (made.host_memory_bytes, made.ranks_per_host) == (2**40, 8) and type(made.host_memory_bytes) is int
    assert HostSetup(host_memory_bytes=None, ranks_per_host=None).host_memory_bytes is None


@pytest.mark.parametrize("shape, dtype, message", [
    ((4.5,), None, "BufferRequest.shape[0] must be an integer, got 4.5 (float)"),
    ((4, -5), None, "BufferRequest.shape[1] must be >= 0, got -5"),
    (4096, None, "BufferRequest.shape must be a sequence of integers, got 4096"),
    ((16,), "int8", "BufferRequest.dtype must be a torch.dtype or None, got 'int8'"),
])
def test_a_buffer_request_is_checked_when_it_is_made(shape, dtype, message):
    """A `BufferRequest` whose shape is not a sequence of integers >= 0 (a float was truncated to
    an int) or whose dtype is not a torch dtype is refused when made, naming the field and value -
    before a bring-up claims or maps anything."""
    import torch

    with pytest.raises(PlanError) as raised:
        BufferRequest("b", shape, dtype, None)
    assert str(raised.value) == message
    assert BufferRequest("b", [2, 0], torch.int8, None).shape == (2, 0)


@pytest.mark.parametrize("keywords, message", [
    ({"pin_memory": "no"}, "pin_memory must be True or False, got 'no'"),
    ({"pin_memory": None}, "pin_memory must be True or False, got None"),
    ({"pool_label": 5}, "pool_label must be a non-empty string, got 5"),
    ({"pool_label": ""}, "pool_label must be a non-empty string, got ''"),
])
def test_a_pools_sglang_options_are_checked_before_any_memory(tmp_path, keywords, message):
    """SGLang's options of a host pool: ``pin_memory`` is a bool ("no" is truthy: it pinned) and
    ``pool_label`` (the metrics' pool label) a non-empty string - else a PlanError naming the
    value before the budget or the runtime saw anything; numpy's bool is taken."""
    import numpy

    setup = fake_host_setup(tmp_path)
    with pytest.raises(PlanError) as raised:
        MHATokenToKVPoolHost(_device(), 2.0, 0, 4, "page_first", host=setup, **keywords)
    assert str(raised.value) == message and setup.runtime.cudart.log == []
    pool = MHATokenToKVPoolHost(_device(), 2.0, 0, 4, "page_first", pin_memory=numpy.bool_(False), host=setup)
    try:
        assert pool.pin_memory is False and setup.runtime.held() == set()  # not pinned: nothing registered
    finally:
        pool.destroy()


def test_the_host_door_lands_in_the_pools_setup():
    """A pool's ``host=HostSetup(runtime=, machine=, lock=, ledger=, limits=)`` is its setup:
    the same runtime, machine, lock, ledger and limits."""
    runtime, machine, ledger = FakeRuntime(), fake_machine(available_bytes=100 * GB), HostLedger()
    lock, limits = BudgetLock(), Limits(chunk_limit_bytes=1 << 20, os_page_bytes=4096)
    pool = MHATokenToKVPoolHost(_device(), 2.0, 0, 4, "page_first",
                                host=HostSetup(runtime=runtime, machine=machine, lock=lock, ledger=ledger, limits=limits))
    try:
        setup = pool.host_setup
        assert (setup.runtime, setup.machine, setup.lock, setup.ledger, setup.limits) == (runtime, machine, lock, ledger,
                                                                                          limits)
        assert runtime.held() and ledger.held()
    finally:
        pool.destroy()


@pytest.mark.parametrize("keyword", ["runtime", "limits", "machine", "host_memory_bytes", "budget_lock", "ledger",
                                     "copy_engine", "strict_allocator", "allocator_fallback", "numa_node",
                                     "progressive", "max_stall_s", "hugepages"])
def test_a_pool_takes_its_host_and_its_settings_through_one_door_each(tmp_path, keyword):
    """The thirteen keywords that once spelt a piece of the host or a bring-up setting beside
    ``host=`` are Python's TypeError naming the pool and the word (issue #55: one door per
    concern), before any memory; ``options=`` takes a `HostPoolOptions` and ``host=`` a
    `HostSetup`, and anything else there is a TypeError naming the door; a setup whose
    allocator, device or ownership a pool would replace with its own (SGLang's
    ``allocator_type=``, ``device=``) is a ValueError naming the field."""
    setup = fake_host_setup(tmp_path)
    with pytest.raises(TypeError, match=rf"^MHATokenToKVPoolHost\.__init__\(\) got an unexpected keyword argument "
                                        f"'{keyword}'"):
        MHATokenToKVPoolHost(_device(), 2.0, 0, 4, "page_first", host=setup, **{keyword: None})
    with pytest.raises(TypeError, match="options= takes a hicache.pools.HostPoolOptions"):
        MHATokenToKVPoolHost(_device(), 2.0, 0, 4, "page_first", host=setup, options={"progressive": True})
    with pytest.raises(TypeError, match="host= takes a hicache.effects.HostSetup"):
        MHATokenToKVPoolHost(_device(), 2.0, 0, 4, "page_first", host={"runtime": setup.runtime})
    for field, value in (("allocator", HostTensorAllocator()), ("device", "cuda"), ("owns_memory", False)):
        with pytest.raises(ValueError, match=rf"host=HostSetup\({field}=.*leave HostSetup\.{field} at"):
            MHATokenToKVPoolHost(_device(), 2.0, 0, 4, "page_first", host=attrs.evolve(setup, **{field: value}))
    assert setup.runtime.held() == set() and setup.runtime.cudart.log == []


def test_a_pools_settings_come_in_one_value():
    """``options=HostPoolOptions(progressive=True, max_stall_s=None, hugepages="off")`` reaches
    the pool's bring-up: it is progressive, with one call per planned chunk, on 4 KiB pages."""
    from hicache.pools import HostPoolOptions

    runtime = FakeRuntime()
    pool = MHATokenToKVPoolHost(_device(), 2.0, 0, 4, "page_first",
                                host=HostSetup(runtime=runtime, machine=fake_machine(available_bytes=100 * GB)),
                                options=HostPoolOptions(progressive=True, max_stall_s=None, hugepages="off"))
    try:
        assert pool.progressive is True and pool.max_stall_s is None and pool.hugepages == "off"
        assert pool.wait_ready(timeout=60) is True
    finally:
        pool.destroy()


@pytest.mark.parametrize("keyword", ["runtime", "machine", "lock", "ledger", "turnstile", "host_memory_bytes",
                                     "ranks_per_host", "reserve_bytes", "progress", "prefault_progress", "trace",
                                     "allocator", "owns_memory", "device", "dtypes", "register", "flags",
                                     "retry_halvings", "pools"])
def test_bring_up_takes_the_host_and_the_report_as_one_value_each(tmp_path, keyword):
    """`bring_up(host=setup)` brings a plan up with the setup's pieces; each of the eighteen
    keywords that once spelt a piece of the host, the memory, the requests or the report is now
    Python's TypeError naming it (issue #55: one door per concern), before any memory is taken."""
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


def test_bring_up_takes_its_memory_from_the_setups_allocator(tmp_path):
    """``HostSetup(allocator=)`` is where the buffers come from: they are that allocator's while
    the handle holds them and freed at release; with ``owns_memory=False`` release leaves them to
    their owner."""
    plan = plan_pool(_device_layout(), Limits(chunk_limit_bytes=1 << 20, os_page_bytes=4096))
    for owns in (True, False):
        allocator = HostTensorAllocator()
        handle = bring_up(plan, host=fake_host_setup(tmp_path, allocator=allocator, owns_memory=owns))
        assert [t.data_ptr() for t in handle.tensors] == [buffer.ptr for buffer in allocator.owned()]
        handle.release()
        assert bool(allocator.owned()) is not owns, owns
        allocator.free_all()


def test_the_requests_say_the_dtypes_and_what_is_registered(tmp_path):
    """`BufferRequest.of_pool(plan, dtypes, register=False)` is a plan's buffers as typed tensors,
    brought up unregistered; a request list mixing BufferRequests and PoolPlans is a PlanError
    naming the item, before any memory."""
    plan = plan_pool(_device_layout(), Limits(chunk_limit_bytes=1 << 20, os_page_bytes=4096))
    requests = BufferRequest.of_pool(plan, [torch.float16] * len(plan.buffers), register=False)
    setup = fake_host_setup(tmp_path)
    handle = bring_up(requests, host=setup)
    try:
        assert [t.dtype for t in handle.tensors] == [torch.float16] * len(plan.buffers)
        assert [tuple(t.shape) for t in handle.tensors] == [b.spec.shape for b in plan.buffers]
        assert setup.runtime.cudart.log == []  # nothing registered
    finally:
        handle.release()
    with pytest.raises(PlanError, match="dtypes for"):
        BufferRequest.of_pool(plan, [torch.float16] * (len(plan.buffers) + 1))
    with pytest.raises(PlanError, match="not both: item 1"):
        bring_up([plan, requests[0]], host=setup)
    assert setup.runtime.cudart.log == []


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


class _Server(NoServer):
    """A serving process with a stated io backend and a host-memory budget in force."""

    name = "test-server"

    def __init__(self, *, backend=None, allowance=None) -> None:
        self.backend, self.allowance, self.settled = backend, allowance, []

    def io_backend(self):
        return self.backend

    def book_host_memory(self, nbytes):
        return self.allowance

    def host_memory_settled(self, nbytes, *, up):
        self.settled.append((nbytes, up))


def test_a_pool_asks_its_own_setups_server(tmp_path):
    """The server's scope comes with the pool's `HostSetup` (issue #55 item 3): a pool given
    ``HostSetup(server=...)`` asks that server - its io backend refused at build, its budget in
    force and settled - and a pool given none asks none."""
    from hicache.errors import LayoutError

    setup = fake_host_setup(tmp_path)
    with pytest.raises(LayoutError, match="io_backend 'npu-kernel'"):
        MHATokenToKVPoolHost(_device(), 2.0, 0, 4, "page_first", host=attrs.evolve(setup, server=_Server(backend="npu-kernel")))
    short = _Server(allowance=1000)
    with pytest.raises(CapacityError, match="the test-server process's budget in force has"):
        MHATokenToKVPoolHost(_device(), 2.0, 0, 4, "page_first", host=attrs.evolve(setup, server=short))
    roomy = _Server(allowance=10**9)
    pool = MHATokenToKVPoolHost(_device(), 2.0, 0, 4, "page_first", host=attrs.evolve(setup, server=roomy))
    try:
        assert pool.host_setup.server is roomy and roomy.settled == [(pool.pool_plan.total_bytes, True)]
    finally:
        pool.destroy()
    pool = MHATokenToKVPoolHost(_device(), 2.0, 0, 4, "page_first", host=setup)
    try:
        assert isinstance(pool.host_setup.server, NoServer) and pool.host_setup.server.name == "none"
    finally:
        pool.destroy()
    assert setup.runtime.held() == set()


def test_a_class_made_by_with_host_scopes_its_pools_to_its_setup(tmp_path):
    """`with_host(cls, setup)` - what the plug-in gives SGLang, which cannot pass ``host=`` - is
    ``cls`` under its own name whose pools take ``setup`` where their call names no ``host=``
    and its server where the one named has none; ``NO_SERVER`` named still wins. No
    process-wide setting is read or written."""
    from hicache.errors import LayoutError
    from hicache.pools import NO_SERVER, server, with_host

    setup = fake_host_setup(tmp_path)
    roomy = _Server(allowance=10**9)
    served = with_host(MHATokenToKVPoolHost, attrs.evolve(setup, server=roomy))
    assert issubclass(served, MHATokenToKVPoolHost) and served is not MHATokenToKVPoolHost
    assert (served.__name__, served.__module__) == ("MHATokenToKVPoolHost", MHATokenToKVPoolHost.__module__)
    pool = served(_device(), 2.0, 0, 4, "page_first")  # no host=: the class's whole setup (its fake runtime)
    try:
        assert pool.host_setup.server is roomy and pool.runtime is setup.runtime
        assert roomy.settled == [(pool.pool_plan.total_bytes, True)]
    finally:
        pool.destroy()
    refusing = with_host(MHATokenToKVPoolHost, HostSetup(server=_Server(backend="npu-kernel")))
    with pytest.raises(LayoutError, match="io_backend 'npu-kernel'"):  # host= without a server: the class's
        refusing(_device(), 2.0, 0, 4, "page_first", host=setup)
    pool = refusing(_device(), 2.0, 0, 4, "page_first", host=attrs.evolve(setup, server=NO_SERVER))
    pool.destroy()
    assert server() is NO_SERVER and setup.runtime.held() == set()


def test_with_host_refuses_what_is_not_a_pool_class_or_a_pools_setup():
    """`with_host` names what it refuses, before any class is made: a class that is not a host
    pool, a setup that is not a `HostSetup`, and a setup that names its own memory source (a
    pool's comes from its ``allocator_type=`` and ``device=``)."""
    from hicache.pools import with_host

    with pytest.raises(TypeError, match="takes a hicache host pool class, got <class 'int'>"):
        with_host(int, HostSetup())
    with pytest.raises(TypeError, match="takes a hicache.effects.HostSetup, got dict"):
        with_host(MHATokenToKVPoolHost, {})
    with pytest.raises(ValueError, match=r"with_host\(MHATokenToKVPoolHost\) HostSetup\(device='cuda'\)"):
        with_host(MHATokenToKVPoolHost, HostSetup(device="cuda"))


def test_serve_in_is_a_deprecated_shim_that_still_serves(tmp_path):
    """`serve_in` (the plug-in's process-wide setting before issue #55 item 3) warns that it is
    deprecated and still does what it did for an outside caller: a pool whose ``host=`` and
    class name no server asks the one it handed in; one that names a server asks that."""
    from hicache.errors import LayoutError
    from hicache.pools import NO_SERVER, serve_in

    setup = fake_host_setup(tmp_path)
    with pytest.warns(DeprecationWarning, match=r"serve_in\(\) is deprecated"):
        previous = serve_in(_Server(backend="npu-kernel"))
    try:
        with pytest.raises(LayoutError, match="io_backend 'npu-kernel'"):
            MHATokenToKVPoolHost(_device(), 2.0, 0, 4, "page_first", host=setup)
        pool = MHATokenToKVPoolHost(_device(), 2.0, 0, 4, "page_first", host=attrs.evolve(setup, server=NO_SERVER))
        pool.destroy()
    finally:
        with pytest.warns(DeprecationWarning):
            serve_in(previous)
    assert setup.runtime.held() == set()


def test_an_allocator_still_holding_another_bring_ups_memory_is_refused(tmp_path):
    """A handle frees everything its allocator holds, so an allocator still holding a live
    handle's buffers is refused for a second bring-up (a PlanError naming the field), before
    any memory; once the first is released it serves again, and ``owns_memory=False`` (memory
    someone else frees) may share it."""
    plan = plan_pool(_device_layout(), Limits(chunk_limit_bytes=1 << 20, os_page_bytes=4096))
    allocator = HostTensorAllocator()
    first = bring_up(plan, host=fake_host_setup(tmp_path, allocator=allocator))
    held = allocator.owned()
    try:
        other = fake_host_setup(tmp_path, allocator=allocator)
        with pytest.raises(PlanError, match=r"HostSetup\.allocator=.* already holds 1 buffer"):
            bring_up(plan, host=other)
        assert other.runtime.cudart.log == [] and allocator.owned() == held
        shared = bring_up(plan, host=fake_host_setup(tmp_path, allocator=allocator, owns_memory=False))
        shared.release()
    finally:
        first.release()
    assert allocator.owned() == []
    bring_up(plan, host=fake_host_setup(tmp_path, allocator=allocator)).release()


@pytest.mark.parametrize("call, refusal", [
    (lambda setup: bring_up(5, host=setup), "bring_up(requests) takes BufferRequests or PoolPlans (one PoolPlan, or a "
                                            "list), got 5"),
    (lambda setup: bring_up([], host={"runtime": setup.runtime}), "bring_up(host=) must be a HostSetup or None, got {"),
    (lambda setup: bring_up([], host=setup, report="quiet"), "bring_up(report=) must be a Report or None, got 'quiet'"),
    (lambda setup: bring_up([], host=setup, budget="no"), "bring_up.budget must be True or False, got 'no'"),
], ids=["requests", "host", "report", "budget"])
def test_bring_ups_own_arguments_are_checked_before_anything_is_held(tmp_path, call, refusal):
    """A requests value that is no list or plan, a host that is no HostSetup, a report that is no
    Report and a budget switch that is no bool (``"no"`` was truthy: budgeted) are each a
    PlanError naming it - they failed as a bare TypeError or AttributeError - and nothing is held."""
    setup = fake_host_setup(tmp_path)
    with pytest.raises(PlanError, match=re.escape(refusal)):
        call(setup)
    assert setup.runtime.cudart.log == [] and setup.runtime.held() == set()
