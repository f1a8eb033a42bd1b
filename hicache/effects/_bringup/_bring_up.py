"""`bring_up`: the one bring-up of host pools, used by `HostKVCache`, `hicache apply` and compat.

Owns the sequence budget (under the host-wide lock) -> map (+ pre-fault) -> register, in one of
four modes, always into one `HostPools` handle that owns what came up and releases it in order:
- ``"blocking"``: allocate and pre-fault every buffer, then register all as one transaction;
- ``"pipelined"``: map unfaulted, fault in the background, register each call once its bytes
  are resident - still one transaction (the default where the allocator can map unfaulted);
- `Progressive(...)`: map unfaulted; fault and register call by call, paced, the first calls
  before returning and the rest in the background (each call its own transaction);
- ``"map-only"``: map unfaulted, register nothing (the caller faults and registers).
The budget lock is held to decide, not to fill (issue #35): a rank samples the machine, takes
off what the host's claims still have to fault in, records its claim and lets go; its pre-fault
then raises the claim's resident count (its `Claim` follows the fill), so ranks that start together
pre-fault side by side, register in turns at the turnstile, and never overcommit (sglang #38156).
Each rank's pre-fault threads run on its pool's NUMA node, an equal share of that node's CPUs
per rank it hosts (`_share`). Machine facts, the lock, the allocator and the runtime are parameters.
"""

from __future__ import annotations

import functools
import time
from typing import Callable, ParamSpec, TypeVar

import attrs

from hicache.effects._bringup._handle import HostPools
from hicache.effects._bringup._steps import _allocate, _map, _pipelined, _progressive, _register, _Run
from hicache.effects._bringup._progress import ProgressLog, tee
from hicache.effects._bringup._admission import settled_claim as admit
from hicache.effects._hostwide._claim import AdmissionPolicy
from hicache.effects._hostwide._lock import budget_lock
from hicache.effects._cuda._progressive import MAX_STALL_S, check_max_stall
from hicache.effects._hostwide import _turnstile
from hicache.effects._host._allocators import host_allocator
from hicache.effects._host._environment import ranks_per_host as env_ranks_per_host
from hicache.effects._host._numa import FaultShare, fault_share, node_cpus, process_cpus
from hicache.effects._host._probes import probe_machine
import hicache.effects._trace as _trace
from hicache.effects._interrupts import terminate_as_interrupt
from hicache.effects._bringup import _report
from hicache.effects._bringup._report import Report
from hicache.effects._bringup._setup import HostSetup
from hicache.errors import PlanError
from hicache.plan import PoolPlan, RegistrationPlan
from hicache.plan.checks import check_bool, check_int

BLOCKING, PIPELINED, MAP_ONLY = "blocking", "pipelined", "map-only"
MODES = (BLOCKING, PIPELINED, MAP_ONLY, "Progressive(...)")


@attrs.frozen
class Progressive:
    """The progressive mode's settings: serve early, keep registering in the background.

    ``order``: the calls' chunks as ``(buffer index, offset, size)`` within the buffers (None:
    every range of every plan, in plan order) - each buffer's entries, sorted, a legal plan of it
    (they tile it once, cut it only on its copy unit, each within the caps: `bring_up` checks
    before any memory is taken); ``key(position, done)``: which chunk goes next
    given its bytes registered so far (smallest first; a pool passes the page they reach);
    ``on_chunk(position, offset in chunk, size)``: after each call (from the background thread
    too); ``ready()``: register in the foreground until it is true (None: after the first
    call); ``max_stall_s``: no call holds the driver longer at the measured rate (the first at
    most 16 MiB; None: one call per chunk).
    """

    order: tuple | None = attrs.field(default=None, converter=lambda o: None if o is None else tuple(tuple(i) for i in o))
    key: Callable | None = None
    on_chunk: Callable | None = None
    ready: Callable | None = None
    max_stall_s: float | None = attrs.field(default=MAX_STALL_S, converter=check_max_stall)


@attrs.frozen
class BufferRequest:
    """One host buffer to bring up: its name, shape and torch dtype (None: uint8), and the plan
    to register it by (None: allocate only, e.g. ``pin_memory=False``)."""

    name: str
    shape: tuple = attrs.field(converter=lambda dims: _shape(dims))
    dtype: object = attrs.field(default=None, validator=lambda request, attribute, value: _check_dtype(value))
    plan: RegistrationPlan | None = None

    @classmethod
    def of_pool(cls, pool_plan: PoolPlan, dtypes=None, *, register: bool = True,
                prefix: str = "") -> list["BufferRequest"]:
        """The requests of every buffer of ``pool_plan``: ``dtypes``, one torch dtype per buffer
        (None: flat uint8 buffers); ``register=False``: allocate only; names after ``prefix``."""
        if not isinstance(pool_plan, PoolPlan):
            raise PlanError(f"expected a PoolPlan, got {pool_plan!r}")
        buffers = pool_plan.buffers
        dtypes = [None] * len(buffers) if dtypes is None else list(dtypes)
        if len(dtypes) != len(buffers):
            raise PlanError(f"{len(dtypes)} dtypes for {len(buffers)} buffers")
        return [cls(prefix + buffer.spec.name, buffer.spec.shape if dtype is not None else (buffer.spec.nbytes,),
                    dtype, buffer.plan if register else None) for buffer, dtype in zip(buffers, dtypes)]


def _shape(dims) -> tuple:
    """A request's shape as plain ints, each an integer >= 0 (a float was once truncated), or a
    `PlanError` naming the dimension."""
    try:
        dims = tuple(dims)
    except TypeError:
        raise PlanError(f"BufferRequest.shape must be a sequence of integers, got {dims!r}") from None
    return tuple(check_int(PlanError, "BufferRequest", f"shape[{i}]", d, minimum=0) for i, d in enumerate(dims))


def _check_dtype(dtype) -> None:
    """None (flat bytes) or a torch dtype; anything else is a `PlanError` naming it."""
    if dtype is None:
        return
    import torch

    if not isinstance(dtype, torch.dtype):
        raise PlanError(f"BufferRequest.dtype must be a torch.dtype or None, got {dtype!r}")


def _requests(requests) -> list[BufferRequest]:
    """`BufferRequest`s as given, or those of one `PoolPlan` or several (named ``index/buffer``):
    flat uint8 buffers, each registered by its plan (`BufferRequest.of_pool` for dtypes, or none)."""
    if isinstance(requests, PoolPlan):
        return BufferRequest.of_pool(requests)
    try:
        requests = list(requests)
    except TypeError:
        raise PlanError("bring_up(requests) takes BufferRequests or PoolPlans (one PoolPlan, or a list), got "
                        f"{requests!r}") from None
    if all(isinstance(r, BufferRequest) for r in requests):
        return requests
    made = []
    for index, pool in enumerate(requests):
        if isinstance(pool, BufferRequest):
            raise PlanError(f"bring_up(requests) takes BufferRequests or PoolPlans, not both: item {index} "
                            f"is {pool!r}")
        made += BufferRequest.of_pool(pool, prefix=f"{index}/")
    return made


def _nbytes(request: BufferRequest) -> int:
    if request.plan is not None:
        return request.plan.total_bytes
    import torch

    size = torch.empty((), dtype=request.dtype or torch.uint8).element_size()
    for d in request.shape:
        size *= d
    return size


def _mode(mode, requests, allocator, device) -> str | Progressive:
    can_map = allocator.can_map_unfaulted and str(device) == "cpu"
    registered = [r for r in requests if r.plan is not None and r.plan.total_bytes]
    if mode is None:
        return PIPELINED if can_map and registered and len(registered) == len(requests) else BLOCKING
    if not isinstance(mode, Progressive) and mode not in (BLOCKING, PIPELINED, MAP_ONLY):
        raise PlanError(f"bring_up(mode=) must be one of {', '.join(MODES)}, got {mode!r}")
    if mode != BLOCKING and not can_map:
        raise PlanError(f"bring_up(mode={mode!r}) maps memory unfaulted: it needs an allocator that can "
                        f"(allocate_unfaulted) and device 'cpu', got {allocator!r} on {device!r}")
    if isinstance(mode, Progressive) and any(r.plan is None for r in requests):
        raise PlanError("bring_up(mode=Progressive(...)) registers every buffer: each request needs a plan")
    if isinstance(mode, Progressive) and mode.order is not None:
        _check_order(mode.order, requests)
    return mode


def _check_order(order: tuple, requests) -> None:
    """A progressive ``order`` is a registration plan of every buffer: its entries of each buffer,
    sorted, must be ranges every law of `RegistrationPlan` holds for (they tile the buffer once,
    cut it only on its copy unit, each within the caps) - else a page would straddle two calls,
    or part of a buffer would stay unregistered under a handle that says it is up. Checked
    before any memory is taken; the plan's own check says what is wrong."""
    from hicache.plan import Range

    ranges: list[list] = [[] for _ in requests]
    for entry in order:
        if len(entry) != 3:
            raise PlanError(f"Progressive.order: {entry!r} is no (buffer index, offset, size)")
        where = f"Progressive.order entry {entry!r}: "
        index = check_int(PlanError, "", where + "buffer index", entry[0], minimum=0, maximum=len(requests) - 1)
        offset = check_int(PlanError, "", where + "offset", entry[1], minimum=0)
        ranges[index].append(Range(offset, check_int(PlanError, "", where + "size", entry[2])))
    for request, mine in zip(requests, ranges):
        try:
            attrs.evolve(request.plan, ranges=sorted(mine, key=lambda item: item.offset))
        except PlanError as error:
            raise PlanError(f"Progressive.order does not register buffer {request.name!r} by its plan's laws "
                            f"(its entries, sorted, as that plan's ranges: {error})") from None


def _share(allocator, machine, ranks_per_host) -> FaultShare:
    """Where this rank's background pre-fault runs (issue #35 item 2, `_numa.fault_share`): on
    its pool's NUMA node's CPUs (the allocator's ``numa_node``), an equal share of them per rank
    the node hosts; the allocator's ``prefault_threads`` overrides the count. Topology from
    ``machine`` where it has it, else read here (sysfs and this process's affinity)."""
    node = getattr(allocator, "numa_node", None)
    pairs = machine.numa_node_cpus if machine is not None and machine.numa_node_cpus else None
    if pairs is None:
        pairs = node_cpus() if node is not None else ()
    cpus = machine.cpus if machine is not None and machine.cpus else process_cpus()
    if ranks_per_host is None:
        ranks_per_host = machine.ranks_per_host if machine is not None else env_ranks_per_host()
    return fault_share(node, node_cpus=pairs, all_cpus=cpus, ranks_per_host=ranks_per_host,
                       threads=getattr(allocator, "prefault_threads", None))


_P = ParamSpec("_P")
_R = TypeVar("_R")


def _owning_signals(function: Callable[_P, _R]) -> Callable[_P, _R]:
    """A bring-up on the main thread of a process that left SIGTERM/SIGHUP at their default
    (a CLI, a script) undoes itself on them as on Ctrl-C; a server's own handlers stay."""

    @functools.wraps(function)
    def owning(*args: _P.args, **kwargs: _P.kwargs) -> _R:
        with terminate_as_interrupt():
            return function(*args, **kwargs)

    return owning


@_owning_signals
def bring_up(
    requests,
    /,
    *,
    mode=None,
    host: HostSetup | None = None,
    report: Report | None = Report(),
    budget: bool = True,
) -> HostPools:
    """Bring ``requests`` up - `BufferRequest`s, or one `PoolPlan` or several (a model's pools
    on one rank: flat uint8 buffers named ``index/buffer``; `BufferRequest.of_pool` gives a plan's with
    dtypes, or unregistered) - and return the `HostPools` handle that owns them.

    ``mode``: ``"blocking"``, ``"pipelined"``, ``"map-only"`` or `Progressive(...)` (see the
    module charter; None: pipelined where the allocator can map unfaulted, else blocking).
    ``budget=False`` skips the budget (memory someone else already budgeted; otherwise the one
    admission, `hicache.effects.admission.claim`, decides by the setup's figures - or books it in
    the setup's ``server``'s budget scope where one is in force).

    Two concerns come as one value each, so a new feature adds a field, not a keyword here:
    ``host`` - the host's pieces (`HostSetup`: the ``allocator`` the memory comes from, default
    `HostTensorAllocator()`, its ``device``, whether the handle ``owns_memory``; ``runtime``, a
    `HostRuntime`, default
    `default_runtime()`, cuda-python unless `hicache.testing.fake_cuda` is active; ``machine``,
    `MachineFacts`, default `probe_machine()`; the budget's ``lock``, a `BudgetLock`, default
    `budget_lock()`, ``host_memory_bytes`` and ``ranks_per_host`` instead of the machine's,
    ``reserve_bytes``; the ``ledger``; the ``turnstile`` every register call waits its turn at,
    ``"auto"``: HICACHE_PIN_CONCURRENCY's, None: off) - and ``report`` - how it is reported
    (`Report`: the metrics' ``pool`` label, pages and ready pages, default the label
    ``bring_up``, None: not shown - shown once it is up, counted when it fails, released with
    its handle; ``progress(ProgressEvent)``, ``prefault_progress(PrefaultEvent)`` and the
    ``trace`` file). Their fields are theirs alone: the keywords each once had here are gone
    (issue #55: one door per concern), and so are ``dtypes=``/``register=`` (the requests say
    both) and ``flags=``/``retry_halvings=`` (no caller set them: calls register with flags 0 and
    a failed call is undone, not retried smaller).
    Both phases also go to the library's log (INFO, at most a line a second). Raises `CapacityError`
    before allocating when the budget refuses,
    `ApplyError` / `RollbackError` from the executor (everything else undone first).
    """
    # the two concerns' values and the switch, checked before anything is held (they failed later
    # as an AttributeError, and budget="no" was truthy: budgeted)
    if host is not None and not isinstance(host, HostSetup):
        raise PlanError(f"bring_up(host=) must be a HostSetup or None, got {host!r}")
    if report is not None and not isinstance(report, Report):
        raise PlanError(f"bring_up(report=) must be a Report or None, got {report!r}")
    budget = check_bool(PlanError, "bring_up", "budget", budget)
    setup = HostSetup() if host is None else host
    report = Report(metrics=False) if report is None else report  # None: not shown to the metrics
    progress, prefault_progress, trace = report.progress, report.prefault_progress, report.trace
    runtime, machine, lock, ledger = setup.runtime, setup.machine, setup.lock, setup.ledger
    host_memory_bytes, ranks_per_host, reserve_bytes = setup.host_memory_bytes, setup.ranks_per_host, setup.reserve_bytes
    _trace.start(trace) if trace else _trace.from_env()  # record this process's bring-ups (HICACHE_TRACE=FILE)
    turnstile = _turnstile.resolve(setup.turnstile)  # a bad HICACHE_PIN_CONCURRENCY: an error before anything is held
    log = ProgressLog()
    listening = log if log.enabled() else None  # no events made for a log nobody reads
    progress, prefault_progress = tee(listening, progress), tee(listening, prefault_progress)
    requests = _requests(requests)
    allocator, device = host_allocator(setup.allocator), setup.device
    if setup.owns_memory and allocator.owned():  # its handle frees everything the allocator holds
        raise PlanError(f"HostSetup.allocator={allocator!r} already holds {len(allocator.owned())} buffer(s) of "
                        "another bring-up, which this one's release would free: give each bring-up its own "
                        "allocator (or owns_memory=False where the memory is someone else's)")
    mode = _mode(mode, requests, allocator, device)
    handle = HostPools(requests, allocator, ledger, owns_memory=setup.owns_memory, nbytes=[_nbytes(r) for r in requests],
                       mode=mode if isinstance(mode, str) else "progressive", report=report)

    def fill(run: _Run) -> None:  # until the memory is resident (progressive: mapped), outside the lock
        if mode == PIPELINED:
            with _trace.span("map + pre-fault + register (pipelined)", "phase", bytes=handle.total_bytes):
                _pipelined(run)
        elif mode == BLOCKING:
            with _trace.span("allocate + pre-fault", "phase", bytes=handle.total_bytes):
                _allocate(run)
        else:
            with _trace.span("map", "phase", bytes=handle.total_bytes):
                _map(run)

    log.start_heartbeat()  # a line a second while nothing else is logged (INFO only)
    member = False
    try:
        if turnstile is not None:  # from the start: ranks that start together see each other
            turnstile.join()       # before their first call (auto paces from it), not after
            member = True
        start = time.perf_counter()
        claim = None
        if budget:  # held to decide, not to fill (issue #35): ranks that start together fill side by side
            lock = budget_lock() if lock is None else lock
            sampled = []

            def sample():  # the machine, sampled under the lock, once
                sampled.append(probe_machine() if machine is None else machine)
                return sampled[-1]

            policy = AdmissionPolicy(host_memory_bytes=host_memory_bytes, ranks_per_host=ranks_per_host,
                                     reserve_bytes=reserve_bytes, scope=setup.server)  # a server's budget in force books it instead
            claim = admit(handle.total_bytes, policy, lock=lock, sample=sample, owner=report.name,
                          hold=handle._hold_budget)
            machine = sampled[-1] if sampled else machine
        faults_here = mode == PIPELINED or isinstance(mode, Progressive) or (
            mode == BLOCKING and str(device) == "cpu" and allocator.can_map_unfaulted)  # else the allocator faults
        share = _share(allocator, machine, ranks_per_host) if faults_here else None
        run = _Run(handle, requests, runtime, ledger, turnstile, progress,
                   prefault_progress if claim is None else tee(prefault_progress, claim), listening, device, start,
                   share)
        fill(run)
        if claim is not None and not isinstance(mode, Progressive):  # progressive: its faulting counts on
            claim.settle()
        handle.timings["allocate_prefault_s"] = time.perf_counter() - start
        if mode == BLOCKING:
            with _trace.span("register", "phase", bytes=handle.total_bytes):
                _register(run)
        elif isinstance(mode, Progressive):
            with _trace.span("first calls (progressive; the rest in the background)", "phase"):
                _progressive(run, mode)
        handle.timings["ready_s"] = time.perf_counter() - start  # budget wait included: what a caller waited
        log.stop_heartbeat()
        if member:  # a progressive registration stays a member until its thread ends
            member = False
            turnstile.leave()
        handle._activate()
        if claim is not None:
            claim.up()  # a server's scope hears the pool is up, on this (the admitting) thread
        _report.shown(report, handle)  # inside the try, as the flush: a Ctrl-C here still undoes everything
        _trace.flush()
    except BaseException as error:
        log.stop_heartbeat()
        if member:
            turnstile.leave()
        if budget and lock is not None and lock.held:
            lock.release_all()  # an interrupt at the with-exit skipped BudgetLock.__exit__
        handle._abort(error)
        _trace.flush()
        _report.failed(report)
        raise
    return handle
