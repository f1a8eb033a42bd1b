"""The executor: apply a plan (or a whole pool's) as one all-or-nothing transaction.

Owns the journal (a range is journaled only after its register call succeeded), the rollback
on any failure (with _registration's undo rules), overlap refusal through the ledger, and
progress reporting. It holds no policy: the retry shape comes from the pure `replan`. Never
frees memory; that is the host room's (`_host._memory`). Imports the rest of this room,
`_interrupts`, `hicache.plan` and `hicache.errors` only.
"""

from __future__ import annotations

import time

import attrs

from hicache.effects._trace import span
from hicache.effects._interrupts import deferred_interrupts, interrupt_for, interrupt_requested
from hicache.effects._cuda._ledger import PROCESS_LEDGER, HostLedger
from hicache.effects._cuda._registration import (
    RegisteredRange,
    Registration,
    _leak_message,
    _State,
    _undo,
)
from hicache.effects._cuda._runtime import HostRuntime
from hicache.effects._cuda._gate import OPEN, Gate
from hicache.errors import (
    ApplyError,
    CudaCallError,
    CudaUnavailableError,
    HostAlreadyRegisteredError,
    HostNotRegisteredError,
    PlanError,
    RollbackError,
    StickyCudaError,
)
from hicache.plan import PoolPlan, RegistrationPlan, pace_head, replan
from hicache.plan.checks import check_int
from hicache.effects._cuda._codes import ALREADY_REGISTERED, NAMES


@attrs.frozen
class ProgressEvent:
    """Reported after every registered chunk (``chunk_index`` counts from 1)."""

    buffer: str
    buffer_index: int
    chunk_index: int
    chunk_count: int
    bytes_done: int
    bytes_total: int
    elapsed_s: float


_NOT_RETRYABLE = (
    StickyCudaError, CudaUnavailableError, HostAlreadyRegisteredError, HostNotRegisteredError,
)


def _check_items(items, runtime, flags) -> None:
    if not isinstance(runtime, HostRuntime):
        raise TypeError(f"runtime must provide register(ptr, size, flags) and unregister(ptr), got {runtime!r}")
    check_int(PlanError, "apply", "flags", flags, minimum=0)
    for name, base, plan in items:
        if not isinstance(plan, RegistrationPlan):
            raise PlanError(f"buffer {name!r}: expected a RegistrationPlan, got {plan!r}")
        check_int(PlanError, f"buffer {name!r}", "base_ptr", base)
        alignment = plan.limits.base_alignment_bytes
        if base % alignment:
            raise PlanError(
                f"buffer {name!r}: base_ptr 0x{base:x} is not aligned to the {alignment} B the "
                "plan assumed (Limits.base_alignment_bytes); plan with the real alignment"
            )


def _apply(items, *, runtime, flags, progress, retry_halvings, ledger, gate: Gate = OPEN) -> Registration:
    """The transaction. Before each register call the ``gate`` paces its size, waits for its
    bytes to be ready (the pipelined bring-up pre-faults them meanwhile) and for its turn at the
    host's driver (`_gate.Gate`); a held Ctrl-C stops those waits."""
    _check_items(items, runtime, flags)
    ledger = PROCESS_LEDGER if ledger is None else ledger
    spans = [(base, plan.total_bytes) for _, base, plan in items if plan.total_bytes]
    journal: list[RegisteredRange] = []
    total = sum(plan.total_bytes for _, _, plan in items)
    done = retries = 0
    in_flight = None  # a call whose outcome an interrupt may have hidden
    where = "before the first call"
    start = time.perf_counter()
    # Ctrl-C is held while a claim or a call and its journal entry are kept together, and
    # honoured between calls (and after the last one, before the handle exists) by the rollback.
    with deferred_interrupts() as held:
        conflict = ledger.claim(spans)
        if conflict is not None:
            (ptr, size), (held_ptr, held_size) = conflict
            raise HostAlreadyRegisteredError(
                f"refused before calling CUDA: [0x{ptr:x}, +{size}) overlaps [0x{held_ptr:x}, "
                f"+{held_size}) which this process already holds (or requested twice); CUDA would "
                "fail with a sticky 712",
                op="cudaHostRegister", code=ALREADY_REGISTERED, name=NAMES[ALREADY_REGISTERED],
                ptr=ptr, size=size,
            )
        member = gate.join()  # other processes' auto turnstiles pace while this one registers
        try:
            for buffer_index, (name, base, plan) in enumerate(items):
                halvings, index = retry_halvings, 0
                while index < len(plan.ranges):
                    interrupt_requested(held)
                    if (paced := gate.paced_bytes()) is not None:  # this call within the stall budget
                        plan = pace_head(plan, index, paced)
                    item = plan.ranges[index]
                    if gate.waits_ready:
                        where = f"buffer {name!r} chunk {index + 1}: waiting for its pre-fault"
                        gate.wait_ready(buffer_index, item.offset + item.size, lambda: held.pending)
                        interrupt_requested(held)
                    where = (
                        f"buffer {name!r} chunk {index + 1} of {len(plan.ranges)} "
                        f"(offset={item.offset}, size={item.size}, ptr=0x{base + item.offset:x})"
                    )
                    turn = gate.turn(lambda: held.pending)  # in arrival order, host-wide
                    if turn is None:  # it stopped waiting for a held Ctrl-C: no call was made
                        raise interrupt_for(held.consume())
                    in_flight = RegisteredRange(name, index, base + item.offset, item.size)
                    registered = False
                    try:
                        with span("cudaHostRegister", "register", buffer=name, chunk=index, offset=item.offset,
                                  size=item.size, ptr=base + item.offset):
                            runtime.register(base + item.offset, item.size, flags)
                        registered = True
                    except CudaCallError as error:
                        in_flight = None  # CUDA answered: the range is certainly not registered
                        if halvings <= 0 or isinstance(error, _NOT_RETRYABLE):
                            raise
                        try:
                            plan = replan(plan, failed_index=index)
                        except PlanError:
                            raise error from None
                        halvings -= 1
                        retries += 1
                        continue
                    finally:  # a registered call's time measures the rate calls are paced by
                        turn.release(item.size if registered else None)
                    journal.append(in_flight)
                    in_flight = None
                    done += item.size
                    index += 1
                    if progress is not None:
                        progress(ProgressEvent(
                            name, buffer_index, index, len(plan.ranges), done, total,
                            time.perf_counter() - start,
                        ))
            if member:  # no call is left to make
                member = False
                gate.leave()
            where = "after the last call"
            interrupt_requested(held)
            return Registration(_State(runtime, ledger, journal, spans, retries, time.perf_counter() - start))
        except BaseException as failure:
            if member:
                gate.leave()
            undone: list = []
            leaked, unknown, interrupt = _undo(runtime, journal, in_flight, undone)
            ledger.replace([ptr for ptr, _ in spans], leaked + unknown)  # both stay off-limits
            if interrupt is None and (signum := held.consume()):
                interrupt = interrupt_for(signum)
            head = f"registering {where} failed: {type(failure).__name__}: {failure}"
            if leaked or unknown:
                detail = _leak_message("rollback", leaked) if leaked else "rollback"
                if unknown:
                    detail += (
                        f"; the interrupted call at 0x{unknown[0][0]:x} (+{unknown[0][1]}) may be "
                        "registered too (its undo failed)"
                    )
                error = RollbackError(f"{head}; {detail}", leaked=tuple(leaked), uncertain=tuple(unknown))
            else:
                error = ApplyError(
                    f"{head}; rolled back {len(undone)} registration(s), nothing is left registered"
                )
            if interrupt is not None:  # Ctrl-C during the rollback itself: honour it, with the books
                raise interrupt from error
            raise error from failure


def apply_plan(
    plan: RegistrationPlan,
    *,
    base_ptr: int,
    runtime: HostRuntime,
    flags: int = 0,
    progress=None,
    retry_halvings: int = 0,
    ledger: HostLedger | None = None,
    name: str = "buffer",
    turnstile=None,
) -> Registration:
    """Register ``plan``'s ranges at ``base_ptr`` in order, all or nothing.

    ``progress(ProgressEvent)`` is called after every chunk (raising from it aborts and rolls
    back). ``retry_halvings``: how many times a non-sticky failure of one chunk may be retried
    with the rest re-split in halves (``replan``; never below the copy unit).

    Raises ``HostAlreadyRegisteredError`` before any call when a range overlaps one this
    process holds; ``ApplyError`` (``__cause__``: the failure, ``KeyboardInterrupt`` included)
    when everything was rolled back; ``RollbackError`` (``.leaked``) when some range could not
    be unregistered.
    """
    return _apply(
        [(name, base_ptr, plan)], runtime=runtime, flags=flags, progress=progress,
        retry_halvings=retry_halvings, ledger=ledger, gate=Gate(turnstile),
    )


def _pool_items(pool_plan, base_ptrs, where: str, prefix: str = "") -> list:
    """(name, base_ptr, plan) per buffer of ``pool_plan``, after checking the pointers fit."""
    if not isinstance(pool_plan, PoolPlan):
        raise PlanError(f"{where}: expected a PoolPlan, got {pool_plan!r}")
    base_ptrs = tuple(base_ptrs)
    if len(base_ptrs) != len(pool_plan.buffers):
        raise PlanError(f"{where}: {len(base_ptrs)} base_ptrs for {len(pool_plan.buffers)} buffers")
    return [(prefix + b.spec.name, ptr, b.plan) for b, ptr in zip(pool_plan.buffers, base_ptrs)]


def apply_pool_plan(
    pool_plan: PoolPlan,
    *,
    base_ptrs,
    runtime: HostRuntime,
    flags: int = 0,
    progress=None,
    retry_halvings: int = 0,
    ledger: HostLedger | None = None,
    turnstile=None,
) -> Registration:
    """Register every buffer of ``pool_plan`` as **one** transaction (see `apply_plan`).

    ``base_ptrs``: one base address per buffer, in the plan's order. If the third buffer fails,
    the first two are rolled back too (SGLang leaves them pinned).
    """
    items = _pool_items(pool_plan, base_ptrs, "apply_pool_plan")
    return _apply(
        items, runtime=runtime, flags=flags, progress=progress,
        retry_halvings=retry_halvings, ledger=ledger, gate=Gate(turnstile),
    )
