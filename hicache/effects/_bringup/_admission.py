"""An admission check under the host-wide budget lock, held until the admitted memory is resident.

What hicache's plug-in wraps SGLang's check with (sglang #38156).

SGLang 0.5.23 asks `pool_host.base.host_memory_budget_bytes(requested)` and then allocates;
ranks (and independent servers) that start together each sample free memory before any of
them allocated, and all are admitted. Wrapped by the plug-in (an AROUND hook), the check takes
hicache's host-wide budget lock first and - when it admits the request - keeps holding it until
this thread's buffers of that request are resident and registered (`hicache.compat.sglang`'s
``alloc_with_host_register`` calls `resident`), the way `bring_up` holds it: the next
rank samples only once this rank's memory is really used, and SGLang's own arithmetic (its
reserve, its ranks-per-host split) decides. A refused request lets the lock go at once; a hold
nobody finishes (a pool that fails between its check and its allocation) ends after
`HOLD_LIMIT_S`. Imports this room's budget lock only.

Admission to the host's driver lives beside it: `Turnstile` (and `turnstile_from_env`) is the
host's registration turnstile (`hicache.effects._hostwide._turnstile`), re-exported here so that
callers can pass their own to ``bring_up(turnstile=)`` through the face's ``admission``.
"""

from __future__ import annotations

import logging
import threading

from hicache.effects._hostwide._lock import budget_lock  # noqa: F401 - also re-exported: the node store's creation takes it
from hicache.effects._hostwide._turnstile import Turnstile, from_env as turnstile_from_env  # noqa: F401 - re-exported

logger = logging.getLogger(__name__)

#: The longest an admitted request keeps the lock waiting for its buffers (seconds): a pool
#: whose constructor fails between the check and the allocation must not stall the host.
HOLD_LIMIT_S = 600.0

_HELD = threading.local()  # .lock, .remaining (bytes still to come up), .timer


def _release(reason: str) -> None:
    lock, timer = getattr(_HELD, "lock", None), getattr(_HELD, "timer", None)
    _HELD.lock = _HELD.timer = None
    _HELD.remaining = 0
    if timer is not None:
        timer.cancel()
    if lock is not None:
        lock.release_all()
        logger.debug("hicache: budget lock released (%s)", reason)


def _expire(lock) -> None:
    logger.warning("hicache: an admitted host pool did not come up within %.0f s; releasing the budget lock",
                   HOLD_LIMIT_S)
    lock.release_all()


def host_memory_budget_bytes(original, requested_bytes: int = 0, *, auto_size: bool = False) -> int:
    """``original(requested_bytes, auto_size=)`` - SGLang's own answer - sampled under the
    host-wide budget lock; an admitted request keeps the lock until its memory is resident
    (see the module charter). The signature of an AROUND hook on SGLang's function."""
    if getattr(_HELD, "sampling", False):  # wrapped twice: the outer call holds the lock already
        return original(requested_bytes, auto_size=auto_size)
    _HELD.sampling = True
    try:
        return _sample(original, requested_bytes, auto_size)
    finally:
        _HELD.sampling = False


def _held_lock():
    """The lock this thread holds for an admitted request whose memory is not resident yet
    (None: none, or its hold ran out - the timer let it go)."""
    lock = getattr(_HELD, "lock", None)
    if lock is not None and not lock.held:
        _release("expired")
        return None
    return lock


def _sample(original, requested_bytes: int, auto_size: bool) -> int:
    held = _held_lock()  # pool after pool in one constructor: this thread samples on under it
    lock = held if held is not None else budget_lock()
    if held is None:
        lock.__enter__()
    try:
        allowance = original(requested_bytes, auto_size=auto_size)
    except BaseException:
        if held is None:
            lock.release_all()
        raise
    if 0 < requested_bytes <= allowance:
        if held is None:
            _HELD.lock, _HELD.remaining = lock, 0
            _HELD.timer = threading.Timer(HOLD_LIMIT_S, _expire, args=(lock,))
            _HELD.timer.daemon = True
            _HELD.timer.start()
        _HELD.remaining += requested_bytes
    elif held is None:
        lock.release_all()  # refused, or only asked: nothing to wait for
    return allowance


def resident(nbytes: int) -> None:
    """``nbytes`` of an admitted request are resident (or failed): once all are, the lock goes."""
    if _held_lock() is None:
        return
    _HELD.remaining -= nbytes
    if _HELD.remaining <= 0:
        _release("resident")


def abandon() -> None:
    """The request's allocation failed: let the lock go now."""
    _release("failed")
