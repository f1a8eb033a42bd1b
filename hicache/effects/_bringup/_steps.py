"""The steps of one bring-up, each taking its `_Run` record (issue #34 item 5): allocate and
pre-fault (`_allocate`), map unfaulted (`_map`), map + background pre-fault + register as pages
become resident (`_pipelined`), register a plan (`_register`), and the progressive start
(`_progressive`: the first calls here, the rest in the background), their pre-fault on the
run's `FaultShare` of threads and CPUs (the blocking one's too, unless its allocator faults). `_bring_up.bring_up` orders
them under the budget lock and undoes them through the handle; each step puts what it made in
the handle's books before anything can fail after it.
"""

from __future__ import annotations

import time

import attrs

from hicache.effects._bringup._faulting import Prefaulter, ProgressiveFaulting
from hicache.effects._bringup._handle import HostPools
from hicache.effects._bringup._progress import PrefaultCounter
from hicache.effects._cuda._executor import ProgressEvent, _apply
from hicache.effects._cuda._progressive import Chunk, ProgressiveRegistration
from hicache.effects._cuda._gate import Gate
from hicache.effects._cuda._runtime import default_runtime
from hicache.effects._host._numa import FaultShare
from hicache.effects._interrupts import deferred_interrupts
from hicache.plan import RegistrationPlan, plan_registration


def _fault_options(run: _Run) -> dict:
    """The background pre-fault's threads and CPUs: the run's `FaultShare`, else the allocator's."""
    if run.share is None:
        return {"threads": run.handle.allocator.prefault_threads}
    return {"threads": run.share.threads, "cpus": run.share.cpus}


def _thp(run: _Run):
    """``hugepages="auto"``: the bring-up's `ThpAuto` (kept on the handle for its report), which
    decides each pre-fault piece's page size just before it faults; None for any other mode."""
    allocator = run.handle.allocator
    if getattr(allocator, "hugepages", None) != "auto":
        return None
    from hicache.effects._host._thp import ThpAuto

    run.handle.thp = ThpAuto(node=getattr(allocator, "numa_node", None))
    return run.handle.thp


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


@attrs.frozen
class _Run:
    """One bring-up as its steps need it (issue #34 item 5: the mode functions take this one
    record, not nine positional arguments): the handle that owns what they make, the requests,
    CUDA's runtime and ledger, the turnstile, who hears of progress, the device
    and when it started."""

    handle: HostPools
    requests: tuple
    runtime: object
    ledger: object
    turnstile: object
    progress: object
    prefault_progress: object
    log: object  # the library's progress log (None: nobody reads it)
    device: str
    start: float
    share: FaultShare | None = None  # where this room's pre-fault runs (None: the allocator's threads, unpinned; blocking: the allocator faults)


def _items(handle: HostPools, requests) -> list:
    return [(r.name, t.data_ptr(), _aligned_plan(r.plan, t.data_ptr()))
            for r, t in zip(requests, handle.tensors) if r.plan is not None and r.plan.total_bytes]


def _register(run: _Run, before_call=None) -> None:
    handle = run.handle
    items = _items(handle, run.requests)
    handle.plans = [plan for _, _, plan in items]
    if not items:
        return
    runtime = default_runtime() if run.runtime is None else run.runtime
    with deferred_interrupts():  # a Ctrl-C after the last call lands once it is stored
        registration = _apply(
            # flags 0 (cudaHostRegisterDefault); a failed call is undone, not retried smaller
            items, runtime=runtime, flags=0, progress=run.progress, retry_halvings=0, ledger=run.ledger,
            gate=Gate(run.turnstile, ready=before_call),
        )
        handle._hold_registration(registration)
    handle.timings["register_s"] = registration.status().register_seconds


def _unfaulted(handle: HostPools, requests) -> list:
    buffers = []
    for request in requests:
        dtype = request.dtype if request.dtype is not None else _uint8()
        tensor, buffer = handle.allocator.allocate_unfaulted(request.shape, dtype)
        handle.tensors.append(tensor)
        buffers.append(buffer)
    return buffers


def _pipelined(run: _Run) -> None:
    """Map every buffer unfaulted, fault them in the background, register as they become
    resident; the faulting thread is stopped and joined before anything can be freed."""
    handle = run.handle
    buffers = _unfaulted(handle, run.requests)
    on_piece = PrefaultCounter(handle.total_bytes, run.prefault_progress) if run.prefault_progress is not None else None
    faulter = Prefaulter(buffers, on_piece=on_piece, thp=_thp(run), **_fault_options(run)).start()
    try:
        _register(run, before_call=faulter.wait)
    except BaseException:
        faulter.stop()  # after the piece in flight; the memory is freed only once it has ended
        faulter.join(quiet=True)  # the executor's error (it carries any faulting error) wins
        _faulting_time(handle, faulter.seconds)
        raise
    faulter.join()
    _faulting_time(handle, faulter.seconds)


def _map(run: _Run) -> None:
    run.handle.host_buffers = _unfaulted(run.handle, run.requests)


def _faulting_time(handle: HostPools, seconds: float) -> None:
    handle.allocator.add_prefault_time(seconds)
    handle.timings["prefault_s"] = seconds


def _allocate(run: _Run) -> None:
    """Every buffer allocated and resident before anything is registered (blocking). Where the
    allocator maps unfaulted, this room faults the memory as the pipelined mode does - on the
    run's `FaultShare` of the pool's node (issue #35 item 2), each piece counted in the claim
    and the progress - and waits for it; otherwise the allocator faults it its own way."""
    handle = run.handle
    if run.share is not None:  # set where this room faults (`_bring_up`: an allocator that maps unfaulted)
        buffers = _unfaulted(handle, run.requests)
        on_piece = PrefaultCounter(handle.total_bytes, run.prefault_progress) if run.prefault_progress is not None else None
        # nice=0: nothing of this bring-up runs beside it (the allocator's own faulting is not nicer)
        faulter = Prefaulter(buffers, on_piece=on_piece, nice=0, thp=_thp(run), **_fault_options(run))
        try:
            faulter.start()
            faulter.join()  # a Ctrl-C here is re-raised once the threads have ended
        except BaseException:
            faulter.stop()
            faulter.join(quiet=True)  # the memory is freed only once no thread faults it
            raise
        finally:
            _faulting_time(handle, faulter.seconds)
        return
    for request in run.requests:
        dtype = request.dtype if request.dtype is not None else _uint8()
        handle.tensors.append(handle.allocator.allocate(request.shape, dtype=dtype, device=run.device))


def _progressive(run: _Run, settings) -> None:
    """Fault and register call by call (``settings``: the bring-up's `Progressive`): the first
    calls here, until ``settings.ready()``, the
    rest in the background. Both threads are in the handle's books before either starts, so a
    failing start is undone by the handle's release. ``log`` hears of every call (the
    library's progress lines); a caller's ``progress`` does not (it would run in the thread)."""
    handle, requests, start, log = run.handle, run.requests, run.start, run.log
    order = settings.order
    if order is None:
        order = [(index, item.offset, item.size) for index, request in enumerate(requests) for item in request.plan.ranges]
    chunks = []
    for index, offset, size in order:  # a legal plan of every buffer (`_bring_up._check_order`)
        request, tensor = requests[index], handle.tensors[index]
        plan = request.plan
        chunks.append(Chunk(request.name, tensor.data_ptr() + offset, size, plan.granularity_bytes, plan.limits))
    buffer_of = [index for index, _, _ in order]
    handle.plans = [r.plan for r in requests]

    first_call = handle._first_call  # not the handle: the thread must not keep it alive
    user_on_chunk = settings.on_chunk
    total = sum(size for _, _, size in order)
    registered = [0]

    def on_chunk(position: int, done: int, size: int) -> None:
        if not first_call:
            first_call.append(time.perf_counter() - start)
        registered[0] += size
        if log is not None:
            log(ProgressEvent(chunks[position].buffer, buffer_of[position], position + 1, len(chunks), registered[0],
                              total, time.perf_counter() - start))
        if user_on_chunk is not None:
            user_on_chunk(position, done, size)

    on_piece = PrefaultCounter(total, run.prefault_progress) if run.prefault_progress is not None else None
    faulting = ProgressiveFaulting(handle.host_buffers, order, key=settings.key, on_piece=on_piece,
                                   thp=_thp(run), **_fault_options(run))
    registration = ProgressiveRegistration(
        chunks, runtime=default_runtime() if run.runtime is None else run.runtime, ledger=run.ledger, on_chunk=on_chunk,
        max_stall_s=settings.max_stall_s, key=settings.key, before_call=faulting.before_call,
        resident=faulting.resident, turnstile=run.turnstile,
    )
    handle._hold_progressive(registration, faulting)
    # the registration thread first, then the pre-fault (no thread starts while a pre-fault
    # call holds the mmap lock), then register here until ready()
    registration.start(settings.ready, begin=faulting.start)
