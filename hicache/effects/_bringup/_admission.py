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
this one fills, and counts this one's pending bytes. The verdict and the claim are the one admission's
(`hicache.effects._hostwide._claim.claim`, with SGLang's arithmetic as the policy's
``allowance`` and a claim that goes once resident). `resident(nbytes)` (compat's
``alloc_with_host_register``, once a buffer is pre-faulted and registered) pays this thread's
claim off; when all of it is resident the claim is dropped (the kernel counts those bytes now).
`abandon()` drops what is left; a claim nobody finishes (a pool failing between its check and
its allocation) is dropped after `HOLD_LIMIT_S`; a rank killed mid-fill leaves none (dead
processes' claims are pruned). Before it samples, this process's dropped mappings still on the
release thread are given back (`wait_for_releases`). Imports the host-wide room and the host
room's release.

Callers outside effects reach these through the `hicache.effects.admission` sub-face, which also
names the host-wide budget lock and the registration turnstile's type (for ``HostSetup(turnstile=)``).
"""

from __future__ import annotations

import logging
import threading

from hicache.effects._host._release import RELEASE_WAIT_S, wait_for_releases
from hicache.effects._hostwide._claim import RESIDENT, AdmissionPolicy, Refused, claim
from hicache.effects._hostwide._lock import budget_lock

#: The longest an admitted request's claim waits for its buffers (seconds): a pool whose
#: constructor fails between the check and the allocation must not shrink the host's room.
HOLD_LIMIT_S = 600.0

log = logging.getLogger(__name__)
_STATE = threading.local()  # .sampling, .pending (while SGLang samples), .claim (this thread's open claim), .paid


def _open_claim():
    """This thread's admitted, not yet resident requests: one `Claim` (None once it is given back)."""
    open_claim = getattr(_STATE, "claim", None)
    if open_claim is not None and open_claim.closed:  # it expired meanwhile
        _STATE.claim = open_claim = None
    return open_claim


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
    def allowance(nbytes: int, pending: int) -> int:  # this thread's open claim counts as pending too
        _STATE.pending = pending
        return original(nbytes, auto_size=auto_size)

    policy = AdmissionPolicy(allowance=allowance, until=RESIDENT, expire_s=HOLD_LIMIT_S)
    try:
        admitted = settled_claim(requested_bytes, policy, lock=budget_lock(), owner="SGLang's host pool")
    except Refused as refused:  # SGLang's own arithmetic said no: its answer, as it is, claims nothing
        return refused.allowance
    open_claim = _open_claim()
    if admitted.nbytes and not (open_claim is not None and open_claim.join(admitted)):
        _STATE.claim, _STATE.paid = admitted, 0  # else pool after pool in one constructor: one claim
    return admitted.allowance


def settled_claim(nbytes: int, policy: AdmissionPolicy = AdmissionPolicy(), **kwargs):
    """`claim` (the one admission) once this process's dropped mappings still on the release
    thread are given back (`wait_for_releases`, before the lock: peers never wait on it): the
    kernel counts their pages as used until then, and a pool rebuilt right after its
    predecessor's last view died would be judged short of memory it is about to get. What
    every admission of this process asks: a pool's bring-up, SGLang's check, the node store."""
    if not wait_for_releases():
        log.warning("hicache: this process's dropped host memory is still being given back after %.0f s; admitting "
                    "%d bytes against what the kernel counts free now", RELEASE_WAIT_S, nbytes)
    return claim(nbytes, policy, **kwargs)


def resident(nbytes: int) -> None:
    """``nbytes`` of an admitted request are resident (or failed): once all are, its claim goes."""
    open_claim = _open_claim()
    if open_claim is None:
        return
    _STATE.paid = getattr(_STATE, "paid", 0) + nbytes
    if _STATE.paid >= open_claim.nbytes:
        _STATE.claim = None
        open_claim.settle()  # a claim kept until resident: settling gives it back


def abandon() -> None:
    """The request's allocation failed: drop its claim now."""
    open_claim = _open_claim()
    if open_claim is not None:
        _STATE.claim = None
        open_claim.abandon()
