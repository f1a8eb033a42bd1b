"""The whole hicache error tree (see ARCHITECTURE.md, "Stable public API").

A leaf module: every layer may import it, and it imports nothing of hicache. Errors carry data
(codes, pointers, ranges) as attributes so callers can branch on them, not only a string.
"""

from __future__ import annotations

__all__ = [
    "HicacheError",
    "LayoutError",
    "NotServedError",
    "PlanError",
    "CapacityError",
    "CopyUnitOverCapError",
    "CudaCallError",
    "CudaUnavailableError",
    "HostAlreadyRegisteredError",
    "HostNotRegisteredError",
    "StickyCudaError",
    "ApplyError",
    "RollbackError",
    "ReleaseError",
    "RegistrationStateError",
    "HostOutOfMemoryError",
    "TransferError",
    "EnvError",
    "ConfigError",
    "NoAllocatorError",
    "HostPagesExhaustedError",
    "ArenaError",
    "StoreClosedError",
    "NamespaceTableFullError",
    "ArenaGeometryError",
    "ArenaBeingCreatedError",
    "TraceOutputError",
    "caused_by_interrupt",
]


class HicacheError(Exception):
    """Base of every error hicache raises on purpose."""


class LayoutError(HicacheError, ValueError):
    """A layout descriptor is malformed: bad field value or unsupported family x layout pair."""


class NotServedError(LayoutError):
    """The pool's inputs are sound, but describe what SGLang's own host pool serves and hicache's
    does not (MXFP8 scales, a relocatable device pool, layer-sharded MLA, ...): docs/sglang.md's list.
    Raised before any memory is taken; under the plug-in's pools mode it names the switch."""


class PlanError(HicacheError, ValueError):
    """No registration plan satisfies the inputs (the message carries the numbers)."""


class CapacityError(PlanError):
    """The host cannot hold the requested pool within its budget."""


class PoolTooSmallError(CapacityError):
    """The size asked for holds no token (or page): the pool must be larger, not smaller."""


class CudaCallError(HicacheError, RuntimeError):
    """A CUDA runtime call failed.

    ``op`` is the call (``"cudaHostRegister"``), ``code`` the integer ``cudaError_t``, ``name``
    its enum name (``"cudaErrorHostMemoryAlreadyRegistered"``), ``ptr``/``size`` the range it
    was about (``None`` when not applicable).
    """

    def __init__(
        self,
        message: str,
        *,
        op: str,
        code: int,
        name: str,
        ptr: int | None = None,
        size: int | None = None,
    ) -> None:
        super().__init__(message)
        self.op = op
        self.code = code
        self.name = name
        self.ptr = ptr
        self.size = size


class CudaUnavailableError(CudaCallError):
    """No usable CUDA: no driver, a driver too old, or no device (codes 35, 100, ...)."""


class HostAlreadyRegisteredError(CudaCallError):
    """712 cudaErrorHostMemoryAlreadyRegistered: the range overlaps a registration."""


class HostNotRegisteredError(CudaCallError):
    """713 cudaErrorHostMemoryNotRegistered: unregister of a pointer that is not a base."""


class StickyCudaError(CudaCallError):
    """A code that poisons the CUDA context: no further CUDA work can succeed in this process."""


class ApplyError(HicacheError, RuntimeError):
    """Applying a plan failed and everything it had registered was unregistered again.

    ``__cause__`` is the original failure.
    """


class RollbackError(ApplyError):
    """Applying a plan failed and the rollback could not undo everything.

    ``leaked`` lists the ``(ptr, size)`` ranges that are still registered; the memory behind
    them must not be unmapped or freed. ``uncertain`` lists a register call an interrupt cut
    short whose undo also failed: it may or may not be registered, so treat it as leaked too.
    """

    def __init__(
        self,
        message: str,
        *,
        leaked: tuple[tuple[int, int], ...],
        uncertain: tuple[tuple[int, int], ...] = (),
    ) -> None:
        super().__init__(message)
        self.leaked = tuple(leaked)
        self.uncertain = tuple(uncertain)


class ReleaseError(HicacheError, RuntimeError):
    """Releasing a registration left ranges registered (``leaked``: ``(ptr, size)`` pairs)."""

    def __init__(self, message: str, *, leaked: tuple[tuple[int, int], ...]) -> None:
        super().__init__(message)
        self.leaked = tuple(leaked)


class RegistrationStateError(HicacheError, RuntimeError):
    """A registration was used in a state that does not allow it (e.g. concurrent misuse)."""


class HostOutOfMemoryError(HicacheError, MemoryError):
    """The host could not provide the memory (mmap or pre-fault returned ENOMEM)."""


class CopyUnitOverCapError(PlanError):
    """A buffer's page-copy unit (``unit_bytes``) is larger than the per-call cap (``cap_bytes``,
    decided by ``caps``: the names `Limits.binding_caps` gives): no call can hold one page copy,
    so no split keeps every copy inside one registration. Raise that cap, or make the unit
    smaller (fewer tokens a page, another layout)."""

    def __init__(self, message: str, *, unit_bytes: int, cap_bytes: int, caps: tuple) -> None:
        super().__init__(message)
        self.unit_bytes, self.cap_bytes, self.caps = unit_bytes, cap_bytes, tuple(caps)


class HugepageSizeError(PlanError):
    """hugetlbfs pages of a size this kernel does not offer (``/sys/kernel/mm/hugepages``) were
    required: refused before any memory, naming the sizes it offers."""


class HugepagesExhaustedError(HostOutOfMemoryError):
    """``hugepages="required"`` and the hugetlbfs pool has too few free pages (the message says
    how many are needed, free and reserved)."""


class LockTimeoutError(RegistrationStateError):
    """HICACHE_LOCK_TIMEOUT passed while another process held the host-wide budget lock (the
    message names the holder)."""


class LockDirectoryError(RegistrationStateError):
    """The host-wide lock directory (HICACHE_RUNTIME_DIR) cannot be created or is not safe to use."""


class TransferError(HicacheError, ValueError):
    """A page transfer was asked with bad indices, layer ids or an unsupported backend/layout."""


class EnvError(PlanError):
    """An environment variable holds a value hicache cannot read (the message names it)."""


class ConfigError(PlanError):
    """A model config lacks a key hicache needs, or holds a value it cannot use."""


class NoAllocatorError(RegistrationStateError, NotImplementedError):
    """A pool that reuses another pool's indices has no allocator (SGLang raises
    NotImplementedError there; this is both)."""


class HostPagesExhaustedError(CapacityError, RuntimeError):
    """No host pages left for a HiSparse request: a RuntimeError, as SGLang's callers expect."""


class ArenaError(HicacheError, ValueError):
    """A node store's arena cannot be created or attached as asked: a disk filesystem, too little
    room, a file of another user or open to others, a corrupt header (the message names the path,
    the field and the value). Raised before anything is allocated or left behind."""


class ArenaGeometryError(ArenaError):
    """An arena exists but its geometry (slot bytes, size, schema) does not fit what this engine
    stores: the attach fails cleanly and the arena is untouched."""


class ArenaBeingCreatedError(ArenaError):
    """Another process is still creating the arena (it holds the arena's creators' lock, the file
    has no header yet): an attach that does not wait for it is refused, naming the ``creator``'s
    pid (a string, as its lock file holds it). Try again once that create has ended."""

    def __init__(self, message: str, *, creator: str) -> None:
        super().__init__(message)
        self.creator = creator


class NamespaceTableFullError(ArenaError):
    """Every entry of an arena's namespace table holds pages (or is being written): a write of a
    new namespace is refused, naming the arena - its pages are never filed under another entry.
    Entries are freed when their last page goes (`clear`, eviction)."""


class StoreClosedError(HicacheError, RuntimeError):
    """A node store used after its ``close()`` (the message names the arena and the call): the
    arena is unmapped, so nothing was read or written - never a read of unmapped memory."""


class TraceOutputError(HicacheError, ValueError):
    """A trace cannot be written where asked: not a regular file (a device, FIFO, directory,
    symlink), or a missing or read-only directory (the message says which)."""


class TerminationSignal(KeyboardInterrupt):
    """SIGTERM or SIGHUP, raised where a KeyboardInterrupt would be (see
    `hicache.effects.terminate_as_interrupt`): ``signum`` says which; a command exits 128 +
    signum, as a process killed by it would."""

    def __init__(self, signum: int) -> None:
        import signal

        super().__init__(signal.Signals(signum).name)
        self.signum = signum


def signal_number(error: BaseException | None) -> int | None:
    """The signal behind ``error`` (its cause/context chain, 16 links at most): SIGTERM's or
    SIGHUP's number, SIGINT's (2) for a plain KeyboardInterrupt, None when no interrupt caused it."""
    seen = 0
    while error is not None and seen < 16:
        if isinstance(error, TerminationSignal):
            return error.signum
        if isinstance(error, KeyboardInterrupt):
            return 2
        error, seen = error.__cause__ or error.__context__, seen + 1
    return None


def caused_by_interrupt(error: BaseException | None) -> bool:
    """True when ``error`` is, or was caused by, a KeyboardInterrupt (its cause/context chain,
    16 links at most): the interrupt is already being honoured."""
    seen = 0
    while error is not None and seen < 16:
        if isinstance(error, KeyboardInterrupt):
            return True
        error, seen = error.__cause__ or error.__context__, seen + 1
    return False
