"""A bring-up handle's books and what it says of itself (hicache.effects' `_bringup._handle`): what
counts as holding something (a handle dropped holding nothing is let go without a word), the
server hearing that a failed bring-up failed, the release's seconds, the budget claims it reads,
its record (page tiers by default, a progressive one's pre-fault and register seconds), the
metrics told of a release only once it released, and detach - active and not progressive only,
its metrics snapshot taken while the handle still held its memory. And of `bring_up` around it: an
unregistered buffer budgeted by its dtype's bytes, a progressive one refusing any unplanned buffer,
its phases' seconds, the host's turnstile left as often as joined however the bring-up ends."""

from __future__ import annotations

import os
import time
import types
import warnings

import attrs
import pytest
from machine import ROOMY

from hicache.effects import BudgetLock, BufferRequest, HostLedger, HostSetup, HostTensorAllocator, Progressive
from hicache.effects import bring_up
from hicache.effects._bringup import _bring_up, _handle, _report  # the rooms under test
from hicache.effects._hostwide import _turnstile
from hicache.errors import ApplyError, RegistrationStateError, ReleaseError
from hicache.plan import Limits, plan_registration
from hicache.testing import FakeCudart, FakeRuntime

pytestmark = pytest.mark.concurrency  # background registration and pre-fault threads: `make test-loaded`

pytest.importorskip("torch")
MiB = 2**20


def _requests(total: int = 8 * MiB) -> list[BufferRequest]:
    plan = plan_registration(total, granularity_bytes=64 * 1024, limits=Limits(chunk_limit_bytes=4 * MiB))
    return [BufferRequest("kv", (total,), None, plan)]


def _host(tmp_path, runtime=None, **fields) -> HostSetup:
    return HostSetup(runtime=runtime or FakeRuntime(), machine=ROOMY, turnstile=None, allocator=HostTensorAllocator(),
                     lock=BudgetLock(tmp_path), **fields)


def test_what_counts_as_holding_something():
    """The books hold something exactly when they have a registration, a progressive one, tensors,
    a claim not yet given back or buffers the allocator owns - what decides whether a handle
    dropped on the floor is released with a warning or let go without a word."""
    class Owning:
        def owned(self):
            return ["a buffer"]

    books = _handle._Books(HostTensorAllocator(), HostLedger(), True)
    assert not books.holds_anything()
    for field, value in (("registration", object()), ("progressive", object()), ("tensors", ["t"]),
                         ("claim", types.SimpleNamespace(closed=False))):
        held = _handle._Books(HostTensorAllocator(), HostLedger(), True)
        setattr(held, field, value)
        assert held.holds_anything(), field
    given_back = _handle._Books(HostTensorAllocator(), HostLedger(), True)
    given_back.claim = types.SimpleNamespace(closed=True)
    assert not given_back.holds_anything()
    assert _handle._Books(Owning(), HostLedger(), True).holds_anything()


def test_a_failed_bring_up_is_settled_as_failed_with_the_servers_budget(tmp_path):
    """Under a server's budget scope, a bring-up whose register call fails is undone and the
    server hears that its booking failed (not that it came up)."""
    from test_host_setup import _Server  # the suite's one stand-in for a server's scope

    scope, runtime = _Server(allowance=10**12), FakeRuntime(fail_register={1: 1})
    with pytest.raises(ApplyError):
        bring_up(_requests(), mode="blocking", host=_host(tmp_path, runtime, server=scope))
    assert scope.settled == [(8 * MiB, False)] and runtime.held() == set()


def test_a_release_says_how_long_it_took(tmp_path):
    """`timings["release_s"]` is the release's own seconds: at least 0, at most the wall time
    around the call."""
    handle = bring_up(_requests(), mode="blocking", host=_host(tmp_path))
    before = time.perf_counter()
    handle.release()
    wall = time.perf_counter() - before
    assert 0 <= handle.timings["release_s"] <= wall


def test_the_budget_claims_are_the_hosts_and_none_without_a_budget(tmp_path):
    """A budgeted handle reads the host's claims from the budget file (this process's among them
    while it holds its memory); a handle brought up without the budget reads none."""
    handle = bring_up(_requests(), mode="blocking", host=_host(tmp_path))
    try:
        assert handle.budget_claims().get(os.getpid()) == 8 * MiB
    finally:
        handle.release()
    unbudgeted = bring_up(_requests(), mode="blocking", host=_host(tmp_path / "other"), budget=False)
    try:
        assert unbudgeted.budget_claims() == {}
    finally:
        unbudgeted.release()


def test_a_record_reads_the_page_tiers_by_default_and_counts_a_progressive_ones_seconds(tmp_path):
    """`record()` reads each buffer's page tiers unless told not to; a progressive bring-up's
    record has its background pre-fault's seconds and its calls' seconds as the register time."""
    handle = bring_up(_requests(), mode="blocking", host=_host(tmp_path))
    try:
        assert [name for name, _ in handle.record().tiers] == ["kv"]
        assert handle.record(tiers=False).tiers == ()
    finally:
        handle.release()
    slow = FakeRuntime(FakeCudart(register_bytes_per_s=4e9))  # each call takes a measurable time
    progressive = bring_up(_requests(), mode=Progressive(max_stall_s=None), host=_host(tmp_path / "p", slow))
    try:
        assert progressive.wait(60)
        faulter = progressive._books.faulting.faulter  # the background pre-fault: every byte is resident now,
        faulter.join()  # and its thread ends (an event, not a delay)
        record = progressive.record(tiers=False)
        assert record.prefault_s == faulter.elapsed() > 0  # all of it: not only up to the first call
        assert record.register_s == pytest.approx(sum(seconds for _, _, seconds in progressive.calls))
        assert record.register_s > 0 and "register_s" not in progressive.timings
    finally:
        progressive.release()


def test_the_metrics_hear_of_a_release_only_once_it_released(tmp_path, monkeypatch):
    """A release that leaves a range registered (its unregister failed) is not reported as
    released; the retry that unregisters it is, once."""
    heard = []
    monkeypatch.setattr(_report, "released", lambda report, handle=None: heard.append(handle.state))
    handle = bring_up(_requests(), mode="blocking", host=_host(tmp_path, FakeRuntime(fail_unregister={0: 1})))
    with pytest.raises(ReleaseError):
        handle.release()
    assert heard == [] and handle.state == "leaked"
    handle.release()
    assert heard == ["released"]


def test_detach_hands_over_only_an_active_whole_registration_with_its_snapshot(tmp_path, monkeypatch):
    """detach() takes the metrics' snapshot while the handle still holds its memory and hands it
    on with the registration; a progressive handle, or one no longer active, is refused."""
    snapshot, followed = object(), []
    monkeypatch.setattr(_report, "before_detach", lambda report, handle: snapshot if handle.tensors else None)
    monkeypatch.setattr(_report, "detached", lambda report, registration, taken: followed.append((registration, taken)))
    runtime = FakeRuntime()
    handle = bring_up(_requests(), mode="blocking", host=_host(tmp_path, runtime))
    registration = handle.detach()
    try:
        assert followed == [(registration, snapshot)] and handle.state == "released"
        with pytest.raises(RegistrationStateError, match="that is released"):
            handle.detach()
    finally:
        registration.release()
    progressive = bring_up(_requests(), mode=Progressive(max_stall_s=None), host=_host(tmp_path / "p"))
    try:
        with pytest.raises(RegistrationStateError, match="progressive HostPools handle that is active"):
            progressive.detach()
    finally:
        progressive.release()
    assert runtime.held() == set() and followed == [(registration, snapshot)]


def test_a_handle_dropped_before_it_held_anything_is_let_go_without_a_word():
    """A handle collected while still bringing up but holding nothing yet is marked released and
    says nothing (one holding memory is released with a ResourceWarning: test_finalizer_threads)."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        handle = _handle.HostPools(_requests(), HostTensorAllocator(), HostLedger(), owns_memory=True, nbytes=[8 * MiB])
        books = handle._books
        del handle
        assert books.state == "released"
    assert not [w for w in caught if issubclass(w.category, ResourceWarning)]


def test_an_unregistered_buffer_is_budgeted_by_its_dtypes_bytes(tmp_path):
    """A request without a plan (allocated, not registered) counts its elements times its dtype's
    size - a float16 buffer of 1,024 elements is 2,048 bytes to the budget, not 1,024."""
    import torch

    requests = [BufferRequest("half", (1024,), torch.float16, None), BufferRequest("bytes", (1024,), None, None)]
    handle = bring_up(requests, mode="blocking", host=_host(tmp_path))
    try:
        assert handle.total_bytes == 3 * 1024 and handle.budget_claims().get(os.getpid()) == 3 * 1024
    finally:
        handle.release()


def test_a_progressive_bring_up_with_any_buffer_unplanned_is_refused_before_any_memory(tmp_path):
    """Progressive registers every buffer: one request without a plan among planned ones is a
    PlanError saying so, before anything is mapped or registered."""
    from hicache.errors import PlanError

    runtime, allocator = FakeRuntime(), HostTensorAllocator()
    requests = _requests() + [BufferRequest("plain", (4096,), None, None)]
    with pytest.raises(PlanError, match="each request needs a plan"):
        bring_up(requests, mode=Progressive(max_stall_s=None),
                 host=HostSetup(runtime=runtime, machine=ROOMY, turnstile=None, allocator=allocator,
                                lock=BudgetLock(tmp_path)))
    assert runtime.cudart.log == [] and allocator.owned() == []


def test_a_bring_up_says_how_long_its_phases_took(tmp_path):
    """`allocate_prefault_s` and `ready_s` are seconds since the bring-up started: at least 0,
    the first no more than the second, the second no more than the wall time around the call."""
    before = time.perf_counter()
    handle = bring_up(_requests(), mode="blocking", host=_host(tmp_path))
    wall = time.perf_counter() - before
    try:
        assert 0 <= handle.timings["allocate_prefault_s"] <= handle.timings["ready_s"] <= wall
    finally:
        handle.release()


def test_a_bring_up_leaves_the_hosts_turnstile_as_often_as_it_joined_however_it_ends(tmp_path, monkeypatch):
    """With a turnstile, a bring-up is one of the host's registrants from its start (its transaction
    too, inside it) and leaves once it is up - once, also when an interrupt lands after that (its
    undo must not leave again: another process's pacing counts the members)."""
    log = []

    class Counting(_turnstile.Turnstile):
        def join(self):
            log.append("join")
            return super().join()

        def leave(self):
            log.append("leave")
            return super().leave()

    turnstile = Counting(tmp_path / "turns", poll_s=0.0005)
    host = HostSetup(runtime=FakeRuntime(), machine=ROOMY, turnstile=turnstile, allocator=HostTensorAllocator(),
                     lock=BudgetLock(tmp_path))
    bring_up(_requests(), mode="blocking", host=host).release()
    assert log == ["join", "join", "leave", "leave"]  # the bring-up, and inside it the transaction

    def interrupted(report, handle):
        raise KeyboardInterrupt  # a Ctrl-C after the bring-up left the turnstile, before it returned

    monkeypatch.setattr(_report, "shown", interrupted)
    log.clear()
    runtime = FakeRuntime()
    with pytest.raises(KeyboardInterrupt):
        bring_up(_requests(), mode="blocking",
                 host=attrs.evolve(host, runtime=runtime, allocator=HostTensorAllocator()))
    assert log == ["join", "join", "leave", "leave"] and runtime.held() == set()


def test_a_pool_bound_to_a_node_reads_its_cpus_where_the_machine_facts_lack_them(monkeypatch):
    """Pre-fault placement (issue #35 item 2) with machine facts that do not list the nodes' CPUs:
    a pool bound to node 1 reads them from sysfs and runs its threads on node 1's CPUs; a pool
    bound nowhere reads nothing and is not pinned."""
    from machine import facts

    read = []

    def node_cpus():
        read.append(True)
        return ((0, (0, 1)), (1, (2, 3)))

    monkeypatch.setattr(_bring_up, "node_cpus", node_cpus)
    machine = facts(numa_node_cpus=(), cpus=(0, 1, 2, 3), ranks_per_host=1)
    bound = _bring_up._share(types.SimpleNamespace(numa_node=1, prefault_threads=None), machine, None)
    assert (bound.node, bound.cpus, bound.threads) == (1, (2, 3), 2) and read == [True]
    unbound = _bring_up._share(types.SimpleNamespace(numa_node=None, prefault_threads=None), machine, None)
    assert (unbound.node, unbound.cpus, unbound.threads) == (None, None, 4) and read == [True]
