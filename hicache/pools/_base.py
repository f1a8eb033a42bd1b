"""`HostKVCache`: the base of every host KV pool - sizing, allocation, registration, pages.

Owns a pool's lifetime: size it (ceil pages, decimal GB per rank), check the budget under the
host-wide lock together with the allocation, allocate every buffer, register them all as one
transaction (or none, and the memory is freed), hand out pages, move pages to and from the
device pool, and `destroy()` - release the registration, then free the memory. Subclasses
say only what their buffers and device views look like.
"""

from __future__ import annotations

import abc
import logging
import threading
from functools import wraps
from typing import NamedTuple

import attrs

from hicache.effects import (
    DEFAULT_HUGEPAGE_BYTES,
    HUGEPAGE_MODES,
    HUGETLBFS_MODES,
    CopyEngine,
    FrameworkPinnedAllocator,
    bring_up,
    deferred_interrupts,
    pool_settings,
    probe_limits,
    resolve_numa_node,
)
from hicache.errors import LayoutError, RegistrationStateError, ReleaseError, TransferError
from hicache.plan import format_gb, plan_pool, size_pool
from hicache.pools._allocator import get_allocator_from_storage
from hicache.pools._page_allocator import PageAllocator
from hicache.pools._progressive import PROGRESSIVE_LAYOUTS, ProgressiveMixin
from hicache.pools._transfer import (
    Descriptors,
    IndexMemo,
    Link,
    ReadyCopy,
    make_link,
    check_backend,
    copy_tokens,
)
from hicache.pools._storage import StoragePagesMixin
from hicache.pools._views import layer_token_view

logger = logging.getLogger(__name__)

_FRAMEWORK_PINNED = ("npu", "musa")  # devices whose framework pins host memory itself


def synchronized(func):
    """Run the method holding ``self.lock`` (an RLock), as SGLang's decorator does."""

    @wraps(func)
    def wrapper(self, *args, **kwargs):
        with self.lock:
            return func(self, *args, **kwargs)

    return wrapper


class Stream(NamedTuple):
    """One host<->device copy stream: a host buffer (and K/V half) and its device tensor."""

    buffer: int
    kv: int | None
    device: object  # callable(device_pool, layer) -> device tensor for that layer
    rows: bool = False  # whole page rows (DSA, DeepSeek-V4) instead of token slots


class NoAllocatorError(RegistrationStateError, NotImplementedError):
    """A pool that reuses another pool's indices has no allocator (SGLang raises
    NotImplementedError there; this is both)."""


def _device_type(device_pool) -> str:
    device = getattr(device_pool, "device", "cpu")
    return str(device).split(":")[0]


class HostKVCache(ProgressiveMixin, StoragePagesMixin, abc.ABC):
    """Abstract host KV pool with SGLang's constructor and interface.

    ``host_size`` is decimal GB per rank (SGLang's ``--hicache-size``; 0 to size by
    ``host_to_device_ratio``). SGLang's defaults: ``pin_memory=True``, ``device="cpu"``,
    ``allocator_type="default"`` (any storage back end's name, ``None`` included: names
    without an allocator of their own get the default one), ``pool_label="kv"``. Layer ids are
    pool-local (``0..layer_num-1``), as SGLang's controller passes them. Keywords beyond
    SGLang's (keyword-only): ``strict_allocator`` (an unknown ``allocator_type`` is an error), ``runtime`` (a `HostRuntime`;
    default cuda-python, or `hicache.testing.fake_cuda`'s), ``limits`` (default
    `probe_limits()`), ``machine`` (`MachineFacts` for the budget; default `probe_machine()`),
    ``host_memory_bytes`` (overrides the machine's available memory), ``budget_lock`` (default:
    the host-wide lock), ``allocator_fallback`` (an allocator type for unknown ones),
    ``page_num`` (size like an anchor pool instead), ``ledger`` (default: the process's),
    ``copy_engine`` (a `CopyEngine`; default: one with the host copy mode the probes resolve),
    ``numa_node`` (``"auto"``: the current GPU's node where there are several; ``"off"``; N),
    ``progressive`` (return once the first page of every buffer is registered and register
    the rest in the background; `alloc` hands out ready pages only - see `ready_pages`,
    `wait_ready`; page-first layouts only, layer_first registers everything first; None, the
    default: ``HICACHE_PROGRESSIVE``, else False - SGLang's call sites pass no keywords),
    ``max_stall_s`` (progressive: no call holds the driver longer, by the measured rate; the
    first call is at most 16 MiB; None: one call per planned chunk), ``hugepages`` (``"off"``,
    ``"thp"``, ``"prefer"``, ``"required"`` as `allocate_host`; None: ``HICACHE_HUGEPAGES``,
    else ``"off"``).
    Bring-up and teardown go through `hicache.effects.bring_up`.
    """

    has_allocator = True

    def __init__(
        self,
        device_pool,
        host_to_device_ratio: float,
        host_size: float,
        page_size: int,
        layout: str,
        pin_memory: bool = True,
        device: str = "cpu",
        allocator_type: str | None = "default",
        *,
        pool_label: str = "kv",
        strict_allocator: bool = False,
        runtime=None,
        limits=None,
        host_memory_bytes: int | None = None,
        allocator_fallback: str | None = None,
        page_num: int | None = None,
        ledger=None,
        machine=None,
        budget_lock=None,
        copy_engine=None,
        numa_node="auto",
        progressive: bool | None = None,
        max_stall_s: float | None = 0.25,
        hugepages: str | None = None,
    ) -> None:
        self.device_pool = device_pool
        self.page_size = page_size
        self.layout = layout
        self.pin_memory = pin_memory
        self.device = device
        self.runtime = runtime
        self.ledger = ledger  # None: the process ledger (what CUDA holds for this process)
        self.pool_label = pool_label
        self.allocator = get_allocator_from_storage(
            allocator_type, fallback=allocator_fallback or "default", strict=strict_allocator
        )
        self.dtype = self._store_dtype(device_pool)
        self.start_layer = getattr(device_pool, "start_layer", 0) or 0
        self.layer_num = self._layer_count(device_pool)
        # Never from device_pool.end_layer: SGLang sets it inclusive when the caller gave none
        # and exclusive when ModelRunner passes one; layer ids here are pool-local anyway.
        self.end_layer = self.start_layer + self.layer_num
        supported = self.descriptor_class().supported()
        if layout not in supported:
            raise LayoutError(f"{type(self).__name__}: layout {layout!r} is not supported; supported: {', '.join(supported)}")
        self.size_per_token = self.get_size_per_token()
        if page_num is None:
            sized = size_pool(
                size_per_token_bytes=self.size_per_token, page_size=page_size,
                host_gb=host_size if host_size and host_size > 0 else None,
                device_tokens=getattr(device_pool, "size", None) or None,
                host_to_device_ratio=host_to_device_ratio,
            )
            for note in sized.notes:
                logger.warning("%s: %s", type(self).__name__, note)
            page_num = sized.page_num
        self.page_num = page_num
        self.size = page_num * page_size
        self.descriptor = self.layout_descriptor(page_num)
        settings = pool_settings() if progressive is None or hugepages is None else None  # HICACHE_*
        self.progressive = settings.progressive if progressive is None else bool(progressive)
        self.hugepages = settings.hugepages if hugepages is None else hugepages
        if self.hugepages not in HUGEPAGE_MODES:
            raise LayoutError(f"{type(self).__name__}.hugepages must be one of {HUGEPAGE_MODES}, got {self.hugepages!r}")
        self._limits = limits if limits is not None else probe_limits()
        if self.hugepages in HUGETLBFS_MODES and self._limits.hugepage_bytes is None:
            # hugetlbfs: boundaries on the huge page, so no two calls share one (vLLM PR #51081);
            # the base is then hugepage aligned (or, if "prefer" falls back, page aligned: finer)
            self._limits = attrs.evolve(self._limits, hugepage_bytes=DEFAULT_HUGEPAGE_BYTES, base_alignment_bytes=max(
                self._limits.base_alignment_bytes, DEFAULT_HUGEPAGE_BYTES))
        self.pool_plan = plan_pool(self.descriptor, self._limits)
        self.lock = threading.RLock()
        self.registration = None
        self.kv_buffer = None
        self._destroyed = False
        self._index_memo = IndexMemo()  # indices of the last transfer, checked
        self._views: dict = {}  # (buffer, kv, layer) -> host view, for transfers
        self._links: dict = {}  # (buffer, kv, layer, direction, device tensor) -> Link
        self._host_memory_bytes = host_memory_bytes
        self._machine = machine
        self._budget_lock = budget_lock
        self._host = None  # the effects.HostPools handle: memory, registration, budget entry
        self._pages = None
        self._progressive = None  # effects.BackgroundBringUp: registering (and faulting) in the background
        self._readiness = None
        self.max_stall_s = max_stall_s
        self.copy_engine = copy_engine if copy_engine is not None else CopyEngine()
        self.numa_node, note = resolve_numa_node(numa_node)
        if note:
            logger.info("%s: %s", type(self).__name__, note)
        if self.numa_node is not None and hasattr(self.allocator, "numa_node"):
            self.allocator.numa_node = self.numa_node
        if hasattr(self.allocator, "hugepages"):
            self.allocator.hugepages = self.hugepages
            if self.hugepages in HUGETLBFS_MODES:  # the size the plan's boundaries keep to
                self.allocator.hugepage_bytes = self._limits.hugepage_bytes
        self._reserve()
        try:
            if self._pages is None and self.has_allocator:
                self._pages = PageAllocator(page_num, page_size)
        except BaseException:  # never leave a half-built pool holding pinned memory
            self.destroy()
            raise

    # -- what subclasses say ---------------------------------------------------------------
    @classmethod
    @abc.abstractmethod
    def descriptor_class(cls):
        """The hicache.plan layout descriptor class of this family."""

    @abc.abstractmethod
    def layout_descriptor(self, page_num: int):
        """This pool's layout descriptor for ``page_num`` pages."""

    @abc.abstractmethod
    def streams(self) -> list[Stream]:
        """The copy streams between host buffers and the device pool."""

    def _layer_count(self, device_pool) -> int:
        return device_pool.layer_num

    def _store_dtype(self, device_pool):
        return getattr(device_pool, "store_dtype", None) or device_pool.dtype

    def buffer_dtypes(self) -> list:
        """The torch dtype of each buffer (default: the device pool's store dtype)."""
        return [self.dtype] * len(self.descriptor.buffers())

    def get_size_per_token(self) -> int:
        """Bytes one token (or slot) takes across all layers and buffers."""
        return self.layout_descriptor(1).size_per_token_bytes()

    # -- bring-up ---------------------------------------------------------------------------
    def _reserve(self) -> None:
        """Budget, allocate, pre-fault and register through the one bring-up (sglang #38156)."""
        try:
            self.kv_buffer = self.init_kv_buffer()
        except BaseException:
            self.destroy()  # whatever came up goes down; leaked memory stays quarantined
            raise

    def init_kv_buffer(self):
        """Bring every buffer up (budget, allocate, pre-fault; when pinning, register them all
        as one transaction) and return the buffer (a list when there are several)."""
        framework_pin = self.pin_memory and _device_type(self.device_pool) in _FRAMEWORK_PINNED
        register = self.pin_memory and not framework_pin
        progressive = self.progressive and register and self.has_allocator and self.layout in PROGRESSIVE_LAYOUTS \
            and hasattr(self.allocator, "allocate_unfaulted")
        if self.progressive and not progressive:
            logger.info("%s: progressive registration needs a pinned pool with page-first layout; "
                        "registering all of it first", type(self).__name__)
        self._host = bring_up(
            self.pool_plan, dtypes=self.buffer_dtypes(),
            register=register and not progressive, prefault=not progressive,
            allocator=FrameworkPinnedAllocator() if framework_pin else self.allocator,
            runtime=self.runtime, machine=self._machine, host_memory_bytes=self._host_memory_bytes,
            lock=self._budget_lock, ledger=self.ledger, device=self.device,
        )  # a handle dropped by a Ctrl-C right after this returns is released by its finalizer
        self.registration = self._host.registration
        tensors = self._host.tensors
        if progressive:
            self._start_progressive(tensors, self._host.host_buffers)
        return tensors[0] if len(tensors) == 1 else list(tensors)

    @property
    def buffers(self) -> list:
        """The host buffers as a list (one per BufferSpec)."""
        if self.kv_buffer is None:
            raise RegistrationStateError(f"{type(self).__name__} was destroyed")
        return self.kv_buffer if isinstance(self.kv_buffer, list) else [self.kv_buffer]

    # -- pages ------------------------------------------------------------------------------
    def _alive(self) -> None:
        if self._destroyed:
            raise RegistrationStateError(f"{type(self).__name__} was destroyed: its memory is gone")

    def _allocator_or_raise(self) -> PageAllocator:
        self._alive()
        if self._pages is None:
            raise NoAllocatorError(
                f"{type(self).__name__} has no allocator of its own: it reuses the indices of "
                "the pool it shadows (SGLang's SWA pool for DeepSeek-V4 state)"
            )
        return self._pages

    @synchronized
    def alloc(self, need_size: int):
        """``need_size`` token slots (a multiple of page_size), or None when short."""
        return self._allocator_or_raise().alloc(need_size)

    @synchronized
    def free(self, indices) -> int:
        """Return slots; double frees and unaligned runs raise."""
        return self._allocator_or_raise().free(indices)

    @synchronized
    def clear(self) -> None:
        """Every page free again."""
        self._allocator_or_raise().clear()

    @synchronized
    def available_size(self) -> int:
        """Free token slots, exactly."""
        return self._allocator_or_raise().available_size()

    # -- transfers --------------------------------------------------------------------------
    def _host_view(self, stream: Stream, layer: int):
        tensor = self.buffers[stream.buffer]
        return layer_token_view(tensor, self.descriptor.family, self.layout, layer, stream.kv, self.page_size)

    def _check_layer(self, layer_id: int) -> int:
        """A pool-local layer id (``0..layer_num-1``: what SGLang's controller passes, also on a
        pipeline stage whose ``start_layer > 0``)."""
        if isinstance(layer_id, bool) or not isinstance(layer_id, int) or not 0 <= layer_id < self.layer_num:
            raise TransferError(f"layer_id {layer_id!r} out of range [0, {self.layer_num}) (pool-local ids)")
        return layer_id

    def _stream_list(self) -> list:
        streams = self.__dict__.get("_streams_cache")
        if streams is None:  # what streams() says is fixed for the pool's life
            streams = self._streams_cache = self.streams()
        return streams

    def _transfer(self, device_pool, host_indices, device_indices, layers, io_backend, *, to_host: bool) -> None:
        self._alive()
        if io_backend != "direct":  # the layout was checked when the pool was built
            check_backend(io_backend, self.layout, self.descriptor_class().supported())
        streams = self._stream_list()
        first = streams[0].device(device_pool, 0)
        device_slots = first.shape[0] * (self.page_size if streams[0].rows else 1)
        checked = self._index_memo.check(
            host_indices, device_indices, host_slots=self.size, device_slots=device_slots, page_size=self.page_size
        )
        device_tensors = tuple(stream.device(device_pool, layer) for layer in layers for stream in streams)
        key = (to_host, tuple(layers), id(device_pool))
        ready = checked.ready.get(key)
        if ready is not None and ready.matches(device_tensors):  # the same copies as last time
            if ready.prepared is not None:
                ready.prepared.run()
            return
        ready = self._build_transfer(checked, streams, layers, device_tensors, to_host=to_host)
        if ready is not None:
            checked.ready[key] = ready

    def _link(self, stream, layer: int, dv, *, to_host: bool) -> Link:
        """How one layer of one stream copies (block views, unit, steps, extents), cached per
        host view and device tensor - rebuilt when the device tensor moved or changed shape."""
        hv = self._views.get((stream.buffer, stream.kv, layer))
        if hv is None:  # views of our own buffers: made once, dropped by destroy()
            hv = self._views[(stream.buffer, stream.kv, layer)] = self._host_view(stream, layer)
        key = (stream.buffer, stream.kv, layer, to_host, id(dv))
        link = self._links.get(key)
        if link is None or not link.fits(dv):
            link = self._links[key] = make_link(hv, dv, self.page_size, rows=stream.rows, to_host=to_host)
        return link

    def _build_transfer(self, checked, streams, layers, device_tensors, *, to_host: bool):
        """Check and issue one transfer; return it prepared for reuse (None when part of it
        went through torch indexing, which is not reusable)."""
        hidx, didx, hpages, dpages = checked.hidx, checked.didx, checked.hpages, checked.dpages
        patterns = checked.patterns
        batch = Descriptors(self.copy_engine)  # every layer's page copies, issued together
        later: list = []  # torch-indexing copies: run only once every part passed its checks
        reusable = True
        tensors = iter(device_tensors)
        for layer in layers:
            for stream in streams:
                dv = next(tensors)
                link = self._link(stream, layer, dv, to_host=to_host)
                if stream.rows or (hpages is not None and dpages is not None and link.whole_pages):
                    if hpages is None or dpages is None:
                        raise TransferError(f"{type(self).__name__} moves whole pages: indices must be page-aligned runs")
                    dst_ids, src_ids = (hpages, dpages) if to_host else (dpages, hpages)
                    reusable &= link.copy(dst_ids, src_ids, batch, patterns, where=(self, layer, stream), later=later)
                else:
                    if didx.numel() and int(didx.max()) >= dv.shape[0]:
                        raise TransferError(
                            f"{self._where(layer, stream)}: device index {int(didx.max())} is past the end of "
                            f"that tensor ({dv.shape[0]} slots); nothing was copied"
                        )
                    later.append(lambda hv=link.host_view, dv=dv: copy_tokens(hv, hidx, dv, didx, self.page_size,
                                                                              to_host=to_host))
                    reusable = False
        for copy in later:
            copy()
        prepared = batch.prepare()
        if prepared is not None:
            prepared.run()
        if not reusable:
            return None
        return ReadyCopy(device_tensors, tuple(t.data_ptr() for t in device_tensors), prepared)

    def _where(self, layer: int, stream) -> str:
        """Names a copy in errors: layer (as SGLang numbers it), buffer, K or V."""
        return f"layer {layer}, buffer {stream.buffer}" + ("" if stream.kv is None else f", {'KV'[stream.kv]}")

    def load_to_device_per_layer(self, device_pool, host_indices, device_indices, layer_id, io_backend) -> None:
        """Copy the given slots of one layer host -> device."""
        layer = self._check_layer(layer_id)
        self._transfer(device_pool, host_indices, device_indices, [layer], io_backend, to_host=False)

    def backup_from_device_all_layer(self, device_pool, host_indices, device_indices, io_backend) -> None:
        """Copy the given slots of every layer device -> host."""
        self._transfer(device_pool, host_indices, device_indices, range(self.layer_num), io_backend, to_host=True)

    # -- teardown ---------------------------------------------------------------------------
    def destroy(self) -> None:
        """Release the registration, then free the memory; idempotent.

        If a range cannot be unregistered, `ReleaseError` is raised and the memory is kept
        (memory CUDA still has pinned is never freed). Once releasing begins a Ctrl-C is held
        until the pool is down (a half-done teardown would drop registrations from the books);
        before that - stopping a progressive registration, waiting for copies in flight - it
        interrupts with everything still held, and destroy() again finishes the job.
        """
        if self._progressive is not None:  # outside the lock: its thread takes the lock per call
            self._progressive.stop()
        with self.lock:
            if self._destroyed:
                return
            self._wait_for_device_copies()
            with deferred_interrupts():
                leak = None
                if self._progressive is not None:  # the calls registered so far, newest first
                    try:
                        self._progressive.release(self._host._books)
                    except ReleaseError as error:  # their memory is quarantined; the rest still goes
                        leak = error
                if self._host is not None:
                    try:
                        self._host.release()  # unregister, free, forget the budget (leaks: quarantined)
                    except ReleaseError:
                        if leak is None:
                            raise
                if leak is not None:
                    raise leak  # it names the ranges that stay registered
                self.kv_buffer = None
                self._index_memo.forget()
                self._views = {}
                self._links = {}
                self._destroyed = True

    def _wait_for_device_copies(self) -> None:
        """Transfers run asynchronously on CUDA streams: none may still use memory we unpin or free."""
        if _device_type(self.device_pool) == "cuda":
            self.copy_engine.synchronize()

    def __repr__(self) -> str:
        return (
            f"<{type(self).__name__} {self.layout} {self.page_num} pages x {self.page_size}, "
            f"{format_gb(self.pool_plan.total_bytes)}>"
        )

