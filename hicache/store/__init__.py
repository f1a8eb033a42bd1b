"""hicache.store: the node-shared KV store - pages in one tmpfs/hugetlbfs arena that every
engine on the node attaches, kept through engine restarts (docs/store.md).

`NodeStore` is the engine-neutral face: keys in a `Namespace`, pages as segment lists
``[(ptr, bytes), ...]``; `hicache.compat.sglang_store.HiCacheNodeStore` puts SGLang's L3 API on
it. The arena's geometry is planned by hicache.plan (`plan_store`), its file and memory are
hicache.effects' arena room, the slot protocol is `_index`.
"""

from __future__ import annotations

from hicache.effects.arena import drop_arena
from hicache.plan import StorePlan, plan_store
from hicache.store._index import Census, SlotIndex
from hicache.store._keys import Namespace, shard_of
from hicache.store._node import MAX_PREFAULT_THREADS, NodeStore, StoreCounts, open_store
from hicache.store._pages import PageSegments

__all__ = ["Census", "MAX_PREFAULT_THREADS", "Namespace", "NodeStore", "PageSegments", "SlotIndex", "StoreCounts",
           "StorePlan", "drop_arena", "open_store", "plan_store", "shard_of"]
