"""The executor: apply a plan (or a whole pool's) as one all-or-nothing transaction.

Owns the journal (a range is journaled only after its register call succeeded), the reverse
rollback that attempts every undo and stops only at a sticky error, the `Registration` handle
with its idempotent release and finalizer, and progress reporting. It holds no policy: the
retry shape comes from the pure `replan`. Never frees memory; see _host_memory for that.
"""

from __future__ import annotations

import threading
import time
import warnings
import weakref

import attrs

from hicache.effects._ledger import PROCESS_LEDGER, HostLedger
from hicache.effects._runtime import HostRuntime
from hicache.errors import (
    ApplyError,
    CudaCallError,
    CudaUnavailableError,
    HostAlreadyRegisteredError,
    HostNotRegisteredError,
    PlanError,
    ReleaseError,
    RollbackError,
    StickyCudaError,
)
from hicache.plan import PoolPlan, RegistrationPlan, replan
from hicache.plan._checks import check_int
from hicache.effects._codes import ALREADY_REGISTERED, NAMES


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


@attrs.frozen
class RegisteredRange:
    """One successful ``cudaHostRegister``: which buffer, which chunk, where."""

    buffer: str
    index: int
    ptr: int
    size: int


@attrs.frozen
class RegistrationStatus:
    """A frozen snapshot of a `Registration`.

    ``state`` is ``"active"``, ``"released"`` or ``"leaked"`` (a release left ranges
    registered: ``leaked`` lists them as ``(ptr, size)``).
    """

    state: str
    ranges: tuple[RegisteredRange, ...]
    registered_bytes: int
    call_count: int
    retries: int
    register_seconds: float
    register_gbps: float
    release_seconds: float | None
    leaked: tuple[tuple[int, int], ...]


class _State:
    """Everything release needs, kept apart from `Registration` so its finalizer can run."""

    def __init__(self, runtime, ledger, entries, spans, retries, seconds) -> None:
        self.lock = threading.Lock()
        self.runtime = runtime
        self.ledger = ledger
        self.entries: list[RegisteredRange] = entries
        self.spans = spans  # ledger claims: (ptr, size) per buffer
        self.retries = retries
        self.register_seconds = seconds
        self.registered_bytes = sum(e.size for e in entries)
        self.state = "active"
        self.leaked: tuple[tuple[int, int], ...] = ()
        self.release_seconds: float | None = None


def _undo(runtime, entries, uncertain=None):
    """Unregister ``entries`` in reverse order, attempting every one.

    Returns ``(leaked, unknown, interrupt)``: ranges certainly still registered; the
    interrupted in-flight range (``uncertain``) when its fate cannot be known; and a
    KeyboardInterrupt/SystemExit that arrived meanwhile, for the caller to re-raise once the
    books are straight. A sticky error poisons the context: nothing after it can succeed, so
    the rest is reported without further calls. Any other failure leaves that range counted as
    registered and moves on. A 713 (not registered) means the range is not pinned: undone.
    ``uncertain`` - a register call an interrupt cut short - is undone first.
    """
    leaked: list[tuple[int, int]] = []
    unknown: list[tuple[int, int]] = []
    interrupt = None
    pending = list(reversed(entries))
    if uncertain is not None:
        pending.insert(0, uncertain)
    while pending:
        entry = pending.pop(0)
        bucket = unknown if entry is uncertain else leaked
        try:
            runtime.unregister(entry.ptr)
        except HostNotRegisteredError:
            pass  # CUDA holds no registration there: nothing is pinned
        except StickyCudaError:
            bucket.append((entry.ptr, entry.size))
            leaked.extend((e.ptr, e.size) for e in pending)
            break
        except Exception:  # every undo is attempted; this range stays counted as held
            bucket.append((entry.ptr, entry.size))
        except BaseException as error:  # Ctrl-C mid-undo: finish the undo, then re-raise
            bucket.append((entry.ptr, entry.size))  # its outcome is unknown: assume pinned
            interrupt = interrupt or error
    return sorted(leaked), unknown, interrupt


def _release(state: _State) -> None:
    with state.lock:
        if state.state == "released":
            return
        if state.state == "leaked":
            raise ReleaseError(_leak_message("release", state.leaked), leaked=state.leaked)
        start = time.perf_counter()
        leaked, _, interrupt = _undo(state.runtime, state.entries)
        state.release_seconds = time.perf_counter() - start
        state.ledger.replace([ptr for ptr, _ in state.spans], leaked)
        state.leaked = tuple(leaked)
        state.state = "leaked" if leaked else "released"
        if interrupt is not None:
            raise interrupt
        if leaked:
            raise ReleaseError(_leak_message("release", state.leaked), leaked=state.leaked)


def _leak_message(what: str, leaked) -> str:
    shown = ", ".join(f"(0x{p:x}, {s})" for p, s in leaked[:8])
    more = f" and {len(leaked) - 8} more" if len(leaked) > 8 else ""
    return (
        f"{what} left {len(leaked)} range(s) registered: {shown}{more}; the memory behind "
        "them must not be unmapped or freed"
    )


def _finalize(state: _State) -> None:
    if state.state != "active":
        return
    warnings.warn(
        f"a Registration of {state.registered_bytes} bytes in {len(state.entries)} call(s) "
        "was garbage-collected without release(); releasing it now",
        ResourceWarning,
        stacklevel=2,
    )
    try:
        _release(state)
    except ReleaseError as error:
        warnings.warn(str(error), ResourceWarning, stacklevel=2)


class Registration:
    """Host memory registered by `apply_plan` / `apply_pool_plan`; release it when done.

    A context manager. `release()` attempts every unregister, is idempotent, and raises
    `ReleaseError` (``.leaked``) when some range stays registered. A registration that is
    garbage-collected unreleased is released by a finalizer, with a `ResourceWarning`.
    """

    def __init__(self, state: _State) -> None:
        self._state = state
        self._finalizer = weakref.finalize(self, _finalize, state)

    def __enter__(self) -> "Registration":
        return self

    def __exit__(self, *exc_info) -> None:
        self.release()

    def release(self) -> None:
        """Unregister every range (in reverse); safe to call twice."""
        _release(self._state)

    @property
    def ranges(self) -> tuple[RegisteredRange, ...]:
        """The registered ranges, in the order they were registered."""
        return tuple(self._state.entries)

    def status(self) -> RegistrationStatus:
        """A frozen snapshot: state, ranges, bytes, calls, timings, GB/s, leaks."""
        state = self._state
        seconds = state.register_seconds
        return RegistrationStatus(
            state=state.state,
            ranges=tuple(state.entries),
            registered_bytes=state.registered_bytes,
            call_count=len(state.entries),
            retries=state.retries,
            register_seconds=seconds,
            register_gbps=state.registered_bytes / seconds / 1e9 if seconds > 0 else 0.0,
            release_seconds=state.release_seconds,
            leaked=state.leaked,
        )

    def __repr__(self) -> str:
        s = self._state
        return f"<Registration {s.state}: {s.registered_bytes} bytes in {len(s.entries)} call(s)>"


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


def _apply(items, *, runtime, flags, progress, retry_halvings, ledger) -> Registration:
    _check_items(items, runtime, flags)
    ledger = PROCESS_LEDGER if ledger is None else ledger
    spans = [(base, plan.total_bytes) for _, base, plan in items if plan.total_bytes]
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
    journal: list[RegisteredRange] = []
    total = sum(plan.total_bytes for _, _, plan in items)
    done = retries = 0
    in_flight = None  # a call whose outcome an interrupt may have hidden
    where = "before the first call"
    start = time.perf_counter()
    try:
        for buffer_index, (name, base, plan) in enumerate(items):
            halvings, index = retry_halvings, 0
            while index < len(plan.ranges):
                item = plan.ranges[index]
                where = (
                    f"buffer {name!r} chunk {index + 1} of {len(plan.ranges)} "
                    f"(offset={item.offset}, size={item.size}, ptr=0x{base + item.offset:x})"
                )
                in_flight = RegisteredRange(name, index, base + item.offset, item.size)
                try:
                    runtime.register(base + item.offset, item.size, flags)
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
                journal.append(in_flight)
                in_flight = None
                done += item.size
                index += 1
                if progress is not None:
                    progress(ProgressEvent(
                        name, buffer_index, index, len(plan.ranges), done, total,
                        time.perf_counter() - start,
                    ))
    except BaseException as failure:
        leaked, unknown, interrupt = _undo(runtime, journal, in_flight)
        ledger.replace([ptr for ptr, _ in spans], leaked + unknown)  # both stay off-limits
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
                f"{head}; rolled back {len(journal)} registration(s), nothing is left registered"
            )
        if interrupt is not None:  # Ctrl-C during the rollback itself: honour it, with the books
            raise interrupt from error
        raise error from failure
    return Registration(_State(runtime, ledger, journal, spans, retries, time.perf_counter() - start))


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
        retry_halvings=retry_halvings, ledger=ledger,
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
) -> Registration:
    """Register every buffer of ``pool_plan`` as **one** transaction (see `apply_plan`).

    ``base_ptrs``: one base address per buffer, in the plan's order. If the third buffer fails,
    the first two are rolled back too (SGLang leaves them pinned).
    """
    items = _pool_items(pool_plan, base_ptrs, "apply_pool_plan")
    return _apply(
        items, runtime=runtime, flags=flags, progress=progress,
        retry_halvings=retry_halvings, ledger=ledger,
    )


def apply_pool_plans(
    pools,
    *,
    runtime: HostRuntime,
    flags: int = 0,
    progress=None,
    retry_halvings: int = 0,
    ledger: HostLedger | None = None,
) -> Registration:
    """Register several pools - ``(pool_plan, base_ptrs)`` pairs - as **one** transaction.

    A model's pools on one rank (MLA ``kv`` + DSA ``indexer``, attention + Mamba state) come up
    together or not at all. Buffers are named ``pool_index/buffer`` in errors and progress.
    """
    items = []
    for index, (pool_plan, base_ptrs) in enumerate(pools):
        items += _pool_items(pool_plan, base_ptrs, f"apply_pool_plans: pools[{index}]", f"{index}/")
    return _apply(
        items, runtime=runtime, flags=flags, progress=progress,
        retry_halvings=retry_halvings, ledger=ledger,
    )


def unregister_ranges(runtime: HostRuntime, ranges) -> list[tuple[int, int]]:
    """Unregister ``(ptr, size)`` ranges in reverse order with the executor's undo rules.

    For ranges registered outside a `Registration` (records kept elsewhere, e.g. on an SGLang
    tensor). Attempts every one, stops at a sticky error; returns those still registered.
    """
    entries = [RegisteredRange("range", i, int(ptr), int(size)) for i, (ptr, size) in enumerate(ranges)]
    leaked, _, interrupt = _undo(runtime, entries)
    if interrupt is not None:
        raise interrupt
    order = {(e.ptr, e.size): e.index for e in entries}
    return sorted(leaked, key=lambda pair: order[pair])
