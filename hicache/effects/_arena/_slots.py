"""The word-level operations the node store's slot protocol runs on shared memory, in two
interchangeable implementations: the optional C helper `_slotops` (acquire/release atomics,
copies that checksum as they go, without the GIL) and a fallback without a compiler (ctypes
aligned 8-byte loads and stores, memmove, torch sums) that computes the same checksums - an
arena written by one is read by the other. Also the per-slot OFD locks writers take.

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

try:
    from hicache.effects._arena import _slotops as _native
except ImportError:  # built without a C compiler: PythonSlotOps below
    _native = None

MASK = 2**64 - 1
NOT_FOUND = MASK
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


def unlock(fd: int, offset: int, length: int) -> None:
    fcntl.fcntl(fd, fcntl.F_OFD_SETLK, _FLOCK.pack(fcntl.F_UNLCK, 0, offset, length, 0))


def _u64s(values) -> array:
    return array("Q", values)


class NativeSlotOps:
    """The C helper's operations."""

    name = "native"
    atomic_add = True

    load = staticmethod(_native.load) if _native else None
    store = staticmethod(_native.store) if _native else None
    fetch_add = staticmethod(_native.fetch_add) if _native else None

    @staticmethod
    def copy_pages(direction: int, slots, seg_ptrs, seg_lens, per_page: int, seeds) -> list[tuple[int, int]]:
        sums = _u64s(seeds)
        _native.copy_pages(direction, len(slots), per_page, _u64s(slots), _u64s(seg_ptrs), _u64s(seg_lens), sums)
        return [(sums[2 * i], sums[2 * i + 1]) for i in range(len(slots))]

    @staticmethod
    def lookup(index_addr: int, nslots: int, window: int, keys: bytes) -> tuple[list[int], list[int]]:
        n = len(keys) // 16
        found, gens = array("Q", bytes(8 * n)), array("Q", bytes(8 * n))
        _native.lookup(index_addr, nslots, window, keys, found, gens)
        return list(found), list(gens)


def _word_sums(addr: int, nbytes: int, first: int) -> tuple[int, int]:
    """(sum w_i, sum (first + i + 1) w_i) mod 2**64 over the 8-byte words at ``addr``."""
    import torch

    if nbytes == 0:
        return 0, 0
    words = torch.frombuffer((ctypes.c_char * nbytes).from_address(addr), dtype=torch.int64)
    weights = torch.arange(first + 1, first + 1 + words.numel(), dtype=torch.int64)
    return int(words.sum()) & MASK, int((words * weights).sum()) & MASK


class PythonSlotOps:
    """The fallback: same results, no compiler."""

    name = "python"
    atomic_add = False

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
            s1, s2, words, at = seeds[2 * p], seeds[2 * p + 1], 0, slot
            for s in range(per_page):
                seg, length = seg_ptrs[p * per_page + s], seg_lens[p * per_page + s]
                if direction == 0:
                    ctypes.memmove(at, seg, length)
                elif direction == 1:
                    ctypes.memmove(seg, at, length)
                a, b = _word_sums(seg if direction == 1 else at, length, words)
                s1, s2 = (s1 + a) & MASK, (s2 + b) & MASK
                words += length // 8
                at += length
            out.append((s1, s2))
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


def slot_ops(prefer: str = "auto"):
    """The operations to use: ``"native"`` (the C helper; an ImportError where it was not built),
    ``"python"``, or ``"auto"`` (native where built)."""
    if prefer not in ("auto", "native", "python"):
        raise ValueError(f"slot ops must be auto, native or python, got {prefer!r}")
    if prefer == "python" or (prefer == "auto" and _native is None):
        return PythonSlotOps
    if _native is None:
        raise ImportError("hicache.effects._arena._slotops was not built (no C compiler at install?)")
    return NativeSlotOps
