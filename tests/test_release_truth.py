"""One handle, one release, told truthfully: a finalizer never waits on the budget lock (the
deadlock of a pool collected during the next pool's bring-up), and after a failed or
interrupted unregister - at each unregister of a blocking and of a progressive bring-up -
``state``/``leaked`` say exactly what stays registered, a pool refuses use until a second
destroy() succeeds, and `hicache apply` says what stays registered."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from machine import ROOMY

from hicache.effects import HostTensorAllocator, Progressive, bring_up
from hicache.effects import HostSetup
from hicache.effects import BudgetLock
from hicache.effects import HostLedger
from hicache.errors import RegistrationStateError, ReleaseError
from hicache.plan import Limits, MHALayout, plan_pool
from hicache.testing import FakeRuntime, MHADevicePool, fake_cuda
from hicache.pools import HostPoolOptions

pytestmark = pytest.mark.concurrency  # processes, threads, signals or waits: `make test-loaded`

torch = pytest.importorskip("torch")
ROOT = Path(__file__).resolve().parents[1]
LAYOUT = MHALayout("page_first_direct", layer_num=2, head_num=2, head_dim=64, page_size=4, page_num=32, itemsize=2)
PLAN = plan_pool(LAYOUT, Limits(chunk_limit_bytes=64 * 1024))  # 4 calls of 64 KiB
CALLS = PLAN.call_count

_CHILD = r"""
import gc, os, sys, warnings, weakref
sys.path.insert(0, {tests!r})
from machine import ROOMY
from hicache.effects import HostSetup, HostTensorAllocator
from hicache.effects._hostwide._lock import budget_lock
from hicache.pools import MHATokenToKVPoolHost
from hicache.testing import MHADevicePool, fake_cuda

warnings.simplefilter("ignore", ResourceWarning)  # the dropped pool's finalizer says so
gc.disable()  # the collector runs where this script says, not wherever it happens to
collected = []
dropped = []
real = HostTensorAllocator.allocate_unfaulted

def allocate_unfaulted(self, dims, dtype):
    if {collect!r} and dropped and not collected:
        gc.collect()  # the dropped pool is finalized here, under the next one's lock
        collected.append(dropped[0]() is None)
    return real(self, dims, dtype)

HostTensorAllocator.allocate_unfaulted = allocate_unfaulted

def pool():
    device = MHADevicePool(size=64, layer_num=2, head_num=2, head_dim=64, page_size=4)
    return MHATokenToKVPoolHost(device, 2.0, 0, 4, "page_first_direct", True, "cpu", host=HostSetup(machine=ROOMY))

with fake_cuda() as fake:
    first = pool()
    first.cycle = [first]  # only the collector can free it now
    dropped.append(weakref.ref(first._host))
    del first
    second = pool()
    assert collected == ([True] if {collect!r} else []), collected
    held_during = len(fake.held())
    second.destroy()
    gc.collect()
    assert fake.held() == set(), fake.held()
with budget_lock() as lock:
    assert lock._claimed() == {{}}, lock._entries()
print("ok", held_during)
"""


@pytest.mark.parametrize("collect", [True, False], ids=["collected-mid-bring-up", "plain"])
def test_a_pool_collected_while_the_next_one_is_brought_up_does_not_deadlock(tmp_path, collect, fork_server):
    """The finalizer of a dropped pool runs inside the next pool's bring-up (which holds the
    host-wide budget lock through a file descriptor of its own): it completes, and nothing
    stays registered or budgeted."""
    runtime_dir = tmp_path / "run"
    runtime_dir.mkdir(mode=0o700)
    env = {**os.environ, "HICACHE_RUNTIME_DIR": str(runtime_dir)}
    code = _CHILD.format(tests=str(ROOT / "tests"), collect=collect)
    try:
        result = fork_server.run([sys.executable, "-c", code], cwd=ROOT, env=env, timeout=60)  # tests/forked.py
    except subprocess.TimeoutExpired:
        pytest.fail("the bring-up hung: the finalizer waited on the budget lock the bring-up holds")
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.split()[0] == "ok"


def test_a_finalizer_never_waits_on_a_budget_lock_held_in_this_process(tmp_path):
    """Giving budget back while another BudgetLock of this process holds the file queues it;
    the holder applies it before letting go (no wait, nothing lost, nothing doubled)."""
    import threading

    holder, other = BudgetLock(tmp_path), BudgetLock(tmp_path)
    with holder:
        holder.record(100)
        done = threading.Event()

        def give_back():
            other.forget_soon(40, wait=False)  # a finalizer's: flock would wait here forever
            other.forget_soon(10)  # the blocking flavour queues too while a holder exists
            done.set()

        threading.Thread(target=give_back, daemon=True).start()
        assert done.wait(10), "forget_soon waited on a lock this process holds"
        assert holder._claimed() == {os.getpid(): 100}  # not yet: the holder applies it
    assert holder.snapshot() == {os.getpid(): 50}  # applied as the holder let go, before anyone takes the lock again
    with other:
        assert other._claimed() == {os.getpid(): 50}
        other.forget(None)


_EXIT_CHILD = r"""
import sys, time, warnings
from pathlib import Path
sys.path.insert(0, {tests!r})
warnings.simplefilter("always", ResourceWarning)  # every finalizer that releases says so
from machine import ROOMY
from hicache.effects import BudgetLock, HostLedger, HostSetup, HostTensorAllocator, Progressive, bring_up
from hicache.plan import Limits, MHALayout, plan_pool
from hicache.testing import FakeCudart, FakeRuntime

events = open({events!r}, "a", buffering=1)  # each driver call as it happens, to the very end
# 64 calls of 1 MiB (K and V): ~50 ms each for a progressive bring-up, so it is still registering at the exit
cudart = FakeCudart(register_bytes_per_s=20e6 if {mode!r} == "progressive" else None)
register, unregister = cudart.cudaHostRegister, cudart.cudaHostUnregister
cudart.cudaHostRegister = lambda ptr, size, flags: (register(ptr, size, flags), events.write(f"R {{ptr}}\n"))[0]
cudart.cudaHostUnregister = lambda ptr: (events.write(f"U {{ptr}}\n"), unregister(ptr))[1]
layout = MHALayout("page_first_direct", layer_num=2, head_num=8, head_dim=128, page_size=16, page_num=512, itemsize=2)
handle = bring_up(plan_pool(layout, Limits(chunk_limit_bytes=1 << 20)),
                  mode=Progressive(max_stall_s=None) if {mode!r} == "progressive" else "blocking",
                  host=HostSetup(runtime=FakeRuntime(cudart), machine=ROOMY, lock=BudgetLock(Path({directory!r})),
                                 ledger=HostLedger(), allocator=HostTensorAllocator()))
if {mode!r} == "detached":  # the caller owns the registration now (kept alive here), as compat.sglang's buffers do
    registration = handle.detach()
while cudart.register_calls < 3:
    time.sleep(0.005)
print("exiting", flush=True)  # what was brought up is left to the interpreter's exit
"""


def _exit_with_a_bring_up(tmp_path, mode: str):
    """Run the exit child; its result and the driver calls it made, in order."""
    events = tmp_path / "driver.log"
    code = _EXIT_CHILD.format(tests=str(ROOT / "tests"), events=str(events), directory=str(tmp_path / "run"),
                              mode=mode)
    child = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert child.returncode == 0 and child.stdout.split() == ["exiting"], child.stderr[-3000:]
    return child, [line.split() for line in events.read_text().splitlines()]


@pytest.mark.parametrize("mode", ["progressive", "blocking"])
def test_a_handle_left_to_the_interpreters_exit_is_released_in_its_one_order(tmp_path, mode):
    """A real exit with a handle left alive (a progressive one still registering): only the
    handle's finalizer releases it - the background registration stopped first, then every call
    unregistered - never its registrations' own finalizers, which weakref runs at exit newest
    first, ahead of their owner's (the code before unregistered two progressive calls, then the
    thread registered a third)."""
    child, calls = _exit_with_a_bring_up(tmp_path, mode)
    first_unregister = next(i for i, (op, _) in enumerate(calls) if op == "U")
    assert all(op == "U" for op, _ in calls[first_unregister:]), calls  # nothing registered once it unregisters
    assert sorted(p for op, p in calls if op == "R") == sorted(p for op, p in calls if op == "U")  # all of it
    released = [line for line in child.stderr.splitlines() if "garbage-collected without release" in line]
    assert len(released) == 1 and "HostPools handle" in released[0], child.stderr[-3000:]


def test_a_registration_detached_from_its_handle_is_released_at_exit_by_its_own_finalizer(tmp_path):
    """Detached (the caller owns it, as compat.sglang's buffers do), a registration left to the
    exit is released by its own finalizer again: every call unregistered, and it says so."""
    child, calls = _exit_with_a_bring_up(tmp_path, "detached")
    registered = sorted(p for op, p in calls if op == "R")
    assert len(registered) == 64 and registered == sorted(p for op, p in calls if op == "U"), calls
    released = [line for line in child.stderr.splitlines() if "garbage-collected without release" in line]
    assert len(released) == 1 and "a Registration of" in released[0], child.stderr[-3000:]


def _blocking(runtime, ledger, tmp_path):
    return bring_up(PLAN, host=HostSetup(runtime=runtime, machine=ROOMY, lock=BudgetLock(tmp_path), ledger=ledger,
                                         allocator=HostTensorAllocator()))


def _progressive(runtime, ledger, tmp_path):
    return bring_up(PLAN, mode=Progressive(max_stall_s=None),
                    host=HostSetup(runtime=runtime, machine=ROOMY, lock=BudgetLock(tmp_path), ledger=ledger,
                                   allocator=HostTensorAllocator()))


MODES = {"blocking": _blocking, "progressive": _progressive}
FAULTS = {
    "fails": lambda k: {"fail_unregister": {k: 1}},
    "interrupted-before": lambda k: {"interrupt_unregister": {k: "before"}},
    "interrupted-after": lambda k: {"interrupt_unregister": {k: "after"}},
}


@pytest.mark.parametrize("fault", sorted(FAULTS))
@pytest.mark.parametrize("mode", sorted(MODES))
@pytest.mark.parametrize("call", range(CALLS))
def test_a_failed_or_interrupted_unregister_leaves_a_truthful_handle(tmp_path, mode, fault, call):
    """Whichever unregister fails or is interrupted (by the runtime: a KeyboardInterrupt from
    inside the call), the handle is ``leaked`` with exactly the ranges CUDA may still hold
    (an interrupt after the call took effect is counted as held: its fate is unknown), the
    memory stays mapped, and releasing again retries exactly those and ends released."""
    runtime, ledger = FakeRuntime(**FAULTS[fault](call)), HostLedger()
    handle = MODES[mode](runtime, ledger, tmp_path)
    assert handle.wait(5) and handle.state == "active" and len(handle.registered_ranges()) == CALLS
    expected = KeyboardInterrupt if fault.startswith("interrupted") else ReleaseError
    with pytest.raises(expected):
        handle.release()
    held = runtime.held()
    assert handle.state == "leaked" and len(handle.leaked) == 1
    assert set(handle.leaked) >= held and set(handle.registered_ranges()) == set(handle.leaked)
    if fault != "interrupted-after":
        assert set(handle.leaked) == held
    assert set(ledger.held()) == set(handle.leaked)
    assert all(not b.freed for b in handle.allocator.owned())  # CUDA may still pin it: never unmapped
    handle.release()  # the retry: 713 for a range the interrupted call did unregister
    assert handle.state == "released" and handle.leaked == () and runtime.held() == set() and ledger.held() == ()
    assert all(b.freed for b in handle.allocator.owned()) and handle.allocator.owned() == []
    with BudgetLock(tmp_path) as lock:
        assert lock._claimed() == {}
    runtime.check_valid()


def _pool(runtime, ledger, tmp_path, progressive):
    from hicache.pools import MHATokenToKVPoolHost

    device = MHADevicePool(size=64, layer_num=2, head_num=2, head_dim=64, page_size=4)
    return MHATokenToKVPoolHost(device, 2.0, 0, 4, "page_first_direct", True, "cpu", host=HostSetup(runtime=runtime, ledger=ledger, machine=ROOMY, lock=BudgetLock(tmp_path), limits=Limits(chunk_limit_bytes=64 * 1024)), options=HostPoolOptions(progressive=progressive, max_stall_s=None))


@pytest.mark.parametrize("fault", sorted(FAULTS))
@pytest.mark.parametrize("progressive", [False, True], ids=["blocking", "progressive"])
@pytest.mark.parametrize("call", [0, CALLS - 1])
def test_a_pool_whose_destroy_raised_refuses_use_until_a_second_destroy(tmp_path, progressive, fault, call):
    """alloc, free, transfers and page access are refused while a range stays registered (the
    memory behind it is not the pool's to use any more); a second destroy() retries and then
    the pool is simply destroyed."""
    runtime, ledger = FakeRuntime(**FAULTS[fault](call)), HostLedger()
    pool = _pool(runtime, ledger, tmp_path, progressive)
    assert pool.wait_ready(5)
    device = pool.device_pool
    slots = pool.alloc(8)
    page = pool.get_data_page(0).clone()  # the page path's geometry is cached: its own check must refuse
    expected = KeyboardInterrupt if fault.startswith("interrupted") else ReleaseError
    with pytest.raises(expected):
        pool.destroy()
    refused = "destroy\\(\\) failed: 1 range\\(s\\) stay registered"
    for use in (lambda: pool.alloc(4), lambda: pool.free(slots), lambda: pool.available_size(),
                lambda: pool.get_data_page(0), lambda: pool.set_from_flat_data_page(0, page),
                lambda: pool.backup_from_device_all_layer(device, slots, slots, "direct"),
                lambda: pool.load_to_device_per_layer(device, slots, slots, 0, "direct")):
        with pytest.raises(RegistrationStateError, match=refused):
            use()
    pool.destroy()
    assert runtime.held() == set() and ledger.held() == ()
    with pytest.raises(RegistrationStateError, match="was destroyed"):
        pool.alloc(4)
    pool.destroy()  # idempotent


@pytest.mark.parametrize("progressive", [[], ["--progressive"]], ids=["blocking", "progressive"])
def test_apply_says_what_stays_registered_after_an_interrupted_release(capsys, progressive):
    """The documented fault (an interrupt raised by the runtime during release): apply exits
    as interrupted and names the range that stays registered, never "nothing is left" - on
    its one path, blocking or progressive."""
    from hicache.cli import main

    with fake_cuda(interrupt_unregister={0: "before"}) as fake:
        code = main(["apply", "--model", "llama-3.1-8b", "--host-gb", "0.01", "--reserve", "1MiB",
                     "--chunk-limit", "4MiB", *progressive])
    err = capsys.readouterr().err
    assert code == 130, err
    assert "nothing is left registered" not in err
    assert "release left 1 range(s)" in err and "stay registered" in err
    (ptr, size), = fake.held()
    assert f"0x{ptr:x}" in err


def test_apply_says_what_stays_registered_after_a_failed_release(capsys):
    """A release that cannot unregister makes apply exit 3 with error[release-leaked] naming the
    range."""
    from hicache.cli import main

    with fake_cuda(fail_unregister={0: 1}) as fake:
        code = main(["apply", "--model", "llama-3.1-8b", "--host-gb", "0.01", "--reserve", "1MiB",
                     "--chunk-limit", "4MiB"])
    err = capsys.readouterr().err
    assert code == 3 and "error[release-leaked]" in err, err
    (ptr, _), = fake.held()
    assert f"0x{ptr:x}" in err and "nothing is left registered" not in err
