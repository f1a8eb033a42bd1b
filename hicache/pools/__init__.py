"""hicache.pools: SGLang's host KV pool layer (`HostKVCache` and one pool per family), built on
hicache's plan (sizing, copy units) and effects (allocation, one-transaction registration).
Needs torch: ``pip install "hicache[cuda]"``."""

from hicache._extras import require

require("torch", "hicache.pools")

from hicache.pools._allocator import (
    HostTensorAllocator,
    TorchHostTensorAllocator,
    get_allocator_from_storage,
    known_allocators,
    register_allocator,
)
from hicache.pools._base import HostKVCache, Stream, synchronized
from hicache.pools._families import *  # noqa: F403 - every family (their one list: _families.__all__)
from hicache.pools._families import __all__ as _FAMILIES
from hicache.pools._forms import Form
from hicache.pools._geometry import PoolGeometry
from hicache.pools._hisparse import HiSparseHostPoolMixin
from hicache.pools._logical import LogicalHostPool
from hicache.pools._options import HostPoolOptions, with_host
from hicache.pools._page_allocator import PageAllocator
from hicache.pools._server import NO_SERVER, NoServer, serve_in, server
from hicache.pools._storage import HICACHE_HOST_MEMORY_RESERVE_BYTES

__all__ = [
    "HICACHE_HOST_MEMORY_RESERVE_BYTES",
    # the serving process the pools ask: it comes with their HostSetup, or their class's
    # (with_host; hicache.compat's plug-in registers SGLang's); serve_in/server: deprecated
    "NO_SERVER",
    "NoServer",
    "serve_in",
    "server",
    "with_host",
    "Form",
    "HiSparseHostPoolMixin",
    "HostKVCache",
    "HostPoolOptions",
    "HostTensorAllocator",
    "LogicalHostPool",
    "PageAllocator",
    "PoolGeometry",
    "Stream",
    "TorchHostTensorAllocator",
    "get_allocator_from_storage",
    "known_allocators",
    "register_allocator",
    "synchronized",
    *_FAMILIES,  # a new family is a row of _families, not of this list too
]
