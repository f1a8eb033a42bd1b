"""The node-wide registration turnstile (issue #21): processes of one host take turns at the driver.

A ``cudaHostRegister`` call holds a driver-wide lock for its whole length: a ~700 GB pin took
~12 min and meanwhile co-located ranks hung in ``cudaMemGetInfo`` and DCGM went blind
(TensorRT-LLM #17429). Pacing calls inside one process (``max_stall_s``) is not enough when
eight ranks each pace themselves and keep the driver busy back to back. Here every register
call of every hicache process sharing the runtime directory (`hicache.effects._hostwide._rundir`: that
is the host) first takes a ticket, in arrival order, and calls once fewer than
``concurrency`` live tickets are ahead of it: a driver call of anyone else then waits behind
at most the calls in flight - one paced call at the default concurrency of 1.

Files in ``<runtime dir>/turnstile/``, all held with ``flock`` so that a holder that dies (a
SIGKILL mid-call included) lets go with its death - the kernel drops the lock, a waiter sees
an unlocked ticket and removes it; no pid is trusted (a zombie or a reused pid would lie):
- ``guard``: the ticket counter, locked for the microseconds a ticket takes;
- ``t.<seq>.<pid>.<thread>``: a ticket, locked by its owner until its call has ended;
- ``m.<pid>``: a member - a process bringing up pools now. In ``auto`` mode (the default)
  calls take turns and are paced only while another member is live: a process alone keeps
  its plan's calls and touches no file per call (looking for members at most every 50 ms).

Re-entrant for threads (a thread holding a turn that asks again gets the same turn: a
progressive step takes it around the transaction that takes it again), interrupt-safe (a
ticket enters the books with Ctrl-C held; a waiter stops on ``stop()`` and leaves the queue),
and a forked child drops the parent's tickets (it must not keep them alive). Imports the
leaves `_interrupts`, `_rundir`, `_trace` and hicache.errors only.
"""

from __future__ import annotations

import bisect
import errno
import fcntl
import logging
import math
import os
import threading
import time
import weakref
from pathlib import Path

from hicache.effects._interrupts import deferred_interrupts
from hicache.effects._hostwide._rundir import private_dir, runtime_dir
from hicache.effects._trace import span
from hicache.errors import PlanError
from hicache.plan.settings import env_value
from hicache.plan.checks import check_int, check_real

logger = logging.getLogger(__name__)

CONCURRENCY_ENV = "HICACHE_PIN_CONCURRENCY"
STALL_ENV = "HICACHE_PIN_MAX_STALL_S"
AUTO, OFF = "auto", "off"
#: The first paced call of a process registers at most this much: its rate is unknown yet
#: (a progressive bring-up's first call too, `_progressive.FIRST_CALL_BYTES`).
FIRST_CALL_BYTES = 16 * 2**20
#: No paced call should hold the driver lock longer (it blocks every other CUDA call
#: meanwhile - a serving engine's included); a progressive bring-up's default too.
DEFAULT_MAX_STALL_S = 0.25
POLL_S = 0.002  # a waiter looks this often: the gap it adds between two paced calls
REPORT_EVERY_S = 5.0
OTHERS_EVERY_S = 0.05  # auto mode looks for other processes at most this often
#: Upper bounds (seconds) of the wait histogram (`wait_histogram`, hicache_turnstile_wait_seconds).
WAIT_BUCKETS = (0.001, 0.01, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)


def _locked_by_someone(fd: int) -> bool:
    """True while another open file holds ``fd``'s file locked (its owner is alive)."""
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
    except OSError as error:
        if error.errno in (errno.EWOULDBLOCK, errno.EAGAIN):
            return True
        raise
    fcntl.flock(fd, fcntl.LOCK_UN)
    return False


class _Core:
    """One queue directory's process-wide state: the measured rate, this process's member
    entry, each thread's held turn and every wait (shared by every `Turnstile` on it)."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.dir = str(path)
        self.guard = f"{self.dir}/guard"
        self.lock = threading.Lock()
        self.local = threading.local()  # .turn: the turn this thread holds
        self.bytes = 0
        self.seconds = 0.0
        self.wait_counts = [0] * (len(WAIT_BUCKETS) + 1)  # per bucket (the last: above every bound)
        self.wait_sum = 0.0
        self.members = 0
        self.member_fd: int | None = None
        self.others_seen = (False, -math.inf)  # (another member live?, when looked up)
        self.open_fds: set[int] = set()  # tickets and the member file: closed in a forked child

    def enqueue(self) -> tuple[str, int]:
        """Take the next ticket: its name and its locked file descriptor."""
        guard = os.open(self.guard, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
        try:
            fcntl.flock(guard, fcntl.LOCK_EX)  # held for microseconds; dies with its holder
            raw = os.pread(guard, 20, 0)
            seq = (int(raw) if raw.isdigit() else 0) + 1
            os.pwrite(guard, b"%020d" % seq, 0)  # fixed width: no truncate (a slow call)
            name = f"t.{seq:020d}.{os.getpid()}.{threading.get_native_id()}"
            temporary = f"{self.dir}/.{name}"
            fd = os.open(temporary, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX)
                os.rename(temporary, f"{self.dir}/{name}")  # visible only once locked
            except BaseException:
                os.close(fd)
                os.unlink(temporary)
                raise
        finally:
            os.close(guard)  # lets the guard go
        with self.lock:
            self.open_fds.add(fd)
        return name, fd

    def clean(self) -> None:
        """Remove temporary tickets of processes that died making one (they exist only while
        their maker holds the guard: none can be live while we hold it)."""
        guard = os.open(self.guard, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
        try:
            fcntl.flock(guard, fcntl.LOCK_EX)
            for name in os.listdir(self.dir):
                if name.startswith(".t."):
                    try:
                        os.unlink(f"{self.dir}/{name}")
                    except FileNotFoundError:
                        pass
        finally:
            os.close(guard)

    def close(self, fd: int) -> None:
        with self.lock:
            self.open_fds.discard(fd)
        os.close(fd)

    def record(self, nbytes: int, seconds: float) -> None:
        with self.lock:
            self.bytes += nbytes
            self.seconds += seconds

    def rate(self) -> float | None:
        with self.lock:
            return self.bytes / self.seconds if self.seconds > 0 else None

    def join(self) -> None:
        with self.lock:
            self.members += 1
            if self.member_fd is not None:
                return
            try:
                fd = os.open(self.path / f"m.{os.getpid()}", os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError:  # the turns still work; only auto mode's pacing cannot see us
                logger.warning("registration turnstile: cannot announce this process in %s", self.path)
                return
            self.member_fd = fd
            self.open_fds.add(fd)

    def leave(self) -> None:
        with self.lock:
            self.members -= 1
            if self.members > 0 or self.member_fd is None:
                return
            fd, self.member_fd = self.member_fd, None
            self.open_fds.discard(fd)
            (self.path / f"m.{os.getpid()}").unlink(missing_ok=True)
            os.close(fd)

    def others_now(self) -> bool:
        """Whether another member is live, as looked up within the last `OTHERS_EVERY_S`."""
        now = time.monotonic()
        seen, when = self.others_seen
        if now - when < OTHERS_EVERY_S:
            return seen
        seen = bool(self.other_members())
        self.others_seen = (seen, now)
        return seen

    def other_members(self) -> list[int]:
        """Pids of the other live members (processes bringing up pools now)."""
        pids = []
        for entry in os.scandir(self.path):
            if not entry.name.startswith("m.") or entry.name == f"m.{os.getpid()}":
                continue
            try:
                fd = os.open(entry.path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
            except OSError:
                continue
            try:
                if _locked_by_someone(fd):
                    pids.append(int(entry.name[2:]) if entry.name[2:].isdigit() else -1)
                else:
                    os.unlink(entry.path)  # its process ended without leaving
            except OSError:
                pass
            finally:
                os.close(fd)
        return pids


_CORES: dict[str, _Core] = {}
_CORES_LOCK = threading.Lock()


def _core(path: Path) -> _Core:
    key = str(path.resolve())
    with _CORES_LOCK:
        core = _CORES.get(key)
        if core is None:
            core = _CORES[key] = _Core(path)
            core.clean()
        return core


def _after_fork_in_child() -> None:
    """A forked child shares its parent's open files - and with them their locks: closing
    its copies keeps a dead parent's ticket from looking alive for as long as the child runs."""
    for core in list(_CORES.values()):
        for fd in list(core.open_fds):
            try:
                os.close(fd)
            except OSError:
                pass
        core.open_fds.clear()
        core.member_fd, core.members = None, 0
        core.local = threading.local()
        core.lock = threading.Lock()


os.register_at_fork(after_in_child=_after_fork_in_child)


class Turn:
    """A held place at the driver: `release` it once the call has ended (idempotent)."""

    def __init__(self, core: _Core, name: str, fd: int) -> None:
        self.core, self.name, self.fd = core, name, fd
        self.depth = 1
        self.wait_s = 0.0
        self.since: float | None = None  # when the call's turn began
        self._finalizer = weakref.finalize(self, _drop, core, name, fd)  # a lost turn still lets go

    @property
    def held(self) -> bool:
        return self._finalizer.alive and self.since is not None

    def release(self, nbytes: int | None = None) -> None:
        """Leave the turn (a nested one: only once the outermost lets go); ``nbytes``: the
        bytes its call registered, to measure the rate calls are paced by."""
        if self.depth > 1:
            self.depth -= 1
            return
        if not self._finalizer.alive:
            return
        if nbytes and self.since is not None:
            self.core.record(nbytes, time.perf_counter() - self.since)
        self.depth = 0
        if getattr(self.core.local, "turn", None) is self:
            self.core.local.turn = None
        self._finalizer()  # callers hold Ctrl-C (the executor does); a turn lost anyway lets go when collected


class _Solo:
    """A call's turn while alone on the host (auto mode): no ticket; re-entrant like a `Turn`,
    and its time still measures the rate (pacing starts from it once another process comes)."""

    __slots__ = ("core", "since", "depth")
    held = True

    def __init__(self, core: _Core) -> None:
        self.core, self.since, self.depth = core, time.perf_counter(), 1
        core.local.turn = self

    def release(self, nbytes: int | None = None) -> None:
        self.depth -= 1
        if self.depth > 0:
            return
        if getattr(self.core.local, "turn", None) is self:
            self.core.local.turn = None
        if nbytes:
            self.core.record(nbytes, time.perf_counter() - self.since)


def _drop(core: _Core, name: str, fd: int) -> None:
    try:
        os.unlink(f"{core.dir}/{name}")  # first: nobody sees it unlocked and thinks its owner dead
    except OSError:
        pass
    try:
        core.close(fd)
    except OSError:
        pass


class Turnstile:
    """Turns at the driver for the processes sharing ``directory`` (default: the runtime
    directory): at most ``concurrency`` register calls in flight across them, in arrival
    order; ``max_stall_s`` paces each call to what the measured rate registers in that time;
    ``auto``: take turns and pace only while another process brings up pools."""

    def __init__(self, directory: Path | None = None, *, concurrency: int = 1,
                 max_stall_s: float = DEFAULT_MAX_STALL_S, auto: bool = False, poll_s: float = POLL_S,
                 report_every_s: float = REPORT_EVERY_S) -> None:
        concurrency = check_int(PlanError, "Turnstile", "concurrency", concurrency)
        max_stall_s = check_real(PlanError, "Turnstile", "max_stall_s", max_stall_s, above=0, what="a number of seconds")
        base = private_dir(directory or runtime_dir())
        self.path = private_dir(base / "turnstile")
        self.concurrency = concurrency
        self.max_stall_s = float(max_stall_s)
        self.auto = auto
        self.poll_s = poll_s
        self.report_every_s = report_every_s
        self._core = _core(self.path)

    def __repr__(self) -> str:
        mode = "auto" if self.auto else "on"
        return f"Turnstile({str(self.path)!r}, concurrency={self.concurrency}, max_stall_s={self.max_stall_s:g}, {mode})"

    # pacing ----------------------------------------------------------------------------
    def paces(self) -> bool:
        """Whether calls take turns and are paced now: always when asked for; in auto mode
        while another process brings up pools on this host (looked up at most every
        `OTHERS_EVERY_S`: a call alone costs no file operation - each one would hand the GIL
        to a serving thread and wait up to its switch interval to get it back)."""
        return not self.auto or self._core.others_now()

    def budget_bytes(self) -> int:
        """The most one call should register: what the measured rate registers in
        ``max_stall_s`` (`FIRST_CALL_BYTES` before any call was measured)."""
        rate = self._core.rate()
        if rate is None:
            return FIRST_CALL_BYTES
        return max(1, int(rate * self.max_stall_s))


    # membership ------------------------------------------------------------------------
    def join(self) -> None:
        """Announce this process as bringing up pools (re-entrant; `leave` once per join)."""
        self._core.join()

    def leave(self) -> None:
        """End one `join`."""
        self._core.leave()

    # turns -----------------------------------------------------------------------------
    def acquire(self, stop=None) -> "Turn | _Solo | None":
        """Wait for this thread's turn (the one it holds, if it holds one); None when ``stop()``
        became true first (the place is given up). In auto mode, alone on the host, no ticket is
        taken: one arriving meanwhile overlaps the call in flight once, later calls take turns."""
        core = self._core
        held = getattr(core.local, "turn", None)
        if held is not None and held.held:
            held.depth += 1
            return held
        if self.auto and not core.others_now():
            return _Solo(core)
        turn = None
        try:  # a Ctrl-C held while the ticket is taken lands at the with-exit: inside the try, given back
            with deferred_interrupts():  # the ticket and the object that gives it back, together
                turn = Turn(core, *core.enqueue())
            start = time.perf_counter()
            with span("turnstile wait", "turnstile", ticket=turn.name, concurrency=self.concurrency) as args:
                ahead = self._wait(turn.name, stop, start)
                if args is not None:
                    args["stopped"] = ahead is None
            if ahead is None:
                turn.release()
                return None
        except BaseException:
            if turn is not None:
                turn.release()
            raise
        turn.wait_s = time.perf_counter() - start
        with core.lock:
            core.wait_counts[bisect.bisect_left(WAIT_BUCKETS, turn.wait_s)] += 1
            core.wait_sum += turn.wait_s
        turn.since = time.perf_counter()
        core.local.turn = turn
        return turn

    def _wait(self, mine: str, stop, start: float):
        """Poll until fewer than ``concurrency`` live tickets are ahead of ``mine``."""
        watched: dict[str, int] = {}  # ticket -> an fd of ours on it, to test its lock
        next_report = start + self.report_every_s
        try:
            while True:
                names = sorted(n for n in os.listdir(self.path) if n.startswith("t.") and n < mine)
                for gone in set(watched) - set(names):
                    os.close(watched.pop(gone))
                alive = []
                for name in names:
                    fd = watched.get(name)
                    if fd is None:
                        try:
                            fd = watched[name] = os.open(self.path / name, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
                        except FileNotFoundError:
                            continue
                    if _locked_by_someone(fd):
                        alive.append(name)
                    else:  # its owner died holding it (or just let go): it no longer counts
                        try:
                            os.unlink(self.path / name)
                        except FileNotFoundError:
                            pass
                        os.close(watched.pop(name))
                if len(alive) < self.concurrency:
                    return len(alive)
                if stop is not None and stop():
                    return None
                now = time.perf_counter()
                if now >= next_report:
                    pids = sorted({n.split(".")[2] for n in alive})
                    logger.warning("waiting %.0f s for the host's registration turnstile %s: %d call(s) ahead "
                                   "(pids %s)", now - start, self.path, len(alive), ", ".join(pids))
                    next_report = now + self.report_every_s
                time.sleep(self.poll_s)
        finally:
            for fd in watched.values():
                os.close(fd)


def wait_histogram() -> dict:
    """How long this process's turns waited, every turnstile together: ``buckets`` as
    ``(upper bound, cumulative count)`` (the last bound ``inf``), ``count`` and ``sum`` seconds."""
    counts = [0] * (len(WAIT_BUCKETS) + 1)
    total = 0.0
    with _CORES_LOCK:
        cores = list(_CORES.values())
    for core in cores:
        with core.lock:
            counts = [a + b for a, b in zip(counts, core.wait_counts)]
            total += core.wait_sum
    cumulative, running = [], 0
    for bound, count in zip((*WAIT_BUCKETS, math.inf), counts):
        running += count
        cumulative.append((bound, running))
    return {"buckets": cumulative, "count": running, "sum": total}


def from_env(env=None, *, directory: Path | None = None) -> Turnstile | None:
    """The turnstile the environment asks for: HICACHE_PIN_CONCURRENCY ``auto`` (unset: turns
    and pacing while another process brings up pools), a whole number N >= 1 (at most N
    calls in flight, always paced) or ``off``/``0`` (None); HICACHE_PIN_MAX_STALL_S the stall
    budget in seconds (default 0.25). A value hicache cannot read is an `EnvError` naming it."""
    env = os.environ if env is None else env
    value = env_value(env, CONCURRENCY_ENV) or AUTO  # auto, off or calls in flight across the host
    stall = env_value(env, STALL_ENV) or DEFAULT_MAX_STALL_S
    if value == OFF:
        return None
    if value == AUTO:
        return Turnstile(directory, concurrency=1, max_stall_s=stall, auto=True)
    return Turnstile(directory, concurrency=value, max_stall_s=stall)


def resolve(setting, env=None) -> Turnstile | None:
    """A bring-up's ``turnstile=``: ``"auto"`` (the environment's, `from_env`), None/False
    (off) or a `Turnstile`."""
    if setting is None or setting is False:
        return None
    if isinstance(setting, Turnstile):
        return setting
    if setting == AUTO:
        return from_env(env)
    raise PlanError(f"turnstile must be 'auto', None or a Turnstile, got {setting!r}")
