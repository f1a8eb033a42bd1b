"""The node store's arena file: created once, attached by every engine on the node after.

Create: anything at the path but a regular file (FIFO, socket, device, symlink, directory) is
refused before any wait; then, under the creators' lock of that path - a file of this user's in
hicache's private runtime directory, never a lock on the shared directory another user could
hold (so one process creates, the rest wait, naming the holder, and then attach) - the file is made with O_EXCL and mode 0600, ``posix_fallocate``d (a sparse
tmpfs file would SIGBUS when tmpfs fills), mapped MAP_SHARED, pre-faulted by hicache's parallel
MADV_POPULATE_WRITE workers, and its header written last: a file without a header is no arena,
and one a creator died making (marked `CREATING` first - through a mapping on hugetlbfs, which
takes no write()) is removed by the next create. Anything that fails on the way
unmaps, closes and unlinks what it made. Attach: open (no symlink), refuse another user's file
or one open to group/others, check the header against what the engine asks, map it - no
pre-fault, no CUDA registration: its cost does not grow with the arena.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import logging
import mmap
import os
import stat
import threading
import time

import attrs

from hicache.errors import ArenaBeingCreatedError, ArenaError, HostOutOfMemoryError
from hicache.effects._arena._creators import CreatorsLock, creator_at_work
from hicache.effects._arena._mounts import Backing, backing_of, refuse_non_regular as _refuse_non_regular
from hicache.effects._arena._records import Records
from hicache.effects._arena._slots import slot_ops, try_lock, unlock
from hicache.plan.store_format import (
    COUNTERS,
    COUNTERS_OFFSET,
    CREATING,
    HEADER_LENGTH,
    StorePlan,
    check_geometry,
    counter_offset,
    decode_header,
    encode_header,
)

log = logging.getLogger(__name__)
PREFAULT_PIECE_BYTES = 64 * 2**20
CREATE_WAIT_S = 600.0  # hang guard for the directory lock while another process creates


@attrs.define(eq=False)
class Arena:
    """One mapped arena. ``base`` is the mapping's address; ``created``: this process made it;
    ``attach_s``: seconds the open/check/map took (or the creation's); ``records``: its index
    records and namespace table (`Records`). `close` is idempotent."""

    path: str
    plan: StorePlan
    label: str
    backing: Backing
    ops: object
    created: bool
    attach_s: float
    _fd: int
    _map: mmap.mmap | None
    base: int = 0
    _pending: dict = attrs.Factory(dict)
    _counting: threading.Lock = attrs.Factory(threading.Lock)  # this process's threads: OFD locks do not part them
    records: Records | None = attrs.field(init=False, default=None)  # the index and table words, where they lie

    def __attrs_post_init__(self) -> None:
        self.base = ctypes.addressof(ctypes.c_char.from_buffer(self._map))
        self.records = Records(self.base, self.plan)

    @property
    def fd(self) -> int:
        return self._fd

    @property
    def closed(self) -> bool:
        return self._map is None

    def record_addr(self, slot: int) -> int:
        return self.base + self.plan.record_offset(slot)

    def slot_addr(self, slot: int) -> int:
        return self.base + self.plan.slot_offset(slot)

    def add_counters(self, **deltas: int) -> None:
        """Add to the arena-wide counters. Never waits and never fails the work it counts: with
        the fallback ops a busy counters lock keeps the deltas for the next call."""
        with self._counting:
            for name, delta in deltas.items():
                if delta:
                    self._pending[name] = self._pending.get(name, 0) + delta
            if not self._pending or self.closed:
                return
            locked = self.ops.atomic_add or try_lock(self._fd, COUNTERS_OFFSET, 8 * len(COUNTERS))
            if not locked:
                return
            try:
                for name, delta in self._pending.items():
                    self.ops.fetch_add(self.base + counter_offset(name), delta)
                self._pending.clear()
            finally:
                if not self.ops.atomic_add:
                    unlock(self._fd, COUNTERS_OFFSET, 8 * len(COUNTERS))

    def counters(self) -> dict[str, int]:
        return {name: self.ops.load(self.base + counter_offset(name)) for name in COUNTERS}

    def resident_bytes(self) -> int:
        """Bytes of this process's mapping of the arena that are faulted in (its Rss in
        /proc/self/smaps): what an attach touched. 0 when closed or unreadable."""
        if self.closed:
            return 0
        from hicache.effects._host._tiers import mapping_field

        return mapping_field(self.base, "Rss") or 0

    def close(self) -> None:
        """Unmap and close; safe to call twice. Nothing in the file changes (its pages stay)."""
        if self._map is None:
            return
        self.add_counters()
        self._pending.clear()
        mapping, self._map = self._map, None
        try:
            mapping.close()
        except BufferError:  # a view of it is still alive somewhere: the GC unmaps it later
            pass
        os.close(self._fd)


def _check_owner(path: str, info: os.stat_result, uid: int | None = None, *, mode: bool = True) -> None:
    """A regular file of this user (``uid``), and - unless ``mode`` is False (dropping one's own
    file) - open to nobody else: every group and other bit refused, read, write or execute."""
    uid = os.getuid() if uid is None else uid
    _refuse_non_regular(path, info)
    if info.st_uid != uid:
        raise ArenaError(f"store arena {path}: owned by uid {info.st_uid}, not this user (uid {uid}); "
                         "KV holds users' prompts: each user needs an arena of their own")
    if mode and info.st_mode & 0o077:
        raise ArenaError(f"store arena {path}: mode {stat.S_IMODE(info.st_mode):04o} is open to group/others "
                         "(KV holds users' prompts): chmod 600 it, or drop and recreate it")


def _read_header(fd: int, path: str):
    raw = os.pread(fd, HEADER_LENGTH, 0)
    return decode_header(raw, where=f"store arena {path}")


def _map(fd: int, plan: StorePlan, path: str) -> mmap.mmap:
    try:
        return mmap.mmap(fd, plan.total_bytes, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
    except OSError as error:
        raise ArenaError(f"store arena {path}: cannot map {plan.total_bytes} bytes ({error.strerror})") from None


def attach_arena(path: str, *, page_bytes: int | None = None, total_bytes: int | None = None,
                 ops=None, root: str = "/", uid: int | None = None, backing: Backing | None = None,
                 wait_for_creator: bool = False, lock_dir=None) -> Arena:
    """Attach the arena at ``path``: `ArenaError` for a missing, foreign, exposed, corrupt or
    incomplete one, `ArenaGeometryError` when its slots cannot hold ``page_bytes`` or its size is
    not ``total_bytes`` (when given). Faults nothing in. ``uid``: whose it must be (this user's);
    ``backing``: the path's, when the caller read it already. An arena a creator is still
    making is waited for (its creators' lock, up to `CREATE_WAIT_S`; ``lock_dir`` as for
    `create_arena`) when ``wait_for_creator`` - an engine starting beside a node agent's
    `hicache store create` - else refused at once naming the creator's pid. ``ops``: as `slot_ops`
    takes them by name, or an ops class (default: the C helper where built)."""
    began = time.perf_counter()
    ops = slot_ops(ops, where="attach_arena")
    backing = backing_of(path, root=root) if backing is None else backing
    _refuse_non_regular(path)
    if _incomplete(path, backing):
        _await_creator(path, backing, wait_for_creator, lock_dir)
    try:  # O_NONBLOCK: a FIFO swapped in since the lstat opens at once (and fails the owner check)
        fd = os.open(path, os.O_RDWR | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK)
    except FileNotFoundError:
        raise ArenaError(f"store arena {path}: does not exist (create it: hicache store create {path} ...)") from None
    except OSError as error:
        if error.errno == errno.ELOOP:
            raise ArenaError(f"store arena {path}: is a symbolic link (give the arena's own path)") from None
        raise ArenaError(f"store arena {path}: cannot open ({error.strerror})") from None
    try:
        info = os.fstat(fd)
        _check_owner(path, info, uid)
        plan, label = _read_header(fd, path)
        if info.st_size != plan.total_bytes:
            raise ArenaError(f"store arena {path}: {info.st_size} bytes on disk, its header says {plan.total_bytes}")
        if page_bytes is not None or total_bytes is not None:
            check_geometry(plan, page_bytes=page_bytes or 0, total_bytes=total_bytes, where=f"store arena {path}")
        mapping = _map(fd, plan, path)
    except BaseException:
        os.close(fd)
        raise
    return Arena(path, plan, label, backing, ops, False, time.perf_counter() - began, fd, mapping)


def _prefault(base: int, length: int, unit: int, *, threads: int, progress) -> None:
    from hicache.effects._host._memory import MADV_POPULATE_WRITE, _madvise, _run_workers, started_executor

    madvise = _madvise()
    offsets = list(range(0, length, PREFAULT_PIECE_BYTES))
    done = [0]

    def fault(offset: int) -> None:
        size = min(PREFAULT_PIECE_BYTES, length - offset)
        if madvise(base + offset, size, MADV_POPULATE_WRITE) != 0:
            code = ctypes.get_errno()
            if code not in (errno.EINVAL, errno.ENOSYS):
                if code in (errno.ENOMEM, errno.EFAULT, errno.ENOSPC):
                    raise HostOutOfMemoryError(f"pre-faulting the store arena at offset {offset}: out of memory")
                raise OSError(code, os.strerror(code))
            for at in range(offset, offset + size, unit):  # older kernels: a write fault per page
                ctypes.c_char.from_address(base + at).value = ctypes.c_char.from_address(base + at).value
        done[0] += size
        if progress is not None:
            progress(done[0], length)

    workers = max(1, min(threads, len(offsets)))
    if workers == 1:
        for offset in offsets:
            fault(offset)
        return
    pool = started_executor(workers, prefix="hicache-arena")
    try:
        _run_workers(pool, workers, fault, offsets)
    finally:
        pool.shutdown(wait=True)


def _incomplete(path: str, backing: Backing) -> bool:
    """A file at ``path`` not finished: empty, or still marked `CREATING` - or, on hugetlbfs
    (`_mark_creating`), one hugepage of zeros: a creator that died before its mark. Its creator
    is at work, or died (which one: the creators' lock says - under it, one that died)."""
    if _refuse_non_regular(path) is None:
        return False
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK)
    except FileNotFoundError:
        return False
    try:
        info = os.fstat(fd)
        _check_owner(path, info)
        if info.st_size == 0:
            return True
        first = os.pread(fd, len(CREATING), 0)
        unmarked = backing.kind == "hugetlbfs" and info.st_size == backing.unit_bytes and first == bytes(len(CREATING))
        return first == CREATING or unmarked
    finally:
        os.close(fd)


def _await_creator(path: str, backing: Backing, wait: bool, lock_dir) -> None:
    """An unfinished arena at ``path``: return once no creator is at work on it (waiting for
    one when ``wait``), so the attach reads what it made; `ArenaError` where its creator died
    (the lock is free, the arena still unfinished), `ArenaBeingCreatedError` where one is at
    work and ``wait`` is False."""
    holder = creator_at_work(path, directory=lock_dir)
    if holder is None:
        if not _incomplete(path, backing):  # finished between the two looks
            return
        raise ArenaError(f"store arena {path}: not finished (no header): its creator died before writing it; "
                         f"`hicache store create {path}` (or an engine given size_gb) makes it afresh")
    if not wait:
        raise ArenaBeingCreatedError(f"store arena {path}: not finished: pid {holder} is still creating it (try "
                                     "again once it is done)", creator=holder)
    log.warning("hicache: store arena %s is being created by pid %s; waiting up to %.0f s for it", path, holder,
                CREATE_WAIT_S)
    CreatorsLock(path, timeout_s=CREATE_WAIT_S, directory=lock_dir).close()


def _mark_creating(fd: int, backing: Backing) -> None:
    """`CREATING` at the start of the new file, before the arena is reserved. hugetlbfs takes
    no write() (EINVAL: its files are only mapped), so there the file is first made one hugepage
    long and the mark written through a mapping of that page; a creator killed between the two
    leaves one hugepage of zeros, which `_incomplete` counts as its own."""
    if backing.kind != "hugetlbfs":
        os.pwrite(fd, CREATING, 0)
        return
    os.ftruncate(fd, backing.unit_bytes)
    try:  # a shared hugetlbfs mapping reserves its page here: none free is ENOMEM, not a SIGBUS later
        first = mmap.mmap(fd, backing.unit_bytes, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
    except OSError as error:
        raise ArenaError(f"store arena: cannot map a first hugepage on {backing.mount.point} ({error.strerror}; "
                         "free hugepages: /proc/sys/vm/nr_hugepages)") from None
    with first:
        first[:len(CREATING)] = CREATING


def check_room(path: str, plan: StorePlan, backing: Backing) -> None:
    """`ArenaError` when the backing's free room (statvfs; free hugepages) is below the plan."""
    if backing.free_bytes < plan.total_bytes:
        raise ArenaError(
            f"store arena {path}: {backing.mount.point} ({backing.kind}) has {backing.free_bytes} bytes free, "
            f"the arena needs {plan.total_bytes}"
            + (" (free hugepages: /proc/sys/vm/nr_hugepages)" if backing.kind == "hugetlbfs"
               else " (a container's /dev/shm: docker run --shm-size)")
        )


def create_arena(path: str, plan: StorePlan, *, label: str, threads: int | None = None, progress=None,
                 exist_ok: bool = True, page_bytes: int | None = None, total_bytes: int | None = None,
                 ops=None, root: str = "/", wait_s: float = CREATE_WAIT_S, backing: Backing | None = None,
                 lock_dir=None, admit=None) -> Arena:
    """Create the arena at ``path`` with ``plan`` and pre-fault it - or, when it exists already
    (``exist_ok``), attach it as `attach_arena` does with ``page_bytes``/``total_bytes``.
    Checks the mount and its room first: `ArenaError` before anything is allocated
    (``backing``: the path's, when the caller read it already; ``lock_dir``: where the creators'
    lock lives, default hicache's private runtime directory). ``admit``: a context manager
    factory entered around a creation only - never an attach - after the creators' lock is
    taken and the room checked (the node store's budget claim: so nothing waits for another
    creator while holding the host-wide budget lock, and a dead creator's file replaced is
    claimed like any new arena). ``ops``: as `attach_arena` takes them."""
    ops = slot_ops(ops, where="create_arena")
    backing = backing_of(path, root=root) if backing is None else backing
    _refuse_non_regular(path)  # before any wait: a FIFO or a symlink is one error, not a hang
    if backing.kind != plan.backing or plan.unit_bytes != backing.unit_bytes:
        raise ArenaError(
            f"store arena {path}: {backing.mount.point} is {backing.kind} with {backing.unit_bytes}-byte pages, the plan "
            f"is for {plan.backing} with {plan.unit_bytes}-byte pages"
            + (" (wrong hugepage size: plan with the mount's pagesize=)" if backing.kind == "hugetlbfs" else "")
        )
    lock = CreatorsLock(path, timeout_s=wait_s, directory=lock_dir)
    try:
        if os.path.lexists(path):
            if _incomplete(path, backing):
                os.unlink(path)  # a creator died before the header: nothing in it was ever served
            elif not exist_ok:
                raise ArenaError(f"store arena {path}: exists already (hicache store drop {path} removes it)")
            else:
                return attach_arena(path, page_bytes=page_bytes, total_bytes=total_bytes, ops=ops, root=root,
                                    backing=backing)
        check_room(path, plan, backing)
        with (admit() if admit is not None else contextlib.nullcontext()):
            return _create(path, plan, label, backing, threads=threads, progress=progress, ops=ops)
    finally:
        lock.close()


def _create(path, plan, label, backing, *, threads, progress, ops) -> Arena:
    began = time.perf_counter()
    header = encode_header(plan, label=label)  # a bad label fails before the file exists
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    mapping = None
    try:
        os.fchmod(fd, 0o600)
        _mark_creating(fd, backing)  # before the arena is reserved: a creator's death is told from others' files
        try:
            os.posix_fallocate(fd, 0, plan.total_bytes)
        except OSError as error:
            raise ArenaError(f"store arena {path}: cannot reserve {plan.total_bytes} bytes on {backing.mount.point} "
                             f"({error.strerror})") from None
        mapping = _map(fd, plan, path)
        base = ctypes.addressof(ctypes.c_char.from_buffer(mapping))
        try:
            _prefault(base, plan.total_bytes, plan.unit_bytes, threads=threads or min(os.cpu_count() or 1, 16),
                      progress=progress)
        finally:
            del base
        mapping[0:len(header)] = header  # last: only now is it an arena
    except BaseException:
        if mapping is not None:
            try:
                mapping.close()
            except BufferError:
                pass
        os.close(fd)
        os.unlink(path)
        raise
    return Arena(path, plan, label, backing, ops, True, time.perf_counter() - began, fd, mapping)


def drop_arena(path: str, *, lock_dir=None) -> bool:
    """Unlink the arena at ``path`` (its pages go when the last engine unmaps it). False when
    there was none; `ArenaError` for what is not an arena of this user (never removed), and
    `ArenaBeingCreatedError` for one a creator is still making (``lock_dir`` as for
    `create_arena`): unlinked under it, the creator would finish an arena no engine can find,
    and the next engine would make a second one. Its mode does not matter: one's own arena left
    open to others is exactly what status says to drop."""
    info = _refuse_non_regular(path)
    if info is None:
        return False
    _check_owner(path, info, mode=False)
    fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK)
    try:
        first = os.pread(fd, 8, 0)
    finally:
        os.close(fd)
    if first not in (b"HICSTORE", CREATING, b""):
        raise ArenaError(f"store arena {path}: not a hicache store arena (its first bytes differ): not removed")
    if first != b"HICSTORE" and (holder := creator_at_work(path, directory=lock_dir)) is not None:
        raise ArenaBeingCreatedError(f"store arena {path}: pid {holder} is still creating it: not removed (stop that "
                                     "create instead: an interrupted create removes its file)", creator=holder)
    os.unlink(path)
    return True

