"""The word-level operations the node store's slot protocol runs on shared memory, in two
interchangeable implementations: the optional C helper `_slotops` (acquire/release atomics,
copies that checksum as they go, without the GIL, at memory speed) and a fallback without a
compiler (ctypes aligned 8-byte loads and stores, memmove, torch sums) that computes the same
checksums in closed form - an arena written by one is read by the other. Also the per-slot OFD locks writers take.

The fallback's loads and stores are single aligned moves, ordered on x86-64 (TSO); on weakly
ordered CPUs a reader that sees a half-published slot still fails its checksum: a miss, never
wrong bytes. The fallback's counter additions are made under a non-blocking OFD lock (a busy
lock keeps the delta for the next call: no reader ever waits).
"""

from __future__ import annotations

import ctypes
import fcntl
import struct
from array import array

from hicache.errors import PlanError
from hicache.plan import SlotView, published_generation, reclaimed_generation, victim_order, window_of
from hicache.plan.store_format import DEPTH_OFFSET as _DEPTH
from hicache.plan.store_format import LENGTH_OFFSET as _LENGTH
from hicache.plan.store_format import NS_OFFSET, RECORD_BYTES, REF_OFFSET, STAMP_OFFSET, WRITER_OFFSET
from hicache.plan.store_format import SUM1_OFFSET as _SUM1
from hicache.plan.store_format import SUM2_OFFSET as _SUM2

try:
    from hicache.effects._arena import _slotops as _native
except ImportError:  # built without a C compiler: PythonSlotOps below
    _native = None

MASK = 2**64 - 1
NOT_FOUND = MASK
#: A key's outcome in `read_pages` (one byte each): not held, its page delivered, a writer moved
#: the slot on meanwhile (those bytes are not the key's), or length/checksum wrong while it stood still.
MISS, HIT, TORN, CORRUPT = range(4)
_RECORD_LAYOUT = {"RECORD_BYTES": RECORD_BYTES, "OFF_SUM1": _SUM1, "OFF_SUM2": _SUM2, "OFF_LENGTH": _LENGTH,
                  "OFF_DEPTH": _DEPTH, "OFF_REF": REF_OFFSET, "OFF_NS": NS_OFFSET, "OFF_WRITER": WRITER_OFFSET,
                  "OFF_STAMP": STAMP_OFFSET}
if _native is not None and any(getattr(_native, name, None) != value for name, value in _RECORD_LAYOUT.items()):
    _native = None  # a stale build of another record layout: never read records through it (the fallback is right)
#: slots within this many of a run's first that a clear locks with one OFD lock (a writer whose
#: window is among them finds it busy for the few microseconds the run takes: its page goes unstored)
CLEAR_RUN = 256
_FLOCK = struct.Struct("hhqqi4x")  # struct flock (x86-64 / aarch64): type, whence, start, len, pid


def try_lock(fd: int, offset: int, length: int) -> bool:
    """An OFD write lock on ``[offset, offset + length)`` of the arena file, or False at once when
    another holder has it. Released by `unlock`, by closing the file, or by the holder's death
    (kill -9 included): what makes a dead writer's slot reclaimable."""
    try:
        fcntl.fcntl(fd, fcntl.F_OFD_SETLK, _FLOCK.pack(fcntl.F_WRLCK, 0, offset, length, 0))
    except OSError:  # EAGAIN/EACCES: held by another open file description
        return False
    return True


def try_read_lock(fd: int, offset: int, length: int) -> bool:
    """A shared OFD lock on the range (many holders; excludes a write lock), or False at once."""
    try:
        fcntl.fcntl(fd, fcntl.F_OFD_SETLK, _FLOCK.pack(fcntl.F_RDLCK, 0, offset, length, 0))
    except OSError:
        return False
    return True


def unlock(fd: int, offset: int, length: int) -> None:
    fcntl.fcntl(fd, fcntl.F_OFD_SETLK, _FLOCK.pack(fcntl.F_UNLCK, 0, offset, length, 0))


def _u64s(values) -> array:
    return array("Q", values)


def _first_bad_page_torch(ptrs, sizes, per_page: int, page_bytes: int, arena_start: int, arena_end: int) -> int:
    """`check_segments`' rule in vectorized torch (the fallback; the C helper's answers agree):
    the first page with a segment at 0, of no bytes, not whole 8-byte words, larger than a page,
    reaching 2**63 or touching ``[arena_start, arena_end)``, or whose sizes miss ``page_bytes``; -1 if none."""
    import torch

    if not len(ptrs):
        return -1
    ptr = torch.frombuffer(ptrs, dtype=torch.int64)
    size = torch.frombuffer(sizes, dtype=torch.int64)
    end = ptr + size  # both below 2**63 when good: an end at or past it wraps negative, caught as end <= ptr
    bad = ((size <= 0) | (size % 8 != 0) | (size > page_bytes) | (ptr <= 0) | (end <= ptr)
           | ((ptr < arena_end) & (end > arena_start))).view(-1, per_page).any(1)
    bad |= size.view(-1, per_page).sum(1) != page_bytes  # no wrap: at most per_page x page_bytes
    failing = bad.nonzero()
    return int(failing[0, 0]) if failing.numel() else -1


class NativeSlotOps:
    """The C helper's operations."""

    name = "native"
    atomic_add = True

    @staticmethod
    def first_bad_page(ptrs, sizes, per_page: int, page_bytes: int, arena_start: int, arena_end: int) -> int:
        """The store's segment checks in one C pass (`_first_bad_page_torch` where the build predates it)."""
        check = getattr(_native, "check_segments", None)
        if check is None:
            return _first_bad_page_torch(ptrs, sizes, per_page, page_bytes, arena_start, arena_end)
        return check(ptrs, sizes, per_page, page_bytes, arena_start, arena_end)

    load = staticmethod(_native.load) if _native else None
    store = staticmethod(_native.store) if _native else None
    fetch_add = staticmethod(_native.fetch_add) if _native else None

    @staticmethod
    def copy_pages(direction: int, slots, seg_ptrs, seg_lens, per_page: int, seeds) -> list[tuple[int, int]]:
        from hicache.effects._copy._host_copy import copy_workers

        sums = _u64s(seeds)
        # the host copy engine's rule (2 threads on a 2-core box: 8.0 -> 15.7 GB/s copied and
        # checksummed, 128 MLA pages)
        threads = copy_workers(sum(seg_lens))
        _native.copy_pages(direction, len(slots), per_page, _u64s(slots), _u64s(seg_ptrs), _u64s(seg_lens), sums,
                           threads)
        return [(sums[2 * i], sums[2 * i + 1]) for i in range(len(slots))]

    @staticmethod
    def lookup(index_addr: int, nslots: int, window: int, keys: bytes) -> tuple[list[int], list[int]]:
        n = len(keys) // 16
        found, gens = array("Q", bytes(8 * n)), array("Q", bytes(8 * n))
        _native.lookup(index_addr, nslots, window, keys, found, gens)
        return list(found), list(gens)

    @staticmethod
    def victims(index_addr: int, nslots: int, window: int, keys: bytes) -> tuple[list[int], list[int]]:
        """Each key's window in the order a writer tries its slots (see `_python_victims`)."""
        n = len(keys) // 16
        slots, gens = array("Q", bytes(8 * n * window)), array("Q", bytes(8 * n * window))
        _native.victims(index_addr, nslots, window, keys, slots, gens)
        return slots.tolist(), gens.tolist()

    @staticmethod
    def write_pages(index_addr: int, data_addr: int, fd: int, index_offset: int, nslots: int, window: int,
                    slot_stride: int, page_bytes: int, keys: bytes, seg_ptrs, seg_lens, per_page: int, order, seen,
                    depths, namespace: int, pid: int, stamp: int) -> list[int]:
        """The slot protocol's writes in one call (hicache.store._index's `_write`, which the
        fallback runs): each key's status, 0 not stored, 1 stored, 2 stored over a live page."""
        from hicache.effects._copy._host_copy import copy_workers

        n = len(keys) // 16
        status = bytearray(n)
        _native.write_pages(index_addr, data_addr, fd, index_offset, nslots, window, slot_stride, page_bytes, keys,
                            seg_ptrs, seg_lens, per_page, array("Q", order), array("Q", seen),
                            array("Q", depths), namespace, pid, stamp, status, copy_workers(n * page_bytes))
        return list(status)

    @staticmethod
    def clear_slots(index_addr: int, fd: int, index_offset: int, nslots: int, slots, seen, empty: bytes) -> int:
        """A clear's reclaims in one call (`_python_clear_slots`, the fallback, runs them slot by
        slot): each of ``slots`` (ascending) still at the generation it was
        ``seen`` with is emptied to ``empty`` (its record after the generation); returns how many."""
        if not hasattr(_native, "clear_slots"):  # a build that predates it
            return _python_clear_slots(index_addr, fd, index_offset, nslots, slots, seen, empty)
        return _native.clear_slots(index_addr, fd, index_offset, nslots, array("Q", slots), array("Q", seen), empty,
                                   CLEAR_RUN)

    @staticmethod
    def read_pages(index_addr: int, data_addr: int, nslots: int, window: int, slot_stride: int, page_bytes: int,
                   keys: bytes, seg_ptrs, seg_lens, per_page: int, *, found=None,
                   gens=None) -> tuple[list[int], list[int], list[int]]:
        """The slot protocol's reads in one call (see `_python_read_pages`)."""
        from hicache.effects._copy._host_copy import copy_workers

        n = len(keys) // 16
        given = found is not None
        status = bytearray(n)
        found = array("Q", found if given else bytes(8 * n))
        gens = array("Q", gens if given else bytes(8 * n))
        threads = copy_workers(n * page_bytes)
        _native.read_pages(index_addr, data_addr, nslots, window, slot_stride, page_bytes, keys, seg_ptrs, seg_lens,
                           per_page, status, found, gens, threads, int(given))
        return list(status), list(found), list(gens)


_CHUNK = 1 << 15  # half-words per partial sum: 2**15 terms below 2**47 stay below 2**62 (no int64 wrap)


def _page_sum(spans, seed1: int, seed2: int) -> tuple[int, int]:
    """The C helper's checksum of the words at ``spans`` (``(addr, bytes)``, in page order), in
    closed form: ``sum1 = seed1 + sum(w_i)``, ``sum2 = seed2 + sum((2N - p) x_p)`` mod 2**64, x_p
    the page's 2N 32-bit half-words (low half first). Exact integer arithmetic: every torch sum
    is split so that no int64 can wrap (its overflow is undefined in C++), then summed in Python."""
    import torch

    parts = [torch.frombuffer((ctypes.c_char * size).from_address(addr), dtype=torch.int32) for addr, size in spans
             if size]
    if not parts:
        return seed1 & MASK, seed2 & MASK
    halves = (torch.cat(parts) if len(parts) > 1 else parts[0]).to(torch.int64) & 0xFFFFFFFF  # x_p, unsigned
    count = halves.numel()  # 2N
    low, high = halves[0::2], halves[1::2]
    total = int(halves.sum())  # < 2**32 * 2N: exact below 2**31 half-words
    sum1 = seed1 + int(low.sum()) + (int(high.sum()) << 32)
    weighted = 0  # sum(p * x_p), x_p split in 16-bit halves so each chunk's sum stays exact
    for first in range(0, count, _CHUNK):
        x = halves[first:first + _CHUNK]
        p = torch.arange(first, first + x.numel(), dtype=torch.int64)
        weighted += int((p * (x & 0xFFFF)).sum()) + (int((p * (x >> 16)).sum()) << 16)
    return sum1 & MASK, (seed2 + count * total - weighted) & MASK


def _python_victims(index_addr: int, nslots: int, window: int, keys: bytes) -> tuple[list[int], list[int]]:
    """For each 16-byte key, its window's slots in the order a writer tries them, each with the
    generation it was seen with (flat: key i's are ``[i*window, (i+1)*window)``): empty, then
    torn (a dead writer's - its lock will be free), both in window order, then unreferenced
    pages and then referenced ones, each by descending chain depth, then slot. A window of
    referenced pages only loses every referenced bit (CLOCK's hand passes: their second chance
    is spent). Read without locks: the writer re-checks a slot under its lock before taking it."""
    slots, gens = [], []
    for i in range(len(keys) // 16):
        views = []
        for slot in window_of(keys[16 * i:16 * i + 16], nslots, window):
            record = index_addr + slot * RECORD_BYTES
            gen = PythonSlotOps.load(record)
            views.append(SlotView(slot, gen, ctypes.string_at(record + 8, 16) == bytes(16),
                                  bool(ctypes.c_uint8.from_address(record + REF_OFFSET).value),
                                  ctypes.c_uint32.from_address(record + _DEPTH).value))
        order, spent = victim_order(views)
        if spent:  # CLOCK's hand passes: every page of the window loses its second chance
            for view in views:
                ctypes.c_uint8.from_address(index_addr + view.slot * RECORD_BYTES + REF_OFFSET).value = 0
        slots += [slot for slot, _ in order]
        gens += [gen for _, gen in order]
    return slots, gens


def _python_read_pages(index_addr: int, data_addr: int, nslots: int, window: int, slot_stride: int, page_bytes: int,
                       keys: bytes, seg_ptrs, seg_lens, per_page: int, *, found=None,
                       gens=None) -> tuple[list[int], list[int], list[int]]:
    """Each key looked up, its record's length checked, its payload copied into its segments
    while checksumming what was delivered, then its generation re-read: a status per key
    (`MISS`, `HIT`, `TORN`, `CORRUPT`), its slot and the generation seen. A hit sets the slot's
    referenced bit. Every page's segments must be whole words adding up to ``page_bytes``.
    ``found``/``gens``: the caller's own lookup (the tests move a slot on after it)."""
    n = len(keys) // 16
    if page_bytes % 8 or page_bytes > slot_stride:
        raise ValueError("read_pages: bad page bytes")
    for i in range(n):
        sizes = seg_lens[i * per_page:(i + 1) * per_page]
        if any(size <= 0 or size % 8 for size in sizes) or sum(sizes) != page_bytes:
            raise ValueError(f"read_pages: page {i}'s segments are not whole words adding up to {page_bytes} bytes")
    if found is None:
        found, gens = PythonSlotOps.lookup(index_addr, nslots, window, keys)
    found, gens = list(found), list(gens)
    status = [MISS] * n
    record = lambda i: index_addr + found[i] * RECORD_BYTES  # noqa: E731
    still = lambda i: PythonSlotOps.load(record(i)) == gens[i]  # noqa: E731
    copying = []
    for i in range(n):
        if found[i] >= nslots or gens[i] & 1:  # not held (a given slot: checked)
            continue
        if ctypes.c_uint32.from_address(record(i) + _LENGTH).value != page_bytes:
            status[i] = CORRUPT if still(i) else TORN  # the key's digest fixes its length: another is corrupt
            continue
        copying.append(i)
    words = struct.unpack(f"<{2 * n}Q", keys)
    ptrs = [seg_ptrs[i * per_page + s] for i in copying for s in range(per_page)]
    lens = [seg_lens[i * per_page + s] for i in copying for s in range(per_page)]
    sums = PythonSlotOps.copy_pages(1, [data_addr + found[i] * slot_stride for i in copying], ptrs, lens, per_page,
                                    [w for i in copying for w in words[2 * i:2 * i + 2]])
    for i, got in zip(copying, sums):
        recorded = (PythonSlotOps.load(record(i) + _SUM1), PythonSlotOps.load(record(i) + _SUM2))
        if not still(i):
            status[i] = TORN  # rewritten while we copied: those bytes are not the key's
        elif got != recorded:
            status[i] = CORRUPT
        else:
            status[i] = HIT
            ctypes.c_uint8.from_address(record(i) + REF_OFFSET).value = 1  # CLOCK: referenced
    return status, found, gens


def _python_clear_slots(index_addr: int, fd: int, index_offset: int, nslots: int, slots, seen, empty: bytes) -> int:
    """The C helper's `clear_slots` slot by slot: each slot (ascending, inside the arena) whose
    record lock is free and whose generation is still the one seen is held odd while its record
    becomes ``empty``, then published even; returns how many."""
    slots, seen = list(slots), list(seen)
    if len(seen) < len(slots) or len(empty) != RECORD_BYTES - 8:
        raise ValueError("clear_slots: a generation for every slot, and a record's bytes after its generation")
    if any(not 0 <= slot < nslots for slot in slots) or any(b <= a for a, b in zip(slots, slots[1:])):
        raise ValueError(f"clear_slots: a slot past the arena's {nslots} or out of order")
    cleared = 0
    for slot, gen_seen in zip(slots, seen):
        offset = index_offset + slot * RECORD_BYTES
        if not try_lock(fd, offset, RECORD_BYTES):
            continue
        try:
            record = index_addr + slot * RECORD_BYTES
            gen = PythonSlotOps.load(record)
            if gen != gen_seen:
                continue
            odd = reclaimed_generation(gen)
            PythonSlotOps.store(record, odd)
            ctypes.memmove(record + 8, empty, RECORD_BYTES - 8)
            PythonSlotOps.store(record, published_generation(odd))
            cleared += 1
        finally:
            unlock(fd, offset, RECORD_BYTES)
    return cleared


class PythonSlotOps:
    """The fallback: same results, no compiler."""

    name = "python"
    atomic_add = False
    first_bad_page = staticmethod(_first_bad_page_torch)

    @staticmethod
    def load(addr: int) -> int:
        return ctypes.c_uint64.from_address(addr).value

    @staticmethod
    def store(addr: int, value: int) -> None:
        ctypes.c_uint64.from_address(addr).value = value

    @staticmethod
    def fetch_add(addr: int, delta: int) -> int:  # only under the counters' OFD lock (see charter)
        cell = ctypes.c_uint64.from_address(addr)
        old = cell.value
        cell.value = (old + delta) & MASK
        return old

    @staticmethod
    def copy_pages(direction: int, slots, seg_ptrs, seg_lens, per_page: int, seeds) -> list[tuple[int, int]]:
        out = []
        for p, slot in enumerate(slots):
            spans, at = [], slot
            for s in range(per_page):
                seg, length = seg_ptrs[p * per_page + s], seg_lens[p * per_page + s]
                if direction == 0:
                    ctypes.memmove(at, seg, length)
                elif direction == 1:
                    ctypes.memmove(seg, at, length)
                spans.append((seg if direction == 1 else at, length))  # the bytes delivered / stored
                at += length
            out.append(_page_sum(spans, seeds[2 * p], seeds[2 * p + 1]))
        return out

    @staticmethod
    def lookup(index_addr: int, nslots: int, window: int, keys: bytes) -> tuple[list[int], list[int]]:
        found, gens = [], []
        for i in range(len(keys) // 16):
            key = keys[16 * i:16 * i + 16]
            home = int.from_bytes(key[:8], "little") % nslots
            hit, seen = NOT_FOUND, 0
            for j in range(window):
                record = index_addr + ((home + j) % nslots) * 64
                gen = ctypes.c_uint64.from_address(record).value
                if gen == 0 or gen & 1 or ctypes.string_at(record + 8, 16) != key:
                    continue
                if ctypes.c_uint64.from_address(record).value != gen:
                    continue
                hit, seen = (home + j) % nslots, gen
                break
            found.append(hit)
            gens.append(seen)
        return found, gens

    read_pages = staticmethod(_python_read_pages)
    victims = staticmethod(_python_victims)
    clear_slots = staticmethod(_python_clear_slots)


def slot_ops(prefer="auto", *, where: str | None = None):
    """The operations to use: ``"native"`` (the C helper; an ImportError where it was not built),
    ``"python"``, or ``"auto"`` (native where built). With ``where`` (a call's name) ``prefer``
    is that call's ``ops`` argument: also None (auto) or an ops class itself, anything else a
    PlanError naming ``where.ops`` - before the call touches a file."""
    if where is not None:
        if prefer is None:
            prefer = "auto"
        elif isinstance(prefer, type) and issubclass(prefer, (NativeSlotOps, PythonSlotOps)):
            return prefer
        if prefer not in ("auto", "native", "python"):
            raise PlanError(f"{where}.ops must be 'auto', 'native', 'python' or a slot-ops class, got {prefer!r}")
    if prefer not in ("auto", "native", "python"):
        raise ValueError(f"slot ops must be auto, native or python, got {prefer!r}")
    if prefer == "python" or (prefer == "auto" and _native is None):
        return PythonSlotOps
    if _native is None:
        raise ImportError("hicache.effects._arena._slotops was not built (no C compiler at install?)")
    return NativeSlotOps
