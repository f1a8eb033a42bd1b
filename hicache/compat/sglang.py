"""Drop-in for SGLang's `pool_host/common.py` registration helpers, under SGLang's names.

Keeps what SGLang's tests pin (chunking by registration granularity under
SGLANG_HICACHE_HOST_REGISTER_CHUNK_GB, ranges recorded on the tensor, reverse rollback,
RuntimeError naming the offset, exactly-once teardown) and fixes what it still gets wrong: int
codes named without cudaGetErrorString(int) (PR #38509), an already-registered buffer is a
no-op instead of a sticky 712 (PR #38832), pending errors drained, KeyboardInterrupt rolled
back, and an unsplittable buffer at the 512 GiB driver ceiling refused before CUDA sees it.
Chunking and rollback are hicache's (plan_registration, apply_plan); nothing is re-implemented.
"""

from __future__ import annotations

import logging
import sys

from hicache._extras import require

require("torch", "hicache.compat.sglang")
from collections import defaultdict

import attrs

from hicache.effects import (
    BufferRequest,
    HostSetup,
    HostTensorAllocator,
    Report,
    apply_plan,
    bring_up,
    for_sglang,
    probe_resolved_limits,
    resolve_numa_node,
)
from hicache.plan import SGLANG_CHUNK_ENV
from hicache.errors import ApplyError, HostAlreadyRegisteredError, PlanError, ReleaseError
from hicache.plan import plan_registration
from hicache.compat import _sglang_log
from hicache.pools import get_allocator_from_storage
from hicache.pools._range_records import RANGES_ATTR
from hicache.plan.checks import is_integer

__all__ = [
    "ALLOC_MEMORY_FUNCS",
    "HostTensorAllocator",
    "_CUDA_HOST_REGISTERED_RANGES_ATTR",
    "_cuda_host_register",
    "_cuda_host_unregister",
    "_cuda_host_unregister_ranges",
    "alloc_with_host_register",
    "alloc_with_pin_memory",
    "get_allocator_from_storage",
    "host_register_chunk_bytes",
]

logger = logging.getLogger(__name__)

_CUDA_HOST_REGISTERED_RANGES_ATTR = RANGES_ATTR  # SGLang's name for it, as its module exports it
_REGISTRATION_ATTR = "_hicache_registration"
_METRICS_ATTR = "_hicache_metrics"  # (pool label, tracked entry) of a buffer's metrics series
_BUFFERS_BY_CLASS: dict = {}  # SGLang pool class -> buffers tracked so far in this process


def _metrics_name() -> str:
    """The ``pool`` label of a buffer SGLang's pool allocates: the calling SGLang class (found
    on the stack: 0.5.23's pools call from their ``__init__``) and the buffer's number among
    that class's in this process - ``MHATokenToKVPoolHost:buffer0``."""
    frame, owner = sys._getframe(2), "sglang"
    for _ in range(8):
        if frame is None:
            break
        caller = frame.f_locals.get("self")
        if caller is not None and type(caller).__module__.startswith("sglang."):
            owner = type(caller).__name__
            break
        frame = frame.f_back
    number = _BUFFERS_BY_CLASS[owner] = _BUFFERS_BY_CLASS.get(owner, -1) + 1
    return f"{owner}:buffer{number}"


def _track(buffer, registration, *, timings=None, allocator=None, tiers=None) -> None:
    """The buffer's registration in hicache's metrics, for `_cuda_host_register` (SGLang's
    register-only helper: no bring-up of ours that could report it)."""
    from hicache import metrics

    if not metrics.available():
        return
    name = _metrics_name()
    tracked = metrics.track_registration(name, registration, timings=timings, allocator=allocator,
                                         total_bytes=buffer.numel() * buffer.element_size(), tiers=tiers)
    setattr(buffer, _METRICS_ATTR, (name, tracked))  # the entry is weak: the tensor keeps it


def _untrack(buffer) -> None:
    tracked = getattr(buffer, _METRICS_ATTR, None)
    if tracked is not None:
        from hicache import metrics

        metrics.released(tracked[0], tracked[1])
CHUNK_ENV = SGLANG_CHUNK_ENV
DEFAULT_CHUNK_GB = 256


def host_register_chunk_bytes(env=None) -> int:
    """SGLANG_HICACHE_HOST_REGISTER_CHUNK_GB as SGLang reads it: GiB, at least 1, default 256.
    Inside an SGLang process (its `sglang.srt.environ` loaded) through SGLang's own `envs`
    accessor - what its tests patch, and its reading of a bad value (a warning, the default);
    elsewhere by `hicache.effects.for_sglang.sglang_register_chunk_bytes` (a non-integer is a ValueError).
    ``env``: a mapping to read instead (never SGLang's)."""
    if env is None:
        from hicache.compat.sglang_process import SGLangProcess

        theirs = SGLangProcess().chunk_limit_bytes()  # the one reading of SGLang's setting (issue #34)
        if theirs is not None:
            return theirs
    return for_sglang.sglang_register_chunk_bytes(env, default_gib=DEFAULT_CHUNK_GB)


def _cudart():
    import torch

    return torch.cuda.cudart()  # looked up at call time: SGLang's tests substitute a fake here


def _base_alignment(ptr: int) -> int:
    # What the plan may assume about the base: the largest power of two dividing it, at most a
    # page. torch.empty bases are often only 64-byte aligned; the plan then keeps copy-unit
    # boundaries and says page alignment was impossible.
    return min(ptr & -ptr, 4096) if ptr else 4096


def _chunk_plan(total: int, granularity, base_alignment: int):
    """The registration plan of a ``total``-byte buffer under SGLang's chunk setting and this
    machine's caps (the driver ceiling, the running kernel's per-pin cap; HICACHE_DRIVER_CEILING
    and HICACHE_KERNEL_PIN_CAP override them), and where each cap came from."""
    limit = host_register_chunk_bytes()
    if granularity is not None:
        if not is_integer(granularity) or granularity <= 0:
            raise PlanError(f"registration_granularity_bytes must be positive, got {granularity!r}")
        if granularity > limit:
            raise PlanError(
                "host registration granularity exceeds the configured chunk limit: "
                f"granularity={granularity}, chunk_limit={limit} ({CHUNK_ENV})"
            )
    chunk_source = f"SGLang's default {DEFAULT_CHUNK_GB} GiB" if limit == DEFAULT_CHUNK_GB * 2**30 else CHUNK_ENV
    resolved = probe_resolved_limits(chunk_limit_bytes=limit, flag_names={"chunk_limit": chunk_source})
    # the buffer is whatever SGLang's allocator mapped: no hugepage alignment is assumed, only
    # what the base address shows
    limits = attrs.evolve(resolved.limits, hugepage_bytes=None, base_alignment_bytes=base_alignment)
    plan = plan_registration(total, granularity_bytes=granularity, limits=limits)
    return plan, resolved.sources


def _raise_for_apply(error: ApplyError):
    """SGLang's callers expect RuntimeError for a refused register, and a plain Ctrl-C."""
    if isinstance(error, HostAlreadyRegisteredError):
        raise RuntimeError(f"cudaHostRegister refused: {error}") from error
    if isinstance(error.__cause__, KeyboardInterrupt):
        raise error.__cause__ from error
    raise error


def _record(buffer, registration) -> None:
    setattr(buffer, _REGISTRATION_ATTR, registration)
    setattr(buffer, _CUDA_HOST_REGISTERED_RANGES_ATTR, [(r.ptr, r.size) for r in registration.ranges])


def _cuda_host_register(buffer, registration_granularity_bytes: int | None = None) -> None:
    """Register ``buffer`` with CUDA in chunks no page copy straddles; record the ranges.

    Chunks are at most SGLANG_HICACHE_HOST_REGISTER_CHUNK_GB GiB, rounded down to a multiple of
    ``registration_granularity_bytes`` (None: one call, as SGLang does for layer-first). A
    buffer whose record already holds ranges is left alone. On failure every registered chunk
    is unregistered in reverse and a RuntimeError names offset and size; a KeyboardInterrupt
    is rolled back and re-raised. ValueError for a granularity <= 0 or above the chunk limit.
    """
    if getattr(buffer, _CUDA_HOST_REGISTERED_RANGES_ATTR, None):
        logger.debug("host buffer at 0x%x is already registered; not registering again", buffer.data_ptr())
        return
    base = buffer.data_ptr()
    total = buffer.numel() * buffer.element_size()
    plan, sources = _chunk_plan(total, registration_granularity_bytes, _base_alignment(base))
    if not plan.ranges:
        setattr(buffer, _CUDA_HOST_REGISTERED_RANGES_ATTR, [])
        return
    _sglang_log.log().info("%s", _sglang_log.plan_line(plan, sources))
    try:
        registration = apply_plan(plan, base_ptr=base, runtime=for_sglang.torch_runtime(_cudart), name="host buffer",
                                  progress=_sglang_log.CallProgress(_sglang_log.log()),
                                  turnstile="auto")  # SGLang's ranks take turns at the driver too (#21)
    except HostAlreadyRegisteredError as error:  # overlaps a registration this process holds
        raise RuntimeError(f"cudaHostRegister refused: {error}") from error
    except BaseException as error:
        # the books of a failed rollback: the error itself, or - a Ctrl-C during the rollback -
        # its cause (the executor raises the interrupt from them)
        books = error if isinstance(error, ApplyError) else error.__cause__
        leaked = list(getattr(books, "leaked", ())) + list(getattr(books, "uncertain", ()))
        if leaked:  # what stays registered stays recorded, so teardown can retry it, and the
            setattr(buffer, _CUDA_HOST_REGISTERED_RANGES_ATTR, leaked)
            for_sglang.quarantine(buffer)  # tensor is kept alive: its memory must never be freed
        if isinstance(error, ApplyError):
            _raise_for_apply(error)
        raise
    _record(buffer, registration)
    _track(buffer, registration, timings={"register_s": registration.status().register_seconds})


def _cuda_host_unregister_ranges(cudart, ranges, *, operation: str) -> list[tuple[int, int]]:
    """Unregister ``(ptr, size)`` ranges in reverse order; return those still registered.

    Every range is attempted (a sticky error stops the rest, which are returned); failures are
    logged with the CUDA error name - never via cudaGetErrorString(int).
    """
    remaining = for_sglang.unregister_ranges(for_sglang.torch_runtime(lambda: cudart), list(ranges))
    if remaining:
        logger.warning(
            "%s left %d host range(s) registered: %s; their memory must not be freed",
            operation, len(remaining), ", ".join(f"(0x{p:x}, {s})" for p, s in remaining),
        )
    return remaining


def _cuda_host_unregister(buffer) -> None:
    """Unregister every recorded chunk of ``buffer`` exactly once, in reverse order.

    A second teardown does nothing. A buffer without a record is unregistered as one
    ``(data_ptr, nbytes)`` range. Ranges that fail stay recorded.
    """
    registration = getattr(buffer, _REGISTRATION_ATTR, None)
    if registration is not None:
        try:
            registration.release()
            remaining = []
        except ReleaseError as error:  # keep what leaked recorded, and its memory alive
            remaining = list(error.leaked)
            for_sglang.quarantine(buffer)
            logger.warning("teardown left %d host range(s) registered: %s", len(remaining), error)
        delattr(buffer, _REGISTRATION_ATTR)
        setattr(buffer, _CUDA_HOST_REGISTERED_RANGES_ATTR, remaining)
        _untrack(buffer)
        return
    ranges = getattr(buffer, _CUDA_HOST_REGISTERED_RANGES_ATTR, None)
    if ranges is None:
        ranges = [(buffer.data_ptr(), buffer.numel() * buffer.element_size())]
    if not ranges:
        return
    remaining = _cuda_host_unregister_ranges(_cudart(), ranges, operation="teardown")
    setattr(buffer, _CUDA_HOST_REGISTERED_RANGES_ATTR, remaining)
    if remaining:
        for_sglang.quarantine(buffer)


def _bring_up_allocator(allocator, device):
    """The allocator a host buffer comes up with. SGLang's default `HostTensorAllocator`
    (``storage/mmap.alloc_mmap``: MAP_POPULATE, so one thread faults the whole buffer inside
    mmap before registration can start) gives way to hicache's: mapped unfaulted, pre-faulted
    in parallel and pipelined with registration, bound to the GPU's NUMA node, MADV_DONTFORK.
    A storage back end's allocator (mooncake, shm, mori, umbp, ...) is kept: its memory is its
    own, hicache plans and registers it."""
    cls = type(allocator)
    if str(device) != "cpu" or cls.__name__ != "HostTensorAllocator" or not cls.__module__.startswith("sglang."):
        return allocator
    try:
        node, _ = resolve_numa_node("auto")
    except Exception:  # placement is an optimisation: a probe that fails places nothing
        node = None
    from hicache.effects import pool_settings

    hugepages = pool_settings().hugepages  # "auto" unless HICACHE_HUGEPAGES says (checked at the plug-in's load)
    return HostTensorAllocator(numa_node=node, hugepages=hugepages)


def alloc_with_host_register(
    dims, dtype, device, pin_memory, allocator, registration_granularity_bytes: int | None = None
):
    """Allocate with ``allocator`` and, when ``pin_memory``, register in copy-unit chunks.

    Through hicache's one bring-up (`hicache.effects.bring_up`) without a budget check of its
    own (SGLang's pool budgets before it calls this; with the plug-in that check claims the
    request on the host's budget until this returns, see `hicache.effects.admission`): the plan is made for the real base address
    (a ``torch.empty`` base is often only 64-byte aligned; boundaries then follow the copy
    unit). Errors as `_cuda_host_register`; on failure nothing stays registered, or what does
    is quarantined with its memory.
    """
    import torch

    from hicache.effects import admission

    if not all(is_integer(d) for d in dims):  # 2.5 is not 2
        raise TypeError(f"alloc_with_host_register: dims must be integers, got {tuple(dims)!r}")
    dims = tuple(d.__index__() for d in dims)
    total = torch.empty((), dtype=dtype).element_size()
    for d in dims:
        total *= d
    if not pin_memory:
        try:
            return allocator.allocate(dims, dtype=dtype, device=device)
        finally:
            admission.resident(total)
    log = _sglang_log.log()
    try:
        plan, sources = _chunk_plan(total, registration_granularity_bytes, 4096)
        if plan.ranges:
            log.info("%s", _sglang_log.plan_line(plan, sources))
        chosen = _bring_up_allocator(allocator, device)
        name = _metrics_name()  # SGLang's pool class and the buffer's number: the metrics' pool label
        # hicache's own allocator (SGLang's default swapped out) is this call's: a failed bring-up
        # unmaps what it mapped. A back end's allocator keeps its memory whatever happens.
        host = HostSetup(runtime=for_sglang.torch_runtime(_cudart), allocator=chosen, device=device,
                         owns_memory=chosen is not allocator)
        handle = bring_up([BufferRequest("host buffer", dims, dtype, plan)], host=host, budget=False,
                          report=Report(name, progress=_sglang_log.CallProgress(log)))  # detach() hands the metrics on too
    except BaseException as error:
        admission.abandon()  # an admitted request that failed drops its claim now
        if isinstance(error, (ApplyError, HostAlreadyRegisteredError)):
            _raise_for_apply(error)
        raise
    admission.resident(total)  # resident and registered: the kernel counts it, the claim goes
    if plan.ranges:
        log.info("%s", _sglang_log.timing_line(total, handle.timings, plan.call_count))
    buffer = handle.tensors[0]
    registration = handle.detach()  # the tensor's owner releases it (_cuda_host_unregister); the metrics follow
    if registration is None:  # a zero-byte buffer has nothing to register
        setattr(buffer, _CUDA_HOST_REGISTERED_RANGES_ATTR, [])
    else:
        _record(buffer, registration)
        setattr(buffer, _METRICS_ATTR, (name, getattr(registration, "reported", None)))
    return buffer


def alloc_with_pin_memory(
    dims, dtype, device, pin_memory, allocator, registration_granularity_bytes: int | None = None
):
    """Allocate pinned through the framework (NPU, MUSA): no cudaHostRegister involved."""
    del registration_granularity_bytes  # the framework's pinned allocator is one block
    return allocator.allocate(dims, dtype=dtype, device=device, pin_memory=pin_memory)


#: Allocation function by device type: CUDA and unknown types register; npu/musa pin via torch.
ALLOC_MEMORY_FUNCS = defaultdict(
    lambda: alloc_with_host_register,
    {"cuda": alloc_with_host_register, "npu": alloc_with_pin_memory, "musa": alloc_with_pin_memory},
)
