"""`hicache.testing`'s fake CUDA: a fault-injecting driver and a conformance check for runtimes.

`FakeCudart` models what the executor relies on from the CUDA runtime - overlap is 712, an
unregister of a non-base pointer is 713, a failed call leaves an error pending until
`cudaGetLastError`, a sticky code poisons every later call - and fails on a script (the k-th
register, chosen unregisters, a sticky code, a KeyboardInterrupt before or after a call).
`FakeRuntime` is the real torch-cudart adapter over it; `FakeCudaBinding` gives it
cuda-python's tuple convention; `fake_cuda()` puts one behind every default runtime.
"""

from __future__ import annotations

import contextlib
import enum
import fcntl
import json
import os
import threading
import time

from hicache.effects import TorchCudartRuntime, cuda_codes, stand_in_runtime
from hicache.errors import CudaCallError, HostAlreadyRegisteredError, HostNotRegisteredError

SUCCESS, ALREADY_REGISTERED, NOT_REGISTERED = cuda_codes.SUCCESS, cuda_codes.ALREADY_REGISTERED, cuda_codes.NOT_REGISTERED
STICKY, NAMES = cuda_codes.STICKY, cuda_codes.NAMES
MEMORY_ALLOCATION = 2  # cudaErrorMemoryAllocation: the typical non-sticky register failure


class FakeInvariantError(AssertionError):
    """The fake saw its caller break CUDA's contract (e.g. an undrained pending error)."""


#: One lock for every slow FakeCudart: like the driver's, register calls never overlap.
_DRIVER_LOCK = threading.Lock()


class FakeCudart:
    """A CUDA runtime in a dict, with int return codes like ``torch.cuda.cudart()``.

    ``register_bytes_per_s``: each register call takes size / rate seconds while holding one
    process-wide lock (the driver lock), for testing and benchmarking pacing and pipelining
    without a GPU; ``timeline`` records each successful call's start and end.
    ``driver_lock=PATH`` makes that lock host-wide, as the real driver's is (a ``flock`` on the
    file: processes sharing it wait for each other's calls, and `cudaMemGetInfo` waits for
    them - what a co-located rank's probe suffers); ``shared_log=PATH`` appends one JSON line
    per successful register call (pid, ptr, size, start - before it queued for the driver
    lock - and end, on the host's monotonic clock) for tests that watch several processes, and
    one ``"op": "queue"`` line as each call starts to wait for the driver lock.

    Faults, by 0-based call index of that function: ``fail_register={k: code}``,
    ``fail_unregister={k: code}`` (a sticky code there poisons the context from then on),
    ``interrupt_register={k: "before" | "after"}`` raises KeyboardInterrupt before the call
    takes effect or after it did; ``interrupt_unregister`` likewise for unregister calls.
    ``registered`` maps base pointer -> size.
    """

    def __init__(
        self, *, fail_register=None, fail_unregister=None, interrupt_register=None,
        interrupt_unregister=None, register_bytes_per_s: float | None = None,
        driver_lock: str | None = None, shared_log: str | None = None,
    ):
        if register_bytes_per_s is not None and not register_bytes_per_s > 0:
            raise ValueError(f"register_bytes_per_s must be positive, got {register_bytes_per_s!r}")
        self.register_bytes_per_s = register_bytes_per_s
        self.driver_lock = None if driver_lock is None else str(driver_lock)
        self.shared_log = None if shared_log is None else str(shared_log)
        self.timeline: list[tuple] = []  # ("register", ptr, size, start, end) of successful calls
        self.fail_register = dict(fail_register or {})
        self.fail_unregister = dict(fail_unregister or {})
        self.interrupt_register = dict(interrupt_register or {})
        self.interrupt_unregister = dict(interrupt_unregister or {})
        self.registered: dict[int, int] = {}
        self._state = threading.Lock()  # registered/timeline: a background registration writes them
        self.register_calls = 0
        self.unregister_calls = 0
        self.pending = SUCCESS
        self.sticky = SUCCESS
        self.log: list[tuple] = []

    def _fail(self, code: int) -> int:
        self.pending = code
        if code in STICKY:
            self.sticky = code
        return code

    def cudaHostRegister(self, ptr: int, size: int, flags: int) -> int:
        call = self.register_calls
        self.register_calls += 1
        self.log.append(("register", ptr, size, flags))
        if self.sticky:
            return self.sticky
        if self.interrupt_register.get(call) == "before":
            raise KeyboardInterrupt(f"fake interrupt before register call {call}")
        if call in self.fail_register:
            return self._fail(self.fail_register[call])
        if size <= 0:
            return self._fail(1)
        with self._state:
            if any(base < ptr + size and ptr < base + held for base, held in self.registered.items()):
                return self._fail(ALREADY_REGISTERED)
        start, host_start = time.perf_counter(), time.monotonic()
        if self.register_bytes_per_s:  # a driver pinning at this rate, under its one lock
            if self.shared_log is not None:  # queued for the driver: a test can hold the lock and count
                self._log_shared({"op": "queue", "pid": os.getpid(), "ptr": ptr, "size": size, "start": host_start})
            with _DRIVER_LOCK, self._host_driver():
                time.sleep(size / self.register_bytes_per_s)
        with self._state:
            self.timeline.append(("register", ptr, size, start, time.perf_counter()))
            self.registered[ptr] = size
        if self.shared_log is not None:
            self._log_shared({"pid": os.getpid(), "ptr": ptr, "size": size, "start": host_start, "end": time.monotonic()})
        if self.interrupt_register.get(call) == "after":
            raise KeyboardInterrupt(f"fake interrupt after register call {call}")
        return SUCCESS

    @contextlib.contextmanager
    def _host_driver(self):
        """The host-wide driver lock (``driver_lock=``), held for the block; nothing without one."""
        if self.driver_lock is None:
            yield
            return
        fd = os.open(self.driver_lock, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)  # dies with its holder, as the driver's hold does
            yield
        finally:
            os.close(fd)

    def cudaMemGetInfo(self):
        """``(0, free, total)`` once the driver lock is free - the call a co-located rank's
        probe makes (it waits behind a register call in flight, host-wide with ``driver_lock=``).
        With ``shared_log=`` it logs a line too, ``"op": "probe"`` (register lines have none)."""
        host_start = time.monotonic()
        with _DRIVER_LOCK, self._host_driver():
            pass
        if self.shared_log is not None:
            self._log_shared({"op": "probe", "pid": os.getpid(), "start": host_start, "end": time.monotonic()})
        return SUCCESS, 0, 0

    def _log_shared(self, entry: dict) -> None:
        fd = os.open(self.shared_log, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)
        try:
            os.write(fd, (json.dumps(entry) + "\n").encode())  # one short O_APPEND write: lines never interleave
        finally:
            os.close(fd)

    def probe(self, until, every_s: float = 0.01) -> list[float]:
        """A co-located rank's probe: `cudaMemGetInfo` every ``every_s`` until ``until()``;
        the seconds each call waited for the driver."""
        waits = []
        while not until():
            start = time.monotonic()
            self.cudaMemGetInfo()
            waits.append(time.monotonic() - start)
            time.sleep(every_s)
        return waits

    def cudaHostUnregister(self, ptr: int) -> int:
        call = self.unregister_calls
        self.unregister_calls += 1
        self.log.append(("unregister", ptr))
        if self.sticky:
            return self.sticky
        if self.interrupt_unregister.get(call) == "before":
            raise KeyboardInterrupt(f"fake interrupt before unregister call {call}")
        if call in self.fail_unregister:
            return self._fail(self.fail_unregister[call])
        with self._state:
            if ptr not in self.registered:
                return self._fail(NOT_REGISTERED)
            del self.registered[ptr]
        if self.interrupt_unregister.get(call) == "after":
            raise KeyboardInterrupt(f"fake interrupt after unregister call {call}")
        return SUCCESS

    def cudaGetLastError(self) -> int:
        code, self.pending = self.pending, self.sticky
        return code

    def cudaGetErrorString(self, code):
        if not isinstance(code, enum.Enum):  # as cuda-python does: sglang PR #38509
            raise TypeError("cudaGetErrorString() argument must be cudaError_t, not int")
        return NAMES.get(int(code), "unknown error")

    def check_valid(self) -> None:
        """Raise FakeInvariantError if the caller left CUDA in a state it should not."""
        with self._state:
            spans = sorted(self.registered.items())
        for (a, sa), (b, _) in zip(spans, spans[1:]):
            if a + sa > b:
                raise FakeInvariantError(f"overlapping registrations at 0x{a:x} and 0x{b:x}")
        if self.pending and not self.sticky:
            raise FakeInvariantError(
                f"error {NAMES.get(self.pending, self.pending)} left pending: a failed call "
                "was not drained with cudaGetLastError"
            )

    def held(self) -> set[tuple[int, int]]:
        """The registered ranges as ``(ptr, size)`` (safe while another thread registers)."""
        with self._state:
            return set(self.registered.items())


class _Status(enum.IntEnum):
    """Stand-in for cuda-python's ``cudaError_t`` when cuda-python is not installed."""

    cudaSuccess = 0


def _status_enum():
    try:
        from cuda.bindings import runtime

        return runtime.cudaError_t
    except Exception:  # pragma: no cover - cuda-python is a dependency
        return None


class FakeCudaBinding:
    """`FakeCudart` behind cuda-python's convention: every call returns a tuple."""

    def __init__(self, cudart: FakeCudart | None = None, **faults) -> None:
        self.cudart = cudart or FakeCudart(**faults)
        self.cudaError_t = _status_enum()

    def _status(self, code: int):
        return (self.cudaError_t(code) if self.cudaError_t else code,)

    def cudaHostRegister(self, ptr, size, flags):
        return self._status(self.cudart.cudaHostRegister(ptr, size, flags))

    def cudaHostUnregister(self, ptr):
        return self._status(self.cudart.cudaHostUnregister(ptr))

    def cudaGetLastError(self):
        return self._status(self.cudart.cudaGetLastError())

    def cudaGetErrorName(self, status):
        return (self._status(0)[0], NAMES.get(int(status), f"cudaError({int(status)})").encode())

    def cudaGetErrorString(self, status):
        return (self._status(0)[0], b"fake error description")

    def cudaDriverGetVersion(self):
        return (self._status(0)[0], 13000)

    def cudaRuntimeGetVersion(self):
        return (self._status(0)[0], 13050)

    def cudaGetDeviceCount(self):
        return (self._status(0)[0], 1)

    def cudaDeviceGetPCIBusId(self, length, device):
        return (self._status(0)[0], f"0000:{0x3b + device:02x}:00.0".encode())


class FakeRuntime(TorchCudartRuntime):
    """The real int-code adapter over a `FakeCudart` (pass faults as keywords)."""

    def __init__(self, cudart: FakeCudart | None = None, **faults) -> None:
        super().__init__(cudart or FakeCudart(**faults))

    def held(self) -> set[tuple[int, int]]:
        return self.cudart.held()

    def check_valid(self) -> None:
        self.cudart.check_valid()


def check_runtime_conformance(runtime, ptr: int, size: int, *, page_bytes: int = 4096) -> list[str]:
    """Check that ``runtime`` behaves as the executor assumes, on host memory at ``ptr``.

    Needs ``size >= 3 * page_bytes`` of page-aligned memory that nothing has registered.
    Returns the names of the checks that passed; raises AssertionError on the first failure.
    Leaves nothing registered.
    """
    if size < 3 * page_bytes or ptr % page_bytes:
        raise ValueError("conformance needs >= 3 page-aligned pages of unregistered memory")
    passed = []
    runtime.register(ptr, page_bytes, 0)
    runtime.unregister(ptr)
    passed.append("register-unregister")
    runtime.register(ptr, 2 * page_bytes, 0)
    try:
        try:
            runtime.register(ptr + page_bytes, page_bytes, 0)
        except HostAlreadyRegisteredError as error:
            if not (error.code == ALREADY_REGISTERED and error.ptr == ptr + page_bytes):  # not assert: -O keeps it
                raise AssertionError(f"an overlapping register failed with {error.code} at {error.ptr}, not 712 at "
                                     f"{ptr + page_bytes}") from error
            passed.append("overlap-is-712")
        else:
            runtime.unregister(ptr + page_bytes)
            raise AssertionError("an overlapping register succeeded (expected 712)")
        try:
            runtime.unregister(ptr + page_bytes)
        except CudaCallError as error:
            if not (isinstance(error, HostNotRegisteredError) or error.code == 1):
                raise AssertionError(f"unregistering an interior pointer failed with {error!r}, not 713 or 1") from error
            passed.append("interior-unregister-fails")
        else:
            raise AssertionError("unregistering an interior pointer succeeded")
        runtime.register(ptr + 2 * page_bytes, page_bytes, 0)  # pending errors were drained
        runtime.unregister(ptr + 2 * page_bytes)
        passed.append("errors-drained")
    finally:
        runtime.unregister(ptr)
    return passed


class FakeHostBuffer:
    """A tensor's surface as SGLang's registration helpers use it (``data_ptr``, ``numel``,
    ``element_size``) at an address no one touches: for exercising `hicache.compat.sglang`
    against a `FakeCudart` at any size without allocating it."""

    def __init__(self, nbytes: int, base: int = 1 << 44) -> None:
        self.nbytes, self.base = nbytes, base

    def data_ptr(self) -> int:
        return self.base

    def numel(self) -> int:
        return self.nbytes

    def element_size(self) -> int:
        return 1


@contextlib.contextmanager
def fake_cuda(**faults):
    """Within the block every default CUDA runtime is one `FakeRuntime` over
    ``FakeCudart(**faults)``, which is yielded (``.held()``, ``.cudart.log``).

    Covers what picks a runtime itself: the pools (``runtime=None``), the
    `hicache.compat.sglang` helpers (instead of ``torch.cuda.cudart()``), ``hicache apply`` and
    `hicache.effects.probe_cuda` (which then sees one device). Process-wide, so threads the
    code under test starts see it too; blocks nest (the innermost wins). For code that runs on
    a CPU box and would otherwise call the real CUDA.
    """
    runtime = FakeRuntime(**faults)
    with stand_in_runtime(runtime, FakeCudaBinding(runtime.cudart)):
        yield runtime
