"""The host's registration turnstile (issue #21 item 1): processes sharing the runtime directory
take turns at the driver - at most HICACHE_PIN_CONCURRENCY register calls in flight, in arrival
order, paced to the stall budget; a dead holder never blocks; threads re-enter; Ctrl-C and a
stop leave the queue.

Several processes against a fake driver whose lock is host-wide (a ``flock``, as the real
driver's hold is) and a shared call log; threads in this process for the finer laws. No test
judges seconds (issue #31): overlap and waiting come from the log's order of events - a call's
queueing, its end, a probe's arrival - and from tickets and barriers; a deadline is only a hang
guard. They hold beside six busy processes (`make test-loaded`)."""

from __future__ import annotations

import fcntl
import json
import os
import signal
import sys
import threading
import time
from pathlib import Path

import pytest
from machine import ROOMY

from hicache.effects import BufferRequest, HostPools, Progressive, apply_plan, bring_up
from hicache.effects import HostSetup
from hicache.effects._hostwide import _turnstile
from hicache.effects._hostwide._turnstile import FIRST_CALL_BYTES, Turnstile, from_env
from hicache.errors import ApplyError, EnvError, PlanError, caused_by_interrupt
from hicache.plan import Limits, plan_registration
from hicache.testing import FakeCudart, FakeRuntime

pytestmark = pytest.mark.concurrency  # processes, threads, signals or waits: `make test-loaded`

MiB = 2**20
CHILD = Path(__file__).parent / "turnstile_child.py"


@pytest.fixture
def directory(tmp_path) -> Path:
    path = tmp_path / "run"
    path.mkdir(mode=0o700)
    return path


def _tickets(directory: Path) -> list[str]:
    return sorted(n for n in os.listdir(directory / "turnstile") if n.startswith("t."))


def _max_overlap(intervals) -> int:
    """The most intervals in flight at one instant (an end before a start at the same time)."""
    events = sorted([(s, 1) for s, _ in intervals] + [(e, -1) for _, e in intervals], key=lambda x: (x[0], x[1]))
    running = most = 0
    for _, step in events:
        running += step
        most = max(most, running)
    return most


# --- the environment -----------------------------------------------------------------------

def test_the_environment_chooses_the_turnstile(directory):
    """HICACHE_PIN_CONCURRENCY and HICACHE_PIN_MAX_STALL_S choose the turnstile: auto by default, N
    calls, or off."""
    auto = from_env({}, directory=directory)
    assert (auto.concurrency, auto.auto, auto.max_stall_s) == (1, True, 0.25)
    assert from_env({"HICACHE_PIN_CONCURRENCY": "auto"}, directory=directory).auto
    three = from_env({"HICACHE_PIN_CONCURRENCY": " 3 ", "HICACHE_PIN_MAX_STALL_S": "0.5"}, directory=directory)
    assert (three.concurrency, three.auto, three.max_stall_s) == (3, False, 0.5)
    for off in ("off", "0", "OFF", "false"):
        assert from_env({"HICACHE_PIN_CONCURRENCY": off}, directory=directory) is None


@pytest.mark.parametrize("name, value", [
    ("HICACHE_PIN_CONCURRENCY", "abc"), ("HICACHE_PIN_CONCURRENCY", "-1"), ("HICACHE_PIN_CONCURRENCY", "1.5"),
    ("HICACHE_PIN_MAX_STALL_S", "x"), ("HICACHE_PIN_MAX_STALL_S", "0"), ("HICACHE_PIN_MAX_STALL_S", "inf"),
])
def test_a_bad_setting_is_an_error_naming_it_before_anything_is_held(monkeypatch, name, value):
    """A bad turnstile setting is an EnvError naming it before any memory is taken."""
    monkeypatch.setenv(name, value)
    allocations = []

    class Refusing:
        can_map_unfaulted = False

        def allocate(self, *args, **kwargs):  # pragma: no cover - the error comes first
            allocations.append(args)
            raise AssertionError("allocated")

    with pytest.raises(EnvError, match=f"{name}={value!r}"):
        bring_up([BufferRequest("kv", (4096,), None, plan_registration(4096, granularity_bytes=4096,
                                                                         limits=Limits(chunk_limit_bytes=4096)))],
                 host=HostSetup(runtime=FakeRuntime(), machine=ROOMY, allocator=Refusing()))
    assert allocations == []


def test_bad_constructor_values_name_the_field(directory):
    """Bad Turnstile constructor values and a bad turnstile= are PlanErrors naming the field."""
    with pytest.raises(PlanError, match="concurrency"):
        Turnstile(directory, concurrency=0)
    with pytest.raises(PlanError, match="max_stall_s"):
        Turnstile(directory, max_stall_s=float("nan"))
    with pytest.raises(PlanError, match="turnstile must be"):
        _turnstile.resolve("on")


# --- turns between threads -----------------------------------------------------------------

@pytest.mark.parametrize("concurrency", [1, 2])
def test_threads_never_hold_more_turns_than_allowed(directory, concurrency):
    """Threads taking turns never hold more than the concurrency at once, use all of it, and leave
    no ticket."""
    turnstile = Turnstile(directory, concurrency=concurrency, poll_s=0.0005)
    intervals, lock = [], threading.Lock()

    def worker():
        for _ in range(15):
            turn = turnstile.acquire()
            start = time.monotonic()
            time.sleep(0.003)
            end = time.monotonic()
            turn.release()
            with lock:
                intervals.append((start, end))

    threads = [threading.Thread(target=worker, daemon=True) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(intervals) == 60
    assert _max_overlap(intervals) == concurrency  # never more, and the allowance is used
    assert _tickets(directory) == []


def test_turns_go_in_arrival_order(directory):
    """Turns are given in the order the waiters arrived."""
    turnstile = Turnstile(directory, poll_s=0.0005)
    first = turnstile.acquire()
    order = []

    def waiter(name):
        turn = turnstile.acquire()
        order.append(name)
        turn.release()

    threads = []
    for name in "abcd":
        threads.append(threading.Thread(target=waiter, args=(name,), daemon=True))
        threads[-1].start()
        deadline = time.monotonic() + 10
        while len(_tickets(directory)) < len(threads) + 1:  # its ticket is taken before the next arrives
            assert time.monotonic() < deadline
            time.sleep(0.001)
    first.release()
    for t in threads:
        t.join(10)
    assert order == list("abcd")


def test_a_thread_that_holds_a_turn_re_enters_it_and_others_wait(directory):
    """A thread holding a turn re-enters it without a second ticket while other threads wait."""
    turnstile = Turnstile(directory, poll_s=0.0005)
    outer = turnstile.acquire()
    deadline = time.monotonic() + 2
    inner = turnstile.acquire(stop=lambda: time.monotonic() > deadline)  # not re-entrant: it waits for itself
    assert inner is outer and _tickets(directory) == [outer.name]
    got = threading.Event()
    other = threading.Thread(target=lambda: (turnstile.acquire().release(), got.set()), daemon=True)
    other.start()
    inner.release()
    assert not got.wait(0.1)  # the outer turn still holds
    outer.release()
    assert got.wait(10)
    other.join()


def test_a_stopped_wait_gives_its_place_up(directory):
    """A wait told to stop returns None and gives its place in the queue up."""
    turnstile = Turnstile(directory, poll_s=0.0005)
    held = turnstile.acquire()
    stop = threading.Event()
    result = []
    waiter = threading.Thread(target=lambda: result.append(turnstile.acquire(stop=stop.is_set)), daemon=True)
    waiter.start()
    while len(_tickets(directory)) < 2:
        time.sleep(0.001)
    stop.set()
    waiter.join(10)
    assert result == [None] and _tickets(directory) == [held.name]
    held.release()
    assert _tickets(directory) == []


def test_a_ticket_whose_holder_died_does_not_count(directory):
    """A holder that dies lets its lock go with it; the next waiter removes its ticket. Dying
    is what closing the ticket's file without giving it back looks like from outside."""
    turnstile = Turnstile(directory, poll_s=0.0005)
    name, fd = turnstile._core.enqueue()
    os.close(fd)  # the process "died": the kernel dropped its lock, its ticket file stays
    turnstile._core.open_fds.discard(fd)
    done = []
    waiter = threading.Thread(target=lambda: done.append(turnstile.acquire()), daemon=True)
    waiter.start()
    waiter.join(10)
    assert done and done[0] is not None
    done[0].release()
    assert name not in os.listdir(directory / "turnstile")


def test_a_dropped_turn_lets_go_when_collected(directory):
    """A turn dropped without release lets go of its ticket when collected."""
    turnstile = Turnstile(directory)
    turn = turnstile.acquire()
    turnstile._core.local.turn = None  # as if its thread ended holding it
    del turn
    import gc

    gc.collect()
    assert _tickets(directory) == []


# --- the executor and the bring-up ---------------------------------------------------------

BASE = 1 << 40  # the fake driver never touches memory: any aligned address serves


def _forced(directory, **kw) -> Turnstile:
    return Turnstile(directory, auto=False, **kw)


def test_every_call_is_paced_to_the_stall_budget_at_the_measured_rate(directory):
    """Every call after the first is cut to what the measured rate registers within the stall
    budget, and the calls still cover the plan."""
    rate, stall = 4e9, 0.02
    plan = plan_registration(512 * MiB, granularity_bytes=4096, limits=Limits(chunk_limit_bytes=256 * MiB))
    cudart = FakeCudart(register_bytes_per_s=rate)
    registration = apply_plan(plan, base_ptr=BASE, runtime=FakeRuntime(cudart), turnstile=_forced(directory, max_stall_s=stall))
    sizes = [size for _, _, size, _, _ in cudart.timeline]
    assert sizes[0] <= FIRST_CALL_BYTES  # the rate is unknown before the first call
    assert all(size <= rate * stall + 4096 for size in sizes[1:])  # the measured rate never beats the fake's
    assert len(sizes) > 2 * len(plan.ranges) and sum(sizes) == plan.total_bytes
    starts = [ptr for _, ptr, _, _, _ in cudart.timeline]
    assert starts == sorted(starts) and all(a + s == b for a, s, b in zip(starts, sizes, starts[1:]))
    assert {(r.ptr, r.size) for r in registration.ranges} == cudart.held()
    registration.release()
    assert cudart.registered == {} and _tickets(directory) == []


def test_auto_paces_only_while_another_process_brings_up_pools(directory):
    """auto leaves calls whole when the process is alone and paces them while another process brings
    up pools."""
    plan = plan_registration(64 * MiB, granularity_bytes=4096, limits=Limits(chunk_limit_bytes=32 * MiB))
    turnstile = Turnstile(directory, auto=True, max_stall_s=0.002)  # 4 MB a call at the fake's 2 GB/s
    alone = FakeCudart(register_bytes_per_s=2e9)
    apply_plan(plan, base_ptr=BASE, runtime=FakeRuntime(alone), turnstile=turnstile).release()
    assert [size for _, _, size, _ in (c for c in alone.log if c[0] == "register")] == [32 * MiB, 32 * MiB]
    # another member: a process bringing up pools holds m.<pid> locked (its own open file)
    other = os.open(directory / "turnstile" / "m.999999999", os.O_RDWR | os.O_CREAT, 0o600)
    fcntl.flock(other, fcntl.LOCK_EX)
    time.sleep(_turnstile.OTHERS_EVERY_S)  # auto looks for others at most this often
    try:
        assert turnstile.paces()
        shared = FakeCudart(register_bytes_per_s=2e9)
        apply_plan(plan, base_ptr=BASE, runtime=FakeRuntime(shared), turnstile=turnstile).release()
        assert len([c for c in shared.log if c[0] == "register"]) > 8
    finally:
        os.close(other)  # the other process ended: its member file no longer counts
    time.sleep(_turnstile.OTHERS_EVERY_S)
    assert not turnstile.paces()
    assert "m.999999999" not in os.listdir(directory / "turnstile")


def test_a_ctrl_c_while_waiting_for_a_turn_registers_nothing_and_leaves_the_queue(directory):
    """Ctrl-C while waiting for a turn registers nothing and leaves the queue."""
    turnstile = _forced(directory, poll_s=0.0005)
    holder = turnstile.acquire()
    plan = plan_registration(8 * MiB, granularity_bytes=4096, limits=Limits(chunk_limit_bytes=8 * MiB))
    cudart = FakeCudart()

    def hold_then_interrupt():
        while len(_tickets(directory)) < 2:
            time.sleep(0.001)
        os.kill(os.getpid(), signal.SIGINT)  # to the main thread, waiting for its turn

    # the holder is this thread's: wait in the main thread from a turn held by another thread
    turnstile._core.local.turn = None
    releaser = threading.Thread(target=hold_then_interrupt, daemon=True)
    releaser.start()
    with pytest.raises((ApplyError, KeyboardInterrupt)) as caught:
        apply_plan(plan, base_ptr=BASE, runtime=FakeRuntime(cudart), turnstile=turnstile)
    releaser.join()
    assert caused_by_interrupt(caught.value)
    assert cudart.register_calls == 0 and cudart.registered == {}
    assert _tickets(directory) == [holder.name]
    holder.release()


def test_a_ctrl_c_landing_in_a_plain_wait_for_a_turn_gives_the_ticket_back(directory):
    """Outside the executor (no held Ctrl-C), a real SIGINT raises inside the wait itself: the
    interrupted waiter's ticket goes with it, and the holder's stays."""
    turnstile = _forced(directory, poll_s=0.0005)
    holder = turnstile.acquire()
    turnstile._core.local.turn = None  # held "by another thread": this one waits behind it

    def interrupt_once_queued():
        while len(_tickets(directory)) < 2:
            time.sleep(0.001)
        os.kill(os.getpid(), signal.SIGINT)

    sender = threading.Thread(target=interrupt_once_queued, daemon=True)
    sender.start()
    with pytest.raises(KeyboardInterrupt) as caught:
        turnstile.acquire()
    sender.join()
    # gone while the caller still holds the error (its frames keep the turn object alive): given
    # back by the wait itself, not by the garbage collector some time later
    assert caught.value is not None and _tickets(directory) == [holder.name]
    holder.release()
    assert _tickets(directory) == []


def test_a_progressive_bring_up_takes_turns_and_is_paced_by_the_host_budget(directory):
    """A progressive bring-up takes turns and paces its calls to the host's stall budget."""
    from hicache.effects import HostTensorAllocator

    plan = plan_registration(64 * MiB, granularity_bytes=4096, limits=Limits(chunk_limit_bytes=64 * MiB))
    cudart = FakeCudart(register_bytes_per_s=2e9)
    turnstile = _forced(directory, max_stall_s=0.005)  # 10 MB a call at the fake's rate
    handle = bring_up([BufferRequest("kv", (plan.total_bytes,), None, plan)], mode=Progressive(max_stall_s=None),
                      host=HostSetup(runtime=FakeRuntime(cudart), machine=ROOMY, turnstile=turnstile,
                                     allocator=HostTensorAllocator()))
    try:
        assert handle.wait(30)
        sizes = [size for _, size, _ in handle.calls]
        assert sum(sizes) == plan.total_bytes and len(sizes) > 3  # unpaced (max_stall_s=None) it is one call
        assert sizes[0] <= FIRST_CALL_BYTES and all(s <= 2e9 * 0.005 + 4096 for s in sizes[1:])
    finally:
        handle.release()
    assert _tickets(directory) == [] and cudart.registered == {}


@pytest.mark.parametrize("own_s, host_s", [(0.002, 0.02), (0.02, 0.002)])
def test_a_progressive_call_keeps_to_the_smaller_of_its_own_and_the_hosts_stall_budget(directory, own_s, host_s):
    """Both budgets bound a paced progressive call: whichever is smaller decides its size."""
    from hicache.effects import HostTensorAllocator

    rate = 2e9
    plan = plan_registration(64 * MiB, granularity_bytes=4096, limits=Limits(chunk_limit_bytes=64 * MiB))
    handle = bring_up([BufferRequest("kv", (plan.total_bytes,), None, plan)], mode=Progressive(max_stall_s=own_s),
                      host=HostSetup(runtime=FakeRuntime(FakeCudart(register_bytes_per_s=rate)), machine=ROOMY,
                                     turnstile=_forced(directory, max_stall_s=host_s), allocator=HostTensorAllocator()))
    try:
        assert handle.wait(120)
        sizes = [size for _, size, _ in handle.calls]
    finally:
        handle.release()
    assert sum(sizes) == plan.total_bytes and sizes[0] <= FIRST_CALL_BYTES
    assert all(size <= rate * min(own_s, host_s) + 4096 for size in sizes[1:]), sizes  # the measured rate never beats the fake's


@pytest.mark.parametrize("mode", ["blocking", "progressive"])
def test_a_bring_up_is_a_member_from_its_first_call_to_its_last_and_no_longer(directory, mode):
    """Auto mode sees a rank only while it is a member: a bring-up's member file is there
    (locked) at every register call, and gone once its registration is done - a progressive
    pool's when its background registration ends - so a finished rank never slows others."""
    from hicache.effects import HostTensorAllocator

    seen = []

    def announced() -> bool:  # m.<pid> there and locked (by the bring-up's own open file)
        try:
            fd = os.open(directory / "turnstile" / f"m.{os.getpid()}", os.O_RDONLY)
        except FileNotFoundError:
            return False
        try:
            return _turnstile._locked_by_someone(fd)
        finally:
            os.close(fd)

    class Watching(FakeCudart):
        def cudaHostRegister(self, ptr, size, flags):
            seen.append(announced())
            return super().cudaHostRegister(ptr, size, flags)

    plan = plan_registration(8 * MiB, granularity_bytes=4096, limits=Limits(chunk_limit_bytes=4 * MiB))
    how = "blocking" if mode == "blocking" else Progressive(max_stall_s=None)
    handle = bring_up([BufferRequest("kv", (plan.total_bytes,), None, plan)], mode=how,
                      host=HostSetup(runtime=FakeRuntime(Watching()), machine=ROOMY, turnstile=Turnstile(directory,
                                     auto=True), allocator=HostTensorAllocator()))
    try:
        assert handle.wait(120)
        _wait_for(lambda: not announced(), [], "leaving once the registration ended", 60)  # its thread leaves as it ends
        assert seen == [True, True]
    finally:
        handle.release()
    assert not [n for n in os.listdir(directory / "turnstile") if n.startswith("m.")]


def test_a_forked_child_does_not_keep_its_parents_ticket_or_member_file_alive(directory):
    """A child forked while its parent holds a ticket and is a member closes its copies of
    those files: when the parent dies (here: its own copies closed without giving anything
    back), the ticket and the membership read as dead while the child still runs."""
    turnstile = Turnstile(directory, poll_s=0.0005)
    core = turnstile._core
    core.join()
    name, fd = core.enqueue()
    read_end, write_end = os.pipe()
    ready_read, ready_write = os.pipe()
    child = os.fork()
    if child == 0:  # pragma: no cover - the child: announce itself, say how that went, wait, exit
        said = b"E"
        try:
            os.close(write_end)
            core.join()  # its own member file: not the parent's, and not skipped as if it had one
            fd2 = os.open(directory / "turnstile" / f"m.{os.getpid()}", os.O_RDONLY)
            said = b"1" if _turnstile._locked_by_someone(fd2) else b"0"
            os.close(fd2)
            core.leave()
        finally:
            os.write(ready_write, said)
            os.read(read_end, 1)
            os._exit(0)
    try:
        os.close(read_end)
        os.close(ready_write)
        assert os.read(ready_read, 1) == b"1"  # the child runs, a member of its own; what it kept open it holds now
        core.close(fd)  # the parent "died": its ticket file stays, its lock went with it
        member_fd, core.member_fd, core.members = core.member_fd, None, 0
        core.open_fds.discard(member_fd)
        os.close(member_fd)
        member = os.open(directory / "turnstile" / f"m.{os.getpid()}", os.O_RDONLY)
        try:
            assert not _turnstile._locked_by_someone(member)  # the child's copy was closed
        finally:
            os.close(member)
        got = []
        waiter = threading.Thread(target=lambda: got.append(turnstile.acquire()), daemon=True)
        waiter.start()
        waiter.join(60)  # a hang guard: a ticket the child kept alive would block it until the child ends
        assert got and got[0] is not None
        got[0].release()
        assert name not in os.listdir(directory / "turnstile")
    finally:
        os.close(write_end)
        os.close(ready_read)
        os.waitpid(child, 0)
        (directory / "turnstile" / f"m.{os.getpid()}").unlink(missing_ok=True)


def test_waits_are_counted_for_the_metrics(directory):
    """Each turnstile wait is counted in the histogram the metrics serve."""
    before = HostPools.turnstile_waits()["count"]
    plan = plan_registration(8 * MiB, granularity_bytes=4096, limits=Limits(chunk_limit_bytes=4 * MiB))
    apply_plan(plan, base_ptr=BASE, runtime=FakeRuntime(), turnstile=Turnstile(directory)).release()
    waits = HostPools.turnstile_waits()
    assert waits["count"] == before + 2 and waits["buckets"][-1] == (float("inf"), waits["count"])


# --- processes of one host -----------------------------------------------------------------

def _spawn(server, args, env):
    return server.spawn([sys.executable, str(CHILD), *args], env=env)  # forked: tests/forked.py


def _wait_for(condition, children, what: str, limit_s: float = 300) -> None:
    """Wait for ``condition()`` - a hang guard only, never an assertion about speed: a child
    that failed fails the test with its output (one that is done may exit)."""
    deadline = time.monotonic() + limit_s
    while not condition():
        for child in children:
            assert child.poll() in (None, 0), (what, child.communicate())
        assert time.monotonic() < deadline, f"hang guard: no {what} after {limit_s} s"
        time.sleep(0.01)


def _run_together(server, tmp_path, *, concurrency: str, processes: int = 4, probe: bool = True, hold_driver: bool = False):
    """``processes`` bring-ups (128 MiB, one 128 MiB call unpaced, at 512 MB/s), each announced
    to the host's turnstile before they start and until all are done (ranks that start
    together), and a probe; returns (register calls, probe calls - both from the shared log,
    queued at ``start`` -, per-process results). ``hold_driver``: this process holds the fake's
    driver lock from the start until every bring-up has a call queued for it."""
    runtime, barrier = tmp_path / "run", tmp_path / "barrier"
    runtime.mkdir(mode=0o700)
    barrier.mkdir()
    env = {**os.environ, "HICACHE_RUNTIME_DIR": str(runtime), "HICACHE_PIN_CONCURRENCY": concurrency,
           "HICACHE_PIN_MAX_STALL_S": "0.05", "PYTHONPATH": str(Path(__file__).parent.parent)}
    children = [_spawn(server, ["register", str(barrier), "128", str(512e6), "128", "together"], env) for _ in range(processes)]
    if probe:
        children.append(_spawn(server, ["probe", str(barrier)], env))
    results = lambda: [p for p in barrier.glob("result-*") if not p.name.endswith(".tmp")]  # noqa: E731
    driver = os.open(barrier / "driver.lock", os.O_RDWR | os.O_CREAT, 0o600)
    try:
        if hold_driver:
            fcntl.flock(driver, fcntl.LOCK_EX)
        _wait_for(lambda: len([p for p in barrier.glob("ready-*") if not p.name.endswith(".tmp")]) == len(children),
                  children, "barrier")
        (barrier / "go").write_text("go")
        if hold_driver:
            _wait_for(lambda: len(_queued(barrier)) == processes, children, "calls queued at the driver")
            fcntl.flock(driver, fcntl.LOCK_UN)
        _wait_for(lambda: len(results()) == processes, children, "bring-ups")
        (barrier / "done").write_text("done")
        for child in children:
            assert child.wait(timeout=120) == 0, child.communicate()
    finally:
        os.close(driver)
        for child in children:
            if child.poll() is None:
                child.kill()
            child.communicate()
    log = [json.loads(line) for line in (barrier / "calls.log").read_text().splitlines()]
    outcome = [json.loads(p.read_text()) for p in results()]
    return ([c for c in log if "op" not in c], [c for c in log if c.get("op") == "probe"],
            [r for r in outcome if "probe" not in r])


def _queued(barrier: Path) -> list[dict]:
    path = barrier / "calls.log"
    lines = path.read_text().splitlines() if path.exists() else []
    return [entry for entry in map(json.loads, lines) if entry.get("op") == "queue"]


def _at_the_driver(calls, instant: float) -> int:
    """Register calls queued at or holding the driver lock at ``instant``."""
    return sum(1 for c in calls if c["start"] <= instant < c["end"])


def test_four_processes_never_overlap_their_calls_and_a_probe_waits_at_most_one_paced_call(tmp_path, fork_server):
    """The default (auto): ranks bringing up pools together take turns and pace every call, so
    at no instant is more than one register call queued at or inside the driver (from the
    shared call log: ``start`` is before the call queues for the driver lock) - a probe arriving
    at any moment finds at most one paced call ahead of it, never a queue of them."""
    rate, stall = 512e6, 0.05
    calls, probes, results = _run_together(fork_server, tmp_path, concurrency="auto")
    assert len({c["pid"] for c in calls}) == 4 and sum(c["size"] for c in calls) == 4 * 128 * MiB
    assert _max_overlap([(c["start"], c["end"]) for c in calls]) == 1
    assert all(r["calls"] > 4 for r in results)  # paced: 128 MiB at most 25.6 MB a call
    by_pid: dict = {}
    for call in sorted(calls, key=lambda c: c["start"]):
        by_pid.setdefault(call["pid"], []).append(call["size"])
    for sizes in by_pid.values():  # the measured rate never beats the fake's: no call over the budget
        assert sizes[0] <= FIRST_CALL_BYTES and all(size <= rate * stall + 4096 for size in sizes[1:])
    assert probes and all(_at_the_driver(calls, p["start"]) <= 1 for p in probes)


@pytest.mark.load_free("the control of the test above: with no turnstile the calls pile up on any box")
def test_without_the_turnstile_the_processes_calls_pile_up_at_the_driver(tmp_path, fork_server):
    """The negative control: the same four bring-ups with HICACHE_PIN_CONCURRENCY=off each make
    one unpaced call, and all four queue at the driver at once (the test holds the fake's
    host-wide driver lock until each has queued - it would wait forever for a second one with
    the turnstile on): the overlap check above can fail."""
    calls, _, results = _run_together(fork_server, tmp_path, concurrency="off", probe=False, hold_driver=True)
    assert all(r["calls"] == 1 for r in results)
    assert _max_overlap([(c["start"], c["end"]) for c in calls]) == 4


def test_a_holder_killed_mid_call_does_not_block_the_others(tmp_path, fork_server):
    """A holder SIGKILLed inside its call (its ticket and the fake's driver lock held - a call
    that would never end by itself) lets the process queued behind it take its turn."""
    server = fork_server
    runtime, barrier = tmp_path / "run", tmp_path / "barrier"
    runtime.mkdir(mode=0o700)
    barrier.mkdir()
    env = {**os.environ, "HICACHE_RUNTIME_DIR": str(runtime), "HICACHE_PIN_CONCURRENCY": "1",
           "PYTHONPATH": str(Path(__file__).parent.parent)}
    # 16 MiB at 1 byte/s: the holder's first call would last 194 days - it is killed inside it
    holder = _spawn(server, ["register", str(barrier), "16", "1", "16"], env)
    other = None
    try:
        _wait_for(lambda: (barrier / f"ready-{holder.pid}").exists(), [holder], "holder ready")
        (barrier / "go").write_text("go")
        driver = os.open(barrier / "driver.lock", os.O_RDWR | os.O_CREAT, 0o600)

        def holder_in_its_call() -> bool:  # its ticket taken and the driver lock held
            try:
                fcntl.flock(driver, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                return True
            fcntl.flock(driver, fcntl.LOCK_UN)
            return False

        try:
            _wait_for(holder_in_its_call, [holder], "holder in its call")
        finally:
            os.close(driver)
        assert any(f".{holder.pid}." in n for n in _tickets(runtime))
        other = _spawn(server, ["register", str(barrier), "32", str(512e6), "32"], env)
        _wait_for(lambda: any(f".{other.pid}." in n for n in _tickets(runtime)), [holder, other], "other's ticket")
        assert not list(barrier.glob("result-*")) and holder.poll() is None  # it waits behind the holder's turn
        holder.send_signal(signal.SIGKILL)
        holder.wait(60)
        assert other.wait(timeout=300) == 0, other.communicate()
    finally:
        for child in (holder, other):
            if child is not None and child.poll() is None:
                child.kill()
            if child is not None:
                child.communicate()
    results = [json.loads(p.read_text()) for p in barrier.glob("result-*")]
    assert len(results) == 1 and sum(results[0]["sizes"]) == 32 * MiB
    assert _tickets(runtime) == []


def test_each_wait_is_a_span_of_the_trace(directory, tmp_path):
    """Each turnstile wait is a trace span on the calling thread, ending before its call."""
    from hicache.effects import _trace

    plan = plan_registration(8 * MiB, granularity_bytes=4096, limits=Limits(chunk_limit_bytes=4 * MiB))
    path = tmp_path / "trace.json"
    with _trace.tracing(str(path)):
        apply_plan(plan, base_ptr=BASE, runtime=FakeRuntime(), turnstile=Turnstile(directory)).release()
    events = json.loads(path.read_text())["traceEvents"]
    waits = [e for e in events if e.get("cat") == "turnstile"]
    calls = [e for e in events if e.get("cat") == "register"]
    assert len(waits) == len(calls) == 2 and all(w["name"] == "turnstile wait" for w in waits)
    for wait, call in zip(waits, calls):  # each wait ends before its call starts, on the same thread
        assert wait["tid"] == call["tid"] and wait["ts"] + wait["dur"] <= call["ts"]


def test_a_ctrl_c_held_while_the_ticket_is_taken_gives_the_ticket_back(directory):
    """A SIGINT arriving while the ticket is taken (held, then raised as the hold ends) still
    gives the ticket back: the hold ends inside the wait's cleanup, not before it (CI found the
    window once)."""
    turnstile = _forced(directory, poll_s=0.0005)
    core = turnstile._core
    real = core.enqueue

    def enqueue_then_interrupted():
        ticket = real()
        os.kill(os.getpid(), signal.SIGINT)  # held by deferred_interrupts, raised at its exit
        return ticket

    core.enqueue = enqueue_then_interrupted
    try:
        with pytest.raises(KeyboardInterrupt) as caught:
            turnstile.acquire()
    finally:
        core.enqueue = real
    # while the caller still holds the error (its frames keep the turn alive): given back by the
    # wait itself, not by the garbage collector later
    assert caught.value is not None and _tickets(directory) == []
