"""SGLang's admission check answered from the host's claims (issue #35 item 1): what hicache's
plug-in wraps SGLang's check with (sglang #38156).

SGLang 0.5.23 asks `pool_host.base.host_memory_budget_bytes(requested)` and then allocates;
ranks (and independent servers) that start together each sample free memory before any of them
allocated, and all are admitted. Wrapped by the plug-in (AROUND hooks), the check samples under
hicache's host-wide budget lock - the one `bring_up` decides under - and SGLang's own sample of
available memory (its `available_host_memory_bytes`, wrapped too) comes back less what the
host's claims still have to fault in (`BudgetLock.pending_bytes`): SGLang's own arithmetic (its
reserve, its ranks-per-host split) decides against the claim-aware figure. An admitted request
records its claim before the lock goes, and the lock goes at once: the next rank samples while
this one fills, and counts this one's pending bytes. `resident(nbytes)` (compat's
``alloc_with_host_register``, once a buffer is pre-faulted and registered) pays the claim off;
when all of it is resident the claim is dropped (the kernel counts those bytes now).
`abandon()` drops what is left; a claim nobody finishes (a pool failing between its check and
its allocation) is dropped after `HOLD_LIMIT_S`; a rank killed mid-fill leaves none (dead
processes' claims are pruned). Imports this room's budget lock only.

Callers outside effects reach these through the `hicache.effects.admission` sub-face, which also
names the host-wide budget lock and the registration turnstile's type (for ``HostSetup(turnstile=)``).
"""

from __future__ import annotations

import logging
import threading

from hicache.effects._hostwide._lock import budget_lock

logger = logging.getLogger(__name__)

#: The longest an admitted request's claim waits for its buffers (seconds): a pool whose
#: constructor fails between the check and the allocation must not shrink the host's room.
HOLD_LIMIT_S = 600.0

_STATE = threading.local()  # .sampling, .pending (while SGLang samples), .claim (this thread's open claim)


class _Open:
    """This thread's admitted, not yet resident requests: one claim in the claims file."""

    def __init__(self, lock) -> None:
        self.lock, self.claimed, self.resident = lock, 0, 0
        self.closed = False
        self.timer = threading.Timer(HOLD_LIMIT_S, self.close, args=("expired",))
        self.timer.daemon = True
        self.timer.start()

    def close(self, reason: str) -> None:
        """Drop the claim (all of it; the file counted none of it resident)."""
        if self.closed:
            return
        self.closed = True
        self.timer.cancel()
        if reason == "expired":
            logger.warning("hicache: an admitted host pool did not come up within %.0f s; dropping its claim",
                           HOLD_LIMIT_S)
        with type(self.lock)(self.lock.path.parent) as lock:  # its own file: the timer's thread may close it
            lock.forget(self.claimed, resident=0)
        logger.debug("hicache: budget claim of %d bytes dropped (%s)", self.claimed, reason)


def _open_claim() -> _Open | None:
    claim = getattr(_STATE, "claim", None)
    if claim is not None and claim.closed:  # it expired meanwhile
        _STATE.claim = claim = None
    return claim


def host_memory_budget_bytes(original, requested_bytes: int = 0, *, auto_size: bool = False) -> int:
    """``original(requested_bytes, auto_size=)`` - SGLang's own answer - sampled under the
    host-wide budget lock against available memory less the claims still filling; an admitted
    request is claimed before the lock goes (see the module charter). The signature of an
    AROUND hook on SGLang's function."""
    if getattr(_STATE, "sampling", False):  # wrapped twice: the outer call holds the lock already
        return original(requested_bytes, auto_size=auto_size)
    _STATE.sampling = True
    try:
        return _sample(original, requested_bytes, auto_size)
    finally:
        _STATE.sampling = False
        _STATE.pending = 0


def available_host_memory_bytes(original, *args, **kwargs) -> int:
    """SGLang's sample of available memory - less the host's pending claims while it samples for
    an admission (`host_memory_budget_bytes`); as SGLang's otherwise. An AROUND hook."""
    available = original(*args, **kwargs)
    return max(0, available - getattr(_STATE, "pending", 0))


def _sample(original, requested_bytes: int, auto_size: bool) -> int:
    claim = _open_claim()
    lock = claim.lock if claim is not None else budget_lock()
    with lock:
        _STATE.pending = lock.pending_bytes()  # this thread's open claim too: its bytes are not resident yet
        allowance = original(requested_bytes, auto_size=auto_size)
        if 0 < requested_bytes <= allowance:
            lock.record(requested_bytes)
            if claim is None:
                _STATE.claim = claim = _Open(lock)
            claim.claimed += requested_bytes
    return allowance


def resident(nbytes: int) -> None:
    """``nbytes`` of an admitted request are resident (or failed): once all are, its claim goes."""
    claim = _open_claim()
    if claim is None:
        return
    claim.resident += nbytes
    if claim.resident >= claim.claimed:
        _STATE.claim = None
        claim.close("resident")


def abandon() -> None:
    """The request's allocation failed: drop its claim now."""
    claim = _open_claim()
    if claim is not None:
        _STATE.claim = None
        claim.close("failed")
