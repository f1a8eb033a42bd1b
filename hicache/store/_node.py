"""The node store's orchestration: `NodeStore` (keys in a `Namespace`, pages as segment lists,
over one attached arena and its `SlotIndex`), its own counts (`StoreCounts`) and `open_store`,
which plans the arena, claims its room once and attaches it. No memory word, lock, clock or copy
of its own: those are hicache.effects' arena room; the slot policy is hicache.plan's.
"""


from __future__ import annotations

import threading
from contextlib import contextmanager

import attrs

from hicache.effects import arena as _arena
from hicache.errors import ArenaGeometryError, PlanError, StoreClosedError, TransferError
from hicache.plan import plan_store
from hicache.plan.checks import check_bool, check_int
from hicache.plan.store_format import check_label
from hicache.store._index import NO_NAMESPACE, Census, SlotIndex
from hicache.store._namespaces import BUSY
from hicache.store._keys import Namespace, SlotKeyMemo
from hicache.store._pages import PageSegments, check_pages


@attrs.define
class StoreCounts:
    """This store's own counts since it opened (the arena keeps node-wide ones too)."""

    hits: int = 0
    misses: int = 0
    torn: int = 0
    corrupt: int = 0
    evictions: int = 0
    writes: int = 0
    busy: int = 0  # pages not stored: their namespace entry was being freed by another process


class NodeStore:
    """Pages by key in one attached arena. Never waits for another process on a read.

    A batch's pages are a list of segment lists ``[(ptr, bytes), ...]`` per page, or one
    `PageSegments` (the same, flat in u64 arrays: no per-page Python on the way to the copy).
    Pointers are the caller's: a page's segments ``(ptr, bytes)`` are checked here to be whole
    8-byte words making one page of the namespace, each segment inside the address space and
    outside this arena's own mapping (a segment into the arena's index would overwrite every
    attached engine's view of it) - not to lie inside memory the caller owns, which only the
    caller knows (`HiCacheNodeStore` checks every segment against its pool's own buffers first).

    Every call after `close` raises `StoreClosedError`; `close` waits for the calls in flight on
    other threads (none of them waits on another process) and then unmaps."""

    def __init__(self, arena, *, fault_hook=None) -> None:
        self.arena = arena
        self.index = SlotIndex(arena, fault_hook=fault_hook)
        self.counts = StoreCounts()
        self._counting = threading.Lock()  # SGLang's prefetch and backup threads count at once
        self._digests: dict[Namespace, bytes] = {}
        self._slot_keys = SlotKeyMemo()
        self._entries: dict[Namespace, int] = {}  # a cache: `_held_entry` checks it on every write
        self._used: set[Namespace] = set()  # what clear() empties by default
        self._calls = threading.Condition()  # the calls in flight, which close() waits for
        self._in_flight = 0
        self._closing = False
        self.reclaimed = self.index.reclaim_torn() if not arena.created else 0

    @property
    def closed(self) -> bool:
        return self._closing or self.arena.closed

    def _closed_error(self, call: str) -> StoreClosedError:
        return StoreClosedError(f"node store {self.arena.path}: {call} after close() (the arena is unmapped here: "
                                "attach it again with open_store)")

    @contextmanager
    def _open_for(self, call: str):
        """The arena stays mapped until this call is done; after close() it is an error."""
        with self._calls:
            if self._closing or self.arena.closed:
                raise self._closed_error(f"{call}()")
            self._in_flight += 1
        try:
            yield
        finally:
            with self._calls:
                self._in_flight -= 1
                if not self._in_flight:
                    self._calls.notify_all()

    def _digest(self, namespace: Namespace) -> bytes:
        """The namespace's digest (a read needs no table entry: a query registers nothing)."""
        if namespace not in self._digests:
            if not isinstance(namespace, Namespace):
                raise TransferError(f"namespace must be a hicache.store.Namespace, got {namespace!r}")
            if namespace.page_bytes > self.arena.plan.slot_bytes:
                raise ArenaGeometryError(f"a page of {namespace.page_bytes} bytes does not fit the arena's "
                                         f"{self.arena.plan.slot_bytes}-byte slots ({namespace.description})")
            self._digests[namespace] = namespace.digest
        return self._digests[namespace]

    def _held_entry(self, namespace: Namespace) -> int | None:
        """The namespace's table entry, claimed by its first write and held (shared) until
        `release_entry`: another process cannot free it while pages go under it. A cached entry
        that was freed (or reused) since is claimed again; None when another process was
        freeing it at every look (the write stores nothing rather than wait)."""
        digest = self._digest(namespace)
        entry = self._entries.get(namespace)
        if entry is not None and self.index.hold_entry(entry, digest):
            return entry
        # freed (or reused) since it was cached: claimed and held again in one step
        entry = self.index.register_namespace(digest, namespace.description)
        if entry == BUSY:
            self._entries.pop(namespace, None)
            return None
        self._entries[namespace] = entry
        return entry

    def _pages(self, namespace: Namespace, keys, pages) -> PageSegments:
        """``pages`` as one batch of segments, checked (`check_pages`)."""
        pages = PageSegments.of(pages)
        check_pages(pages, count=len(keys), page_bytes=namespace.page_bytes,
                    arena=(self.arena.base, self.arena.base + self.arena.plan.total_bytes), where=self.arena.path,
                    ops=self.arena.ops)
        return pages

    def exists(self, namespace: Namespace, keys) -> int:
        """How many leading ``keys`` are held (SGLang's `batch_exists`)."""
        _one_batch(keys)
        with self._open_for("exists"):
            if not keys:
                return 0
            return self.index.leading(self._slot_keys(self._digest(namespace), keys))

    def present(self, namespace: Namespace, keys) -> list[bool]:
        """Whether each of ``keys`` is held."""
        _one_batch(keys)
        with self._open_for("present"):
            if not keys:
                return []
            found, _ = self.index.find(self._slot_keys(self._digest(namespace), keys))
            return [slot != _arena.NOT_FOUND for slot in found]

    def get(self, namespace: Namespace, keys, pages) -> list[bool]:
        """Copy each held key's page into its segments; a miss, torn or corrupt page is False."""
        _one_batch(keys)
        with self._open_for("get"):
            return self._get(namespace, keys, pages)

    def _get(self, namespace: Namespace, keys, pages) -> list[bool]:
        if not keys:
            return []
        digest = self._digest(namespace)
        pages = self._pages(namespace, keys, pages)
        ok, torn, corrupt = self.index.read(self._slot_keys(digest, keys), pages, page_bytes=namespace.page_bytes)
        hits = sum(ok)
        with self._counting:
            self.counts.hits += hits
            self.counts.misses += len(ok) - hits
            self.counts.torn += torn
            self.counts.corrupt += corrupt
        self.arena.add_counters(hits=hits, misses=len(ok) - hits, torn=torn, corrupt=corrupt)
        return ok

    def put(self, namespace: Namespace, keys, pages, *, first_depth: int = 0) -> list[bool]:
        """Store each key's page from its segments (``first_depth``: the chain position of the
        first key, from SGLang's ``prefix_keys``). True for pages stored or already held."""
        _one_batch(keys)
        with self._open_for("put"):
            return self._put(namespace, keys, pages, first_depth=first_depth)

    def _put(self, namespace: Namespace, keys, pages, *, first_depth: int) -> list[bool]:
        if not keys:
            return []
        digest = self._digest(namespace)
        pages = self._pages(namespace, keys, pages)
        self._used.add(namespace)
        entry = self._held_entry(namespace)
        if entry is None:  # another process frees the entry at every look: not stored, no wait
            with self._counting:
                self.counts.busy += len(keys)
            return [False] * len(keys)
        try:
            depths = [first_depth + i for i in range(len(keys))]
            result = self.index.write(self._slot_keys(digest, keys), pages, page_bytes=namespace.page_bytes, depths=depths,
                                      namespace=entry)
        finally:
            self.index.release_entry(entry)
        with self._counting:
            self.counts.evictions += result.evictions
            self.counts.writes += result.written
        self.arena.add_counters(evictions=result.evictions, writes=result.written)
        return result.stored

    def clear(self, namespaces=None) -> int:
        """Empty the pages of ``namespaces`` (default: every namespace this store wrote) and
        free their table entries; returns how many pages went."""
        with self._open_for("clear"):
            chosen = self._used if namespaces is None else namespaces
            entries = {self.index.entry_of(self._digest(ns)) for ns in chosen} - {NO_NAMESPACE}
            if not entries:
                return 0
            cleared = self.index.clear(entries)
            self.index.free_entries(entries)
            return cleared

    def census(self) -> Census:
        """What the arena holds now."""
        with self._open_for("census"):
            return self.index.census()

    def __repr__(self) -> str:
        plan = self.arena.plan
        return (f"<NodeStore {self.arena.path}: {self.arena.backing.kind}, {plan.slots:,} slots of "
                f"{plan.slot_bytes:,} bytes, {'closed' if self.closed else 'open'}>")

    def __enter__(self) -> "NodeStore":
        """``with open_store(...) as store:`` - closed when the block ends, however it ends."""
        if self.closed:
            raise self._closed_error("with")
        return self

    def __exit__(self, *exc_info) -> None:
        self.close()

    def close(self) -> None:
        """Wait for the calls in flight, then unmap; idempotent. Later calls raise
        `StoreClosedError`. The arena's pages stay for the next attach."""
        with self._calls:
            self._closing = True
            while self._in_flight:
                self._calls.wait()
        self.arena.close()


def _one_batch(keys) -> None:
    """``keys`` is a batch: a str or bytes would be read as one key per character, silently, and
    None (or anything without a length) read as no keys at all."""
    if isinstance(keys, (str, bytes)):
        raise TransferError(f"keys must be a list of strings, got one {type(keys).__name__}: {keys[:40]!r}")
    if not hasattr(keys, "__len__"):
        raise TransferError(f"keys must be a list of strings, got {type(keys).__name__} {keys!r:.60}")


#: the most threads `open_store` pre-faults a new arena with (each is a thread of this process)
MAX_PREFAULT_THREADS = 1024


def open_store(path: str, *, size_bytes: int | None, slot_bytes: int, label: str = "", progress=None,
               threads: int | None = None, ops=None, fault_hook=None, root: str = "/", machine=None, lock=None,
               budget: bool = True) -> NodeStore:
    """Attach the arena at ``path`` - creating it with ``size_bytes`` when it does not exist yet
    and ``size_bytes`` is given - and return a store over it. Errors name the path and field.

    A creation is a node claim on the host-wide budget, counted once whichever rank makes it:
    under the budget lock (``lock``, default hicache's host-wide one) the arena must fit this
    machine's available memory (``machine``: injected `MachineFacts`, default probed; no
    per-rank split, no reserve - it is the node's), and the lock is held until the arena is
    pre-faulted, so a pool bring-up beside it samples memory with the arena already resident.
    An attach claims nothing: the arena's pages are resident already, seen as used by every
    process's probe. ``budget=False`` skips the claim (`hicache store create` on a node agent
    that checked already). ``ops``: the slot operations, ``"auto"`` (the C helper where built),
    ``"native"``, ``"python"`` (the fallback) or an ops class."""
    # open_store's own arguments, before any file is touched (they failed as a bare TypeError or
    # AttributeError, and budget="no" was truthy): a str path, or a PathLike giving one
    fspath = getattr(type(path), "__fspath__", None)
    path = path if isinstance(path, str) or fspath is None else fspath(path)
    if not isinstance(path, str):
        raise PlanError(f"open_store.path must be a path, got {path!r}")
    check_label(label, where="open_store.label")  # before any lock or claim: the header holds it
    threads = None if threads is None else check_int(PlanError, "open_store", "threads", threads,
                                                     maximum=MAX_PREFAULT_THREADS)
    budget = check_bool(PlanError, "open_store", "budget", budget)
    # named as the caller named them (the plan's own check says total_bytes, a field it has)
    slot_bytes = check_int(PlanError, "open_store", "slot_bytes", slot_bytes)
    size_bytes = None if size_bytes is None else check_int(PlanError, "open_store", "size_bytes", size_bytes)
    ops = _arena.slot_ops(ops, where="open_store")
    if size_bytes is None:
        # an engine given no size: a node agent's `hicache store create` may still be pre-faulting it
        arena = _arena.attach_arena(path, page_bytes=slot_bytes, ops=ops, root=root, wait_for_creator=True)
        return NodeStore(arena, fault_hook=fault_hook)
    backing = _arena.backing_of(path, root=root)
    plan = plan_store(size_bytes, slot_bytes=slot_bytes, unit_bytes=backing.unit_bytes, backing=backing.kind)

    @contextmanager
    def admitted():
        """The creation's claim: under the budget lock (taken inside the arena's creators' lock,
        never while waiting on it), held until the arena is resident - peers then see it as used."""
        from hicache.effects import admission, probe_machine

        budget_lock = admission.budget_lock() if lock is None else lock
        with budget_lock:
            # the one admission (ranks admitted before us may still be pre-faulting: their claims
            # decide, not their fill, issue #35), as a node claim: one rank, no reserve
            node = admission.AdmissionPolicy(ranks_per_host=1, reserve_bytes=0)
            claimed = admission.claim(plan.total_bytes, node, lock=budget_lock, owner=f"the node store {path}",
                                      sample=lambda: probe_machine(root=root) if machine is None else machine)
            try:
                yield
            finally:  # resident (the kernel counts the arena now) or failed: the claim goes either way
                claimed.release()

    # attaching takes no claim: the arena is resident already; a creator at work is waited for
    arena = _arena.create_arena(path, plan, label=label, threads=threads, progress=progress, page_bytes=slot_bytes,
                                total_bytes=size_bytes, ops=ops, root=root, backing=backing,
                                admit=admitted if budget else None)
    return NodeStore(arena, fault_hook=fault_hook)
