"""A Ctrl-C at any line of the bring-up, the executor or release leaves nothing registered,
mapped or budgeted once the caller's own cleanup ran - or reports exactly what is.

The interrupt is delivered the way CPython delivers SIGINT: the handler installed at that
moment runs between two lines (Python's default raises KeyboardInterrupt there; hicache's
`deferred_interrupts` records it). A trace function picks the line.
"""

from __future__ import annotations

import gc
import itertools
import re
import os
import signal
import sys
import warnings

import pytest
from machine import ROOMY

from hicache.effects import BudgetLock
from hicache.effects import HostTensorAllocator, Registration, apply_plan, bring_up
from hicache.effects import HostSetup
from hicache.effects import HostLedger
from hicache.effects import _interrupts
from hicache.effects._bringup import _bring_up as _bringup, _faulting as _pipeline, _handle as _host_pools, _steps
from hicache.effects._cuda import _executor, _progressive, _registration
from hicache.errors import RegistrationStateError, ReleaseError, RollbackError
from hicache.plan import Limits, MHALayout, plan_pool
from hicache.testing import FakeRuntime

pytest.importorskip("torch")
from hicache.effects._hostwide import _claim, _lock
from hicache.pools import HostPoolOptions

FILES = {m.__file__ for m in (_bringup, _steps, _executor, _host_pools, _registration, _interrupts, _progressive,
                              _lock, _claim)}  # the budget lock's lines too: a Ctrl-C inside it lets it go
#: not the budget lock's for the progressive caller: its background threads change the claims
#: file under the main thread (how many entries a read parses), so its line count would vary
#: run to run; the other callers walk every line of the lock's take, release and give-back
LOCK_FILES = {_lock.__file__, _claim.__file__}
# not _pipeline: its wait loop runs as often as the pre-fault thread's timing makes it, so the
# line count would vary run to run; an interrupt there is a held Ctrl-C checked by the executor
PLAN = plan_pool(
    MHALayout("page_first_direct", layer_num=2, head_num=2, head_dim=64, page_size=4, page_num=32, itemsize=2),
    Limits(chunk_limit_bytes=64 * 1024))


def _return_line(owner, function: str, statement: str) -> tuple[str, int]:
    import inspect

    code = inspect.unwrap(getattr(owner, function))  # bring_up and terminate_as_interrupt are wrapped
    lines, first = inspect.getsourcelines(code)
    return inspect.getsourcefile(code), first + next(i for i, line in enumerate(lines) if line.strip() == statement)


#: Handing a handle back is the one step no code can make atomic: a Ctrl-C landing on the
#: `return` (or, for the executor called directly, after its last check for one) drops it, and
#: its finalizer releases it (unregister, then free) with a ResourceWarning that says so.
_HANDLE = _return_line(_bringup, "bring_up", "return handle")
_LAST_CHECK = _return_line(_executor, "_apply", 'where = "after the last call"')
_RETURN = _return_line(_executor, "_apply", "return Registration(_State(runtime, ledger, journal, spans, retries, time.perf_counter() - start))")
_CONSUME = _return_line(_interrupts.deferred_interrupts, "consume", "return pending")
_WITH_EXIT = _return_line(_executor, "_apply", "with deferred_interrupts() as held:")  # after the return
#: bring_up's wrapper that handles SIGTERM/SIGHUP as Ctrl-C hands the handle on the same way: its
#: return, its with-exit, and the handlers' restore in terminate_as_interrupt's finally.
_OWNING = (_return_line(_bringup, "_owning_signals", "return function(*args, **kwargs)"),
           _return_line(_bringup, "_owning_signals", "with terminate_as_interrupt():"))
_RESTORE = _return_line(_interrupts, "terminate_as_interrupt",
                        "deque(map(signal.signal, mine, repeat(signal.SIG_DFL)), maxlen=0)")  # the first of two


def _body(function) -> tuple[str, range]:
    import inspect

    lines, first = inspect.getsourcelines(function)
    return inspect.getsourcefile(function), range(first, first + len(lines))


#: what `return Registration(_State(...))` runs
_BUILD = [_body(_registration._State.__init__), _body(_registration.Registration.__init__),
          _body(_interrupts.deferred_interrupts.__exit__)]


def _at_hand_over(where) -> bool:
    if len(where) != 1:
        return False
    (file, line), = where
    return (
        (file, line) in (_HANDLE, _WITH_EXIT, *_OWNING)
        or (file == _RESTORE[0] and _RESTORE[1] - 2 <= line <= _RESTORE[1] + 4)  # finally, try, restore, except
        or any(file == f and line in lines for f, lines in _BUILD)
        or (file == _RETURN[0] and _LAST_CHECK[1] < line <= _RETURN[1])
        or (file == _CONSUME[0] and _CONSUME[1] - 2 <= line <= _CONSUME[1])
    )


def _in_finalizer(frame) -> bool:
    while frame is not None:
        if frame.f_code.co_name == "_finalize" and frame.f_code.co_filename in FILES:
            return True
        frame = frame.f_back
    return False


_PIPELINE = _pipeline.__file__


def _tracer(target: int, counter: list, where: list, files=FILES):
    def trace(frame, event, arg):
        if frame.f_code.co_filename not in files:
            return None
        if event == "call" and _in_finalizer(frame):
            return None  # garbage of an earlier run being finalized: not this run's lines
        if event == "call" and frame.f_back is not None and frame.f_back.f_code.co_filename == _PIPELINE:
            return None  # the executor's stop check, called by the pre-fault wait loop: as
            # often as the pre-fault thread's timing makes it (under load, once more or less)
        if event == "line":
            counter[0] += 1
            if counter[0] == target:
                where.append((frame.f_code.co_filename, frame.f_lineno))
                handler = signal.getsignal(signal.SIGINT)
                handler(signal.SIGINT, frame)  # what a Ctrl-C landing here does
        return trace

    return trace


def _deferring_caller(runtime, ledger, lock, allocator, holder: list):
    """A caller that stores the handle with Ctrl-C held, then releases in finally."""
    try:
        with _interrupts.deferred_interrupts():
            holder.append(bring_up(PLAN, host=HostSetup(runtime=runtime, machine=ROOMY, lock=lock, ledger=ledger,
                                                        allocator=allocator)))
    finally:
        if holder:
            holder[0].release()


def _plain_caller(runtime, ledger, lock, allocator, holder: list):
    """How pools and `hicache apply` hold a bring-up: no deferral of their own (Ctrl-C stays
    prompt during a long pre-fault), release in finally."""
    try:
        holder.append(bring_up(PLAN, host=HostSetup(runtime=runtime, machine=ROOMY, lock=lock, ledger=ledger,
                                                    allocator=allocator)))
    finally:
        if holder:
            holder[0].release()


def _register_only_caller(runtime, ledger, lock, allocator, holder: list):
    """compat's `_cuda_host_register`: memory from elsewhere, the executor alone."""
    import torch

    tensor = allocator.allocate((PLAN.buffers[0].spec.nbytes,), torch.uint8)
    try:
        holder.append(apply_plan(PLAN.buffers[0].plan, base_ptr=tensor.data_ptr(), runtime=runtime, ledger=ledger))
    finally:
        try:
            if holder:
                holder[0].release()
        finally:
            del tensor
            try:
                allocator.free_all(ledger=ledger)
            except RegistrationStateError:
                pass  # still registered: kept mapped, as it must be


_RUNS = itertools.count()


def _progressive_caller(runtime, ledger, lock, allocator, holder: list):
    """A progressive pool: the constructor registers the first page's calls in the foreground
    (the background thread gets no signals) and destroys what came up if interrupted; the
    caller waits for the background calls, then destroys the pool, in finally."""
    from hicache.pools import MHATokenToKVPoolHost
    from hicache.testing import MHADevicePool

    device = MHADevicePool(size=64, layer_num=2, head_num=2, head_dim=64, page_size=4)
    # A label of its own per run: a pool of the same name from an earlier run, alive until the
    # garbage collector gets to it (when depends on the background thread's timing), would make
    # the metrics read its calls on the way - five traced lines more in some runs than in others.
    label = f"ctrl-c-{next(_RUNS)}"
    try:
        holder.append(MHATokenToKVPoolHost(device, 2.0, 0, 4, "page_first_direct", True, "cpu", host=HostSetup(runtime=runtime, ledger=ledger, machine=ROOMY, lock=lock, limits=Limits(chunk_limit_bytes=64 * 1024)), options=HostPoolOptions(progressive=True), pool_label=label))
    finally:
        if holder:
            try:  # the background's calls all made first: how many there are to release must not
                holder[0].wait_ready()  # depend on how far it got while this thread ran traced
            finally:
                holder[0].destroy()


CALLERS = {"deferring": _deferring_caller, "plain": _plain_caller, "register-only": _register_only_caller,
           "progressive": _progressive_caller}


def _run(target, tmp_path, caller="deferring", **faults):
    for signum in (signal.SIGTERM, signal.SIGHUP):  # as a fresh process has them: a run whose Ctrl-C
        signal.signal(signum, signal.SIG_DFL)       # landed in a restore must not change the next's lines
    directory = tmp_path / f"run-{target}"
    directory.mkdir(mode=0o700)
    runtime, ledger, lock, allocator = (FakeRuntime(**faults), HostLedger(), BudgetLock(directory),
                                        HostTensorAllocator(hugepages="off"))
    counter, holder, where = [0], [], []
    error = None
    # The collector stays out of the traced call: garbage an earlier test left in this worker (an
    # SGLang engine's pools, say) would otherwise run its finalizers' hicache lines inside the
    # trace whenever a collection happened to fall there - a count off by a few lines, and an
    # interrupt aimed past the end of a shorter run never landing. (It runs between runs, as
    # before; what a run drops without a cycle still finalizes at once, by reference count.)
    with warnings.catch_warnings(record=True) as caught_warnings:
        warnings.simplefilter("always")
        gc.disable()
        sys.settrace(_tracer(target, counter, where, FILES - LOCK_FILES if caller == "progressive" else FILES))
        try:
            CALLERS[caller](runtime, ledger, lock, allocator, holder)
        except BaseException as caught:  # the interrupt, or what it became
            error = caught
        finally:
            sys.settrace(None)
            gc.enable()
        chain = error
        while chain is not None:  # let the frames go now: what they dropped finalizes here
            chain.__traceback__ = None
            chain = chain.__cause__ or chain.__context__
    # a handle or Registration dropped on the floor (its finalizer warns) was never reported,
    # except where nothing can prevent it: the hand-over itself
    dropped = [str(w.message) for w in caught_warnings if issubclass(w.category, ResourceWarning)]
    assert not dropped or _at_hand_over(where), (f"interrupt at traced line {target}", where, error, dropped)
    if dropped:
        error = _Dropped(dropped)
    if holder and getattr(holder[0], "_destroyed", True) is False:
        # the Ctrl-C landed in the pool's destroy() before it began (before its deferral was
        # in place): the pool still holds what it held, and destroying it again finishes; or
        # its destroy() raised the ReleaseError of a failed undo, and a second one repeats it
        pool = holder[0]
        chain, failed_undo = error, False
        while chain is not None and not failed_undo:
            failed_undo, chain = isinstance(chain, ReleaseError), chain.__cause__ or chain.__context__
        if not failed_undo:
            assert runtime.held() == set(pool._host.registered_ranges())
        try:
            pool.destroy()  # a second destroy() retries what the first left registered
            error = None if failed_undo else error
        except ReleaseError as failed:
            error = failed
    elif holder and not hasattr(holder[0], "_destroyed") and _state(holder[0]) == "active":
        # the Ctrl-C landed in the caller's own release, before it began: the handle still
        # says exactly what is held, and releasing it again finishes the job
        registration = holder[0] if isinstance(holder[0], Registration) else holder[0].registration
        assert runtime.held() == {(r.ptr, r.size) for r in registration.ranges}
        try:
            holder[0].release()
        except ReleaseError as failed:
            error = failed
    _assert_free_from_outside(lock, target, where, error)
    with lock:
        entries = lock._claimed()
    return counter[0], error, runtime, ledger, entries, allocator


def _assert_free_from_outside(lock: BudgetLock, target: int, where, error) -> None:
    """The host-wide lock is free as another process sees it: a fresh open file of it takes the
    flock at once (this process's BudgetLock objects and their counts could not tell a leaked
    descriptor - and waiting on it would hang the walk instead of failing it)."""
    import fcntl
    import threading

    for thread in threading.enumerate():  # a give-back a finalizer handed to a thread takes the lock briefly
        if thread.name == "hicache-budget-forget":
            thread.join(60)
    probe = os.open(lock.path, os.O_RDWR | os.O_CREAT, 0o600)  # none yet: nothing holds it
    try:
        fcntl.flock(probe, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        raise AssertionError(f"interrupt at traced line {target} ({where}) left the budget lock held: {error!r}") from None
    finally:
        os.close(probe)


@pytest.fixture(autouse=True)
def _four_kib_pages(monkeypatch):
    """4 KiB pages for every walk here (HICACHE_HUGEPAGES=off): under the default "auto" each
    piece's page size follows its measured rate, so the traced line count of one run (the
    walk's length) would depend on the machine's timing; THP's own rules are tests of their own
    (test_thp_auto)."""
    monkeypatch.setenv("HICACHE_HUGEPAGES", "off")


def _state(handle) -> str:
    return handle.status().state if isinstance(handle, Registration) else handle.state


class _Dropped(KeyboardInterrupt):
    """The handle was dropped at the hand-over; its finalizer's warnings say what it did."""

    def __init__(self, messages):
        super().__init__("; ".join(messages))
        self.leaked = {(int(p, 16), int(s)) for m in messages for p, s in re.findall(r"\(0x([0-9a-f]+), (\d+)\)", m)}


def _lines(tmp_path, caller) -> int:
    """The walk's length: the traced lines of an uninterrupted run - the second one. The first
    run in a worker can take a path once that later runs do not: after test_executor's tests on
    the same worker, its metrics report retired the same-named pool an earlier test had left,
    reading that handle's calls - five lines no later run has - and a walk counted from it aimed
    its last interrupts past the end (3 failures in 3 with that order)."""
    for run in ("first", "counted"):
        (tmp_path / run).mkdir()
        lines, error, *_ = _run(0, tmp_path / run, caller)
        assert error is None
    return lines


# Not in `make test-loaded`: every line of one thread is interrupted by the trace, the same
# however busy the machine. The progressive caller's background thread once changed that
# thread's line count under load (a same-named pool of an earlier run still awaiting the
# collector: see `_progressive_caller`); with a label per run the count is the same under six
# busy processes as idle (checked so: 863 lines in six of six runs).
_CALLER_PARAMS = sorted(CALLERS)
#: Each walk runs as two tests, one for every other line (together: every line): xdist's workers
#: take them side by side, where one walk alone was the suite's longest test (18 s, progressive).
_SHARDS = (0, 1)


@pytest.mark.parametrize("shard", _SHARDS)
@pytest.mark.parametrize("caller", _CALLER_PARAMS)
def test_every_line_interrupted_leaves_nothing_behind(tmp_path, caller, shard):
    """A Ctrl-C at every traced line of a bring-up and its release leaves nothing registered, mapped
    or budgeted (or hands the handle over, named)."""
    total = _lines(tmp_path, caller)
    assert total > 100
    for target in range(1 + shard, total + 1, len(_SHARDS)):
        _, error, runtime, ledger, entries, allocator = _run(target, tmp_path, caller)
        where = f"interrupt at traced line {target} of {total}"
        assert error is not None, where
        interrupted = error if isinstance(error, KeyboardInterrupt) else error.__cause__
        assert isinstance(interrupted, KeyboardInterrupt) or isinstance(error, KeyboardInterrupt), (where, error)
        assert runtime.held() == set() and ledger.held() == (), (where, error)
        assert entries == {}, (where, error)
        if caller != "register-only":  # there the caller frees, before a dropped handle's finalizer ran
            assert all(b.freed for b in allocator.owned()), (where, error)
        runtime.check_valid()


@pytest.mark.parametrize("shard", _SHARDS)
@pytest.mark.parametrize("caller", _CALLER_PARAMS)
def test_every_line_interrupted_with_a_failing_undo_reports_exactly_what_stays(tmp_path, caller, shard):
    """When an unregister fails, whatever stays registered is what the error (or the handle)
    reports, and that memory stays mapped."""
    total = _lines(tmp_path, caller)
    for target in range(1 + shard, total + 1, len(_SHARDS)):
        _, error, runtime, ledger, entries, allocator = _run(target, tmp_path, caller, fail_unregister={0: 1})
        where = f"interrupt at traced line {target} of {total}"
        held = runtime.held()
        reported = set()
        chain = error
        while chain is not None:
            if isinstance(chain, (RollbackError, ReleaseError, _Dropped)):
                reported = set(chain.leaked) | set(getattr(chain, "uncertain", ()))
                break
            chain = chain.__cause__ or chain.__context__
        assert held == reported, (where, error, held, reported)
        assert set(ledger.held()) == held, where
        for buffer in allocator.owned():
            assert not buffer.freed or not held, where
        assert entries == {}, where


@pytest.mark.concurrency
def test_a_second_interrupt_held_while_the_first_is_honoured_never_replaces_its_record():
    """A Ctrl-C held while the block already leaves with the honoured interrupt - or with an
    error it caused (the rollback's record of leaked ranges, chained to it) - is dropped at
    exit: the caller sees that exception and its record, not a bare KeyboardInterrupt in its
    place (issue #54). A signal held while nothing is being honoured is still delivered."""
    import os
    import signal

    from hicache.errors import RollbackError

    def leave_with(exception):
        with pytest.raises(BaseException) as caught:
            with _interrupts.deferred_interrupts():
                os.kill(os.getpid(), signal.SIGINT)  # held: a second Ctrl-C during the rollback
                raise exception
        return caught.value

    honoured = KeyboardInterrupt("the first Ctrl-C, honoured")
    assert leave_with(honoured) is honoured
    try:
        raise KeyboardInterrupt
    except KeyboardInterrupt as first:
        record = RollbackError("rolled back; 1 range leaked", leaked=((0x1000, 4096),), uncertain=())
        record.__context__ = first
    got = leave_with(record)
    assert got is record and got.leaked == ((0x1000, 4096),)
    assert isinstance(leave_with(ValueError("unrelated")), KeyboardInterrupt)  # nothing honoured: delivered
