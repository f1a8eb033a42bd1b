"""One admission (issue #55 item 3): `claim(nbytes, policy) -> Claim`, the one way memory is
admitted on this host - a pool's bring-up, the node store's creation and SGLang's own check
(the plug-in's hooks) all ask it.

`AdmissionPolicy` is a pure value: the room (measured, or a stated ``host_memory_bytes``), the
ranks sharing it, the reserve, whose arithmetic decides (hicache's `check_budget`, or a server's
own ``allowance``), a server's budget scope that books the request instead, and whether the claim
stays until released (a pool's memory) or goes once resident (memory the kernel then counts).

Held to decide, not to fill (issue #35): under the host-wide budget lock the room is sampled less
what every claim still has to fault in, the verdict given and, admitted, the claim recorded - and
the lock goes. The `Claim` then follows the fill (`filled`, at most every sixteenth of it, never
ahead of the faulted bytes, never waiting for the lock: a skipped update keeps bytes counted as
pending a little longer - too long, never too short), is made whole by `settle`, and is given back
by `release` (after use) or `abandon` (a failed fill) with exactly the resident bytes it counted.
Imports this room's lock and the leaves only.
"""

from __future__ import annotations

import logging
import os
import threading
from typing import Callable

import attrs

from hicache.errors import CapacityError
from hicache.plan import check_budget, format_gb

logger = logging.getLogger(__name__)

MIN_STEP_BYTES = 64 << 20  # the smallest update: a file rewrite per 64 MiB faulted, at most
RELEASED, RESIDENT = "released", "resident"


@attrs.frozen(kw_only=True)
class AdmissionPolicy:
    """How a request for host memory is judged - a pure value.

    ``host_memory_bytes``: a stated room instead of the machine's available memory (peers' live
    claims come off it); ``ranks_per_host`` (None: the machine's) share the room;
    ``reserve_bytes`` stays the OS's. ``allowance``: a server's own arithmetic instead of
    hicache's - ``allowance(nbytes, pending)`` -> the bytes it allows, asked under the lock with
    ``pending`` (what the host's claims still have to fault in) to take off its own sample;
    admitted when ``0 < nbytes <= allowance``. ``scope``: a server whose budget in force books
    the request instead (its ``book_host_memory(nbytes)`` -> the allowance before, or None where
    it has none; ``host_memory_settled(nbytes, up=)``); ``until``: the claim stays counted,
    resident, until released (``"released"``: a pool's memory, peers' stated rooms count it) or
    goes once resident (``"resident"``: the kernel counts it then); ``expire_s``: a claim not
    settled by then is dropped (an admitted request whose caller failed before allocating)."""

    host_memory_bytes: int | None = None
    ranks_per_host: int | None = None
    reserve_bytes: int = 0
    allowance: Callable | None = None
    scope: object = None
    until: str = attrs.field(default=RELEASED, validator=attrs.validators.in_((RELEASED, RESIDENT)))
    expire_s: float | None = None


class Refused(CapacityError):
    """A server's own arithmetic did not admit the request; ``allowance``: what it allowed."""

    def __init__(self, message: str, allowance: int) -> None:
        super().__init__(message)
        self.allowance = allowance


def fixed_room(host_memory_bytes: int, peers: dict, ranks: int) -> int:
    """The room left of a stated host figure (``--host-memory``, ``host_memory_bytes=``): the
    live peers' claims on this host subtracted, as a measured figure has them subtracted by the
    kernel. `CapacityError` when the peers already fill the stated rank count: N claims never
    exceed what the operator said the host holds."""
    claimed = sum(peers.values())
    if len(peers) >= ranks:
        raise CapacityError(
            f"host memory budget refused: {len(peers)} other process(es) on this host (pids "
            f"{', '.join(map(str, sorted(peers)))}) already claim {format_gb(claimed)} of the stated "
            f"{format_gb(host_memory_bytes)} for {ranks} rank(s). Hint: wait for them, or state more ranks or memory "
            "(--ranks-per-host / --host-memory)"
        )
    return max(host_memory_bytes - claimed, 0)


def check_admission(lock, total: int, facts, *, host_memory_bytes: int | None = None, ranks_per_host: int | None = None,
                    reserve_bytes: int = 0) -> None:
    """Under ``lock`` (held by the caller): hicache's budget's answer for ``total`` bytes - a
    `CapacityError` when it refuses - from ``facts``, the machine sampled under the lock, and the
    host's claims: what peers claimed, what every claim still has to fault in (the kernel does not
    count it yet), the cgroup's limit. The one home of this arithmetic (`claim` asks it)."""
    ranks = facts.ranks_per_host if ranks_per_host is None else ranks_per_host
    claims = lock.claims()
    me = os.getpid()
    peers = {pid: entry.claimed for pid, entry in claims.items() if pid != me}
    # what the kernel does not count yet: the claims still filling (this process's other pools too)
    pending = sum(entry.pending for entry in claims.values())
    if host_memory_bytes is None:  # measured: resident memory is gone from it already, pending is not
        available = max(0, facts.available_bytes - pending)
    else:  # a stated figure stands for the host's room: peers' live claims come off it, resident or not
        available = fixed_room(host_memory_bytes, peers, ranks)
    check_budget(
        total, available_bytes=available, ranks_per_host=ranks, reserve_bytes=reserve_bytes,
        ranks_already_allocated=min(len(peers), ranks - 1), cgroup_limit_bytes=facts.cgroup_limit_bytes,
        cgroup_usage_bytes=(facts.cgroup_usage_bytes or 0) + pending if facts.cgroup_limit_bytes else 0,
    )


class Claim:
    """An admitted request's hold on the host's memory while it fills and is used.

    ``nbytes``: what was admitted; ``written``: how many of them the claims file counts resident;
    ``pending``: the rest (0 once given back); ``allowance``: what a server's own arithmetic
    allowed (None under hicache's). Call it with each `PrefaultEvent` (or `filled(done)`), then
    `settle()`; `release()` after use, `abandon()` when the fill failed - both idempotent."""

    def __init__(self, lock, nbytes: int, policy: AdmissionPolicy, *, step: int | None = None,
                 allowance: int | None = None, scope=None) -> None:
        # its own open file of the same lock: the faulting threads never share the admitting
        # thread's (an interrupt there closes it under them); None: a scope's booking, no file
        self.lock = None if lock is None else lock.reopen()
        self.nbytes, self.policy, self.allowance, self.scope = nbytes, policy, allowance, scope
        self.step = step if step is not None else max(nbytes // 16, MIN_STEP_BYTES)
        self.written = 0
        self.settled = False
        self.closed = nbytes == 0 and scope is None  # nothing recorded: nothing to give back
        # one writer of this claim at a time; re-entrant: a Ctrl-C landing in a with-block's
        # cleanup before its __exit__ (CPython bpo-29988) leaves it held by this thread, whose
        # undo then gives the claim back (tests/test_interrupts.py's walk deadlocked on a Lock)
        self._mutex = threading.RLock()
        self._timer = None
        if policy.expire_s is not None and not self.closed:
            self._timer = threading.Timer(policy.expire_s, self._expire)
            self._timer.daemon = True
            self._timer.start()

    @property
    def pending(self) -> int:
        """Admitted bytes the claims file does not count resident yet (0 once given back)."""
        return 0 if self.closed else self.nbytes - self.written

    def __call__(self, event) -> None:
        self.filled(event.bytes_done)

    def filled(self, done: int) -> None:
        """``done`` bytes are resident: counted when a step has filled since the last update (or
        all of it), if the lock is free now - never waiting, never ahead of ``done``."""
        done = min(int(done), self.nbytes)
        with self._mutex:  # a scope's booking (no lock) is settled by its admitting thread (`up`)
            if self.closed or self.lock is None or (done - self.written < self.step and done < self.nbytes):
                return
            if done > self.written and self.lock.try_add_resident(done - self.written):
                self.written = done

    def settle(self) -> None:
        """Every byte of the claim is resident: counted so (a short wait for the lock), or gone
        where the policy keeps it only until then (a scope's booking waits for `up`)."""
        with self._mutex:
            if self.closed or self.settled or self.scope is not None:
                return
            self.settled = True
            self._cancel()
            if self.policy.until == RESIDENT:
                self._forget(wait=True)
            elif self.written < self.nbytes:
                with self.lock:
                    self.lock.add_resident(self.nbytes - self.written)
                self.written = self.nbytes

    def up(self) -> None:
        """The request is served (a pool is up, its background fill may go on): a scope's
        booking settles now, on the admitting thread - a server's own claim for it (SGLang's
        hook keeps it per thread) is paid off; a claim in the file keeps following its fill."""
        with self._mutex:
            if self.scope is None or self.closed:
                return
            self.settled = self.closed = True
            self.scope.host_memory_settled(self.nbytes, up=True)

    def release(self, *, wait: bool = True) -> None:
        """The memory is gone (or no longer this claim's): give back what is recorded, with the
        resident bytes it counted. ``wait=False`` (a finalizer's) never waits for the lock."""
        with self._mutex:
            self._close(up=True, wait=wait)

    def abandon(self, *, wait: bool = True) -> None:
        """The fill failed: give the claim back now (a scope's booking is settled as failed)."""
        with self._mutex:
            self._close(up=False, wait=wait)

    def join(self, other: "Claim") -> bool:
        """Make ``other`` (recorded under the same lock, nothing of it resident) part of this
        claim: one claim of both, given back together (pool after pool in one constructor).
        False, and nothing changed, when this one was given back meanwhile (it expired)."""
        with self._mutex, other._mutex:
            if other.closed or other.written or other.scope is not None or self.scope is not None:
                raise ValueError(f"cannot join {other!r} to {self!r}")
            if self.closed:
                return False
            other._cancel()
            other.closed = True  # its recorded bytes are this claim's now
            self.nbytes += other.nbytes
            return True

    def _close(self, *, up: bool, wait: bool) -> None:
        if self.closed:
            return
        self._cancel()
        if self.scope is not None:
            self.closed = True
            if not self.settled:
                self.scope.host_memory_settled(self.nbytes, up=up)
            return
        self._forget(wait=wait)

    def _forget(self, *, wait: bool) -> None:
        self.closed = True  # first: forgetting twice would take a peer's bytes
        self.lock.forget_soon(self.nbytes, resident=self.written, wait=wait)  # never waits on a holder here

    def _cancel(self) -> None:
        if self._timer is not None:
            self._timer.cancel()

    def _expire(self) -> None:
        with self._mutex:
            if self.closed or self.settled:
                return
            logger.warning("hicache: an admitted host-memory request did not come up within %.0f s; dropping its "
                           "claim", self.policy.expire_s)
            self._forget(wait=True)

    def __repr__(self) -> str:
        state = "given back" if self.closed else "settled" if self.settled else "filling"
        return f"<Claim {self.nbytes} bytes, {self.written} resident, {state}>"


def claim(nbytes: int, policy: AdmissionPolicy = AdmissionPolicy(), *, lock, sample: Callable | None = None,
          step: int | None = None, owner: str = "the request", hold: Callable | None = None) -> Claim:
    """Admit ``nbytes`` by ``policy`` and return its `Claim` (none of it resident yet), or raise
    `CapacityError` (`Refused` where a server's arithmetic said no, with its allowance) having
    recorded nothing. ``lock``: the host-wide `BudgetLock`; ``sample()``: the machine's facts,
    called under it (hicache's arithmetic only). A scope in force books the request instead and
    takes no lock; a request of 0 bytes is answered, not recorded. ``owner`` names the requester
    in a refusal; ``hold(claim)`` is called with the claim before it is recorded, so a Ctrl-C
    between the two leaves it with its holder, never in the file with nobody to give it back
    (giving back more than was recorded is harmless)."""
    if policy.scope is not None:
        allowance = policy.scope.book_host_memory(nbytes)
        if allowance is not None:
            if nbytes > allowance:
                raise CapacityError(
                    f"host memory budget refused: {owner} needs {format_gb(nbytes)}; the {policy.scope.name} process's "
                    f"budget in force has {format_gb(allowance)} left (SGLang's host_memory_budget_scope). Hint: "
                    "lower the host pool size (--hicache-size / --hicache-ratio)")
            admitted = Claim(None, nbytes, policy, allowance=allowance, scope=policy.scope)
            if hold is not None:
                hold(admitted)
            return admitted
    with lock:
        allowance = None
        if policy.allowance is not None:
            allowance = int(policy.allowance(nbytes, lock.pending_bytes()))
            if not 0 < nbytes <= allowance:
                if nbytes == 0:
                    return Claim(lock, 0, policy, allowance=allowance)
                raise Refused(f"host memory budget refused: {owner} requests {format_gb(nbytes)}, the server's "
                              f"arithmetic allows {format_gb(allowance)}", allowance)
        else:
            check_admission(lock, nbytes, sample(), host_memory_bytes=policy.host_memory_bytes,
                            ranks_per_host=policy.ranks_per_host, reserve_bytes=policy.reserve_bytes)
        admitted = Claim(lock, nbytes, policy, step=step, allowance=allowance)
        if hold is not None:
            hold(admitted)
        if nbytes > 0:
            lock.record(nbytes)
        return admitted
