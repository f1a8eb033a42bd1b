"""libc's madvise through ctypes, loaded once: CPython's `mmap.madvise` holds the GIL for the
whole call, this releases it (threads pre-fault, advise and give pages back side by side). A leaf:
the host room's memory, THP and release modules share it.
"""

from __future__ import annotations

import ctypes

_libc = None


def madvise_function():
    """``madvise(addr, length, advice) -> int`` (0, or -1 with errno set)."""
    global _libc
    if _libc is None:
        _libc = ctypes.CDLL(None, use_errno=True)
        _libc.madvise.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int)
        _libc.madvise.restype = ctypes.c_int
    return _libc.madvise
