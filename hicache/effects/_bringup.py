"""The one bring-up of host pools, used by `HostKVCache`, `hicache apply` and compat.sglang.

Owns the sequence budget (under the host-wide lock) -> allocate + pre-fault -> register every
buffer as one transaction -> a `HostPools` handle whose `release()` undoes it in order
(unregister, then free; memory CUDA may still pin is quarantined, never unmapped; the budget
entry is dropped last). The budget lock is held until the memory is resident, so ranks that
start together each see the others' pools as used memory and never overcommit (sglang
#38156). Machine facts, the lock, the allocator and the runtime are parameters.
"""

from __future__ import annotations

import time

import attrs

from hicache.effects._allocators import HostTensorAllocator
from hicache.effects._executor import _apply
from hicache.effects._host_pools import HostPools
from hicache.effects._interrupts import deferred_interrupts
from hicache.effects._lock import budget_lock
from hicache.effects._pipeline import Prefaulter
from hicache.effects._probes import probe_machine
from hicache.effects._runtime import default_runtime
from hicache.errors import PlanError
from hicache.plan import DEFAULT_RESERVE_BYTES, PoolPlan, RegistrationPlan, check_budget, plan_registration


@attrs.frozen
class BufferRequest:
    """One host buffer to bring up: its name, shape and torch dtype (None: uint8), and the plan
    to register it by (None: allocate only, e.g. ``pin_memory=False``)."""

    name: str
    shape: tuple = attrs.field(converter=lambda dims: tuple(int(d) for d in dims))
    dtype: object = None
    plan: RegistrationPlan | None = None


def pool_requests(pool_plan: PoolPlan, dtypes=None, *, register: bool = True, prefix: str = "") -> list[BufferRequest]:
    """The requests of every buffer of ``pool_plan`` (``dtypes``: one torch dtype per buffer)."""
    if not isinstance(pool_plan, PoolPlan):
        raise PlanError(f"expected a PoolPlan, got {pool_plan!r}")
    buffers = pool_plan.buffers
    dtypes = [None] * len(buffers) if dtypes is None else list(dtypes)
    if len(dtypes) != len(buffers):
        raise PlanError(f"{len(dtypes)} dtypes for {len(buffers)} buffers")
    requests = []
    for buffer, dtype in zip(buffers, dtypes):
        shape = buffer.spec.shape if dtype is not None else (buffer.spec.nbytes,)
        requests.append(BufferRequest(prefix + buffer.spec.name, shape, dtype, buffer.plan if register else None))
    return requests


def _uint8():
    import torch

    return torch.uint8


def _aligned_plan(plan: RegistrationPlan, ptr: int) -> RegistrationPlan:
    """``plan``, re-planned when the memory's base is less aligned than the plan assumed (a
    hugepage mapping that fell back to normal pages, a 64-byte aligned ``torch.empty``):
    boundaries then follow only what the base really guarantees."""
    assumed = plan.limits.base_alignment_bytes
    if not ptr or ptr % assumed == 0:
        return plan
    real = ptr & -ptr
    limits = attrs.evolve(plan.limits, base_alignment_bytes=real)
    return plan_registration(plan.total_bytes, granularity_bytes=plan.granularity_bytes, limits=limits)


def _nbytes(request: BufferRequest) -> int:
    if request.plan is not None:
        return request.plan.total_bytes
    import torch

    size = torch.empty((), dtype=request.dtype or torch.uint8).element_size()
    for d in request.shape:
        size *= d
    return size


def bring_up_buffers(
    requests,
    *,
    runtime=None,
    allocator=None,
    machine=None,
    host_memory_bytes: int | None = None,
    reserve_bytes: int = DEFAULT_RESERVE_BYTES,
    lock=None,
    budget: bool = True,
    ledger=None,
    progress=None,
    flags: int = 0,
    retry_halvings: int = 0,
    owns_memory: bool = True,
    device: str = "cpu",
    pipelined: bool | None = None,
    prefault: bool = True,
) -> HostPools:
    """Bring ``requests`` (`BufferRequest`s) up as one transaction; see the module charter.

    ``runtime``: a `HostRuntime` (default: `default_runtime()`, cuda-python unless
    `hicache.testing.fake_cuda` is active); ``allocator``: ``.allocate(dims, dtype, device)`` and
    ``.free_all(ledger=)`` (default `HostTensorAllocator`); ``machine``: `MachineFacts` (default
    `probe_machine()`); ``host_memory_bytes`` overrides its available memory; ``lock``: a
    `BudgetLock` (default `budget_lock()`); ``budget=False`` skips the budget (memory someone
    else already budgeted); ``owns_memory=False`` leaves freeing to the tensors' owner.
    Raises `CapacityError` before allocating when the budget refuses, `ApplyError` /
    `RollbackError` from the executor (everything else undone first).
    """
    requests = list(requests)
    for request in requests:
        if not isinstance(request, BufferRequest):
            raise PlanError(f"expected BufferRequests, got {request!r}")
    allocator = HostTensorAllocator() if allocator is None else allocator
    handle = HostPools(requests, allocator, ledger, owns_memory=owns_memory, nbytes=[_nbytes(r) for r in requests])
    registered = [r for r in requests if r.plan is not None and r.plan.total_bytes]
    if pipelined is None:
        pipelined = prefault and bool(registered) and len(registered) == len(requests) and str(device) == "cpu" \
            and hasattr(allocator, "allocate_unfaulted")

    def fill() -> None:  # allocate (+ pre-fault; + register when pipelined)
        if pipelined:
            _pipelined(handle, requests, runtime, flags, progress, retry_halvings, ledger)
        elif not prefault:
            _map_only(handle, requests)
        else:
            _allocate(handle, device)

    try:
        start = time.perf_counter()
        if budget:
            lock = budget_lock() if lock is None else lock
            total = handle.total_bytes
            with lock:  # held until the memory is resident: peers then see it as used
                facts = probe_machine() if machine is None else machine
                available = facts.available_bytes if host_memory_bytes is None else host_memory_bytes
                ranks = facts.ranks_per_host
                check_budget(
                    total, available_bytes=available, ranks_per_host=ranks, reserve_bytes=reserve_bytes,
                    ranks_already_allocated=min(len(lock.peers()), ranks - 1),
                    cgroup_limit_bytes=facts.cgroup_limit_bytes, cgroup_usage_bytes=facts.cgroup_usage_bytes or 0,
                )
                handle._books.budget = (lock, total)  # set first: forgetting more than recorded is harmless
                lock.record(total)
                fill()
        else:
            fill()
        handle.timings["allocate_prefault_s"] = time.perf_counter() - start
        if not pipelined:
            _register(handle, requests, runtime, flags, progress, retry_halvings, ledger)
        handle._books.state = "active"
    except BaseException as error:
        if budget and lock is not None and lock.held:
            lock.release_all()  # an interrupt at the with-exit skipped BudgetLock.__exit__
        handle._abort(error)
        raise
    return handle


def _items(handle: HostPools, requests) -> list:
    return [(r.name, t.data_ptr(), _aligned_plan(r.plan, t.data_ptr()))
            for r, t in zip(requests, handle.tensors) if r.plan is not None and r.plan.total_bytes]


def _register(handle: HostPools, requests, runtime, flags, progress, retry_halvings, ledger, before_call=None) -> None:
    items = _items(handle, requests)
    handle.plans = [plan for _, _, plan in items]
    if not items:
        return
    runtime = default_runtime() if runtime is None else runtime
    with deferred_interrupts():  # a Ctrl-C after the last call lands once it is stored
        handle.registration = _apply(
            items, runtime=runtime, flags=flags, progress=progress,
            retry_halvings=retry_halvings, ledger=ledger, before_call=before_call,
        )
    handle.timings["register_s"] = handle.registration.status().register_seconds


def _pipelined(handle: HostPools, requests, runtime, flags, progress, retry_halvings, ledger) -> None:
    """Map every buffer unfaulted, fault them in the background, register as they become
    resident; the faulting thread is stopped and joined before anything can be freed."""
    buffers = []
    for request in requests:
        dtype = request.dtype if request.dtype is not None else _uint8()
        tensor, buffer = handle.allocator.allocate_unfaulted(request.shape, dtype)
        handle.tensors.append(tensor)
        buffers.append(buffer)
    faulter = Prefaulter(buffers, threads=getattr(handle.allocator, "prefault_threads", None)).start()
    try:
        _register(handle, requests, runtime, flags, progress, retry_halvings, ledger, before_call=faulter.wait)
    except BaseException:
        faulter.stop()  # after the piece in flight; the memory is freed only once it has ended
        faulter.join(quiet=True)  # the executor's error (it carries any faulting error) wins
        _faulting_time(handle, faulter.seconds)
        raise
    faulter.join()
    _faulting_time(handle, faulter.seconds)


def _map_only(handle: HostPools, requests) -> None:
    if not hasattr(handle.allocator, "allocate_unfaulted"):
        raise PlanError(f"bring_up(prefault=False) needs an allocator that can map without faulting, got {handle.allocator!r}")
    handle.host_buffers = []
    for request in requests:
        dtype = request.dtype if request.dtype is not None else _uint8()
        tensor, buffer = handle.allocator.allocate_unfaulted(request.shape, dtype)
        handle.tensors.append(tensor)
        handle.host_buffers.append(buffer)


def _faulting_time(handle: HostPools, seconds: float) -> None:
    if hasattr(handle.allocator, "prefault_s"):
        handle.allocator.prefault_s += seconds
    handle.timings["prefault_s"] = seconds


def _allocate(handle: HostPools, device: str) -> None:
    for request in handle.requests:
        dtype = request.dtype if request.dtype is not None else _uint8()
        handle.tensors.append(handle.allocator.allocate(request.shape, dtype=dtype, device=device))


def bring_up(pools, *, dtypes=None, register: bool = True, **options) -> HostPools:
    """Bring up one `PoolPlan`, or several (a model's pools on one rank), as one transaction.

    ``dtypes``: per pool, one torch dtype per buffer (default: flat uint8 buffers). Buffers of
    several pools are named ``index/buffer``. Other keywords as `bring_up_buffers`.
    """
    single = isinstance(pools, PoolPlan)
    pools = [pools] if single else list(pools)
    if dtypes is None:
        dtypes = [None] * len(pools)
    elif single:
        dtypes = [dtypes]
    requests = []
    for index, (pool, pool_dtypes) in enumerate(zip(pools, dtypes, strict=True)):
        requests += pool_requests(pool, pool_dtypes, register=register, prefix="" if single else f"{index}/")
    return bring_up_buffers(requests, **options)
