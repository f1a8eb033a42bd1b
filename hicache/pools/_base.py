"""`HostKVCache`: the base of every host KV pool - its lifetime, allocation and pages.

Owns a pool's lifetime, in the order `_build` reads: adopt the `PoolGeometry` its family's
form made (`_geometry`, `_forms`; never changed after), settle its settings and plan, bring it
up through `hicache.effects.bring_up` (one handle: budget, memory, registration), then the copy
lanes (`_device_copies`) and pages; `destroy()` is stop, wait for copies, release. Families
say only what their buffers and device views look like; the base never asks which form it is.
"""

from __future__ import annotations

import abc
import logging
import threading
from functools import wraps

import attrs

from hicache.effects import (
    BufferRequest,
    CopyEngine,
    FrameworkPinnedAllocator,
    HostAllocator,
    Progressive,
    Report,
    bring_up,
    pool_settings,
    probe_limits,
    resolve_numa_node,
)
from hicache.errors import LayoutError, NoAllocatorError, RegistrationStateError
from hicache.plan import DEFAULT_HUGEPAGE_BYTES, HUGETLBFS_MODES, format_gb, plan_pool
from hicache.plan.settings import check_hugepages
from hicache.pools._allocator import pool_allocator
from hicache.pools._page_allocator import PageAllocator
from hicache.pools._progressive import ProgressiveMixin, ProgressivePages, not_progressive_because
from hicache.pools._range_records import RangeRecords
from hicache.pools._device_copies import CopiesInFlight, DeviceCopies, DeviceCopiesMixin, Stream, host_view
from hicache.pools._forms import DEVICE_POOL
from hicache.pools._geometry import PoolGeometry, make_geometry
from hicache.pools._sketch import adoption, sketch
from hicache.pools._options import check_dummy, given, split_keywords, under_server_chunk
from hicache.pools._transfer import Transfers
from hicache.pools._storage import L3Pages, StoragePagesMixin, listed
from hicache.pools._zero_copy import PagePointers
from hicache.pools._slots import SlotsMixin

logger = logging.getLogger(__name__)

_FRAMEWORK_PINNED = ("npu", "musa")  # devices whose framework pins host memory itself


def synchronized(func):
    """Run the method holding ``self.lock`` (an RLock), as SGLang's decorator does."""

    @wraps(func)
    def wrapper(self, *args, **kwargs):
        with self.lock:
            return func(self, *args, **kwargs)

    return wrapper


def _device_type(device_pool) -> str:
    device = getattr(device_pool, "device", "cpu")
    return str(device).split(":")[0]


class HostKVCache(SlotsMixin, DeviceCopiesMixin, ProgressiveMixin, StoragePagesMixin, abc.ABC):
    """Abstract host KV pool with SGLang's constructor and interface.

    ``host_size`` is decimal GB per rank (SGLang's ``--hicache-size``; 0 to size by
    ``host_to_device_ratio``). SGLang's defaults: ``pin_memory=True``, ``device="cpu"``,
    ``allocator_type="default"`` (any storage back end's name, ``None`` included: names
    without an allocator of their own get the default one), ``pool_label="kv"``. Layer ids are
    pool-local (``0..layer_num-1``), as SGLang's controller passes them. Beyond SGLang's
    signature (``page_num`` sizes like an anchor pool instead), two keyword-only values, one door
    each: ``options`` (a `HostPoolOptions`: ``strict_allocator``, ``allocator_fallback``,
    ``numa_node``, ``progressive`` - `alloc` then hands out ready pages only, see `ready_pages`,
    `wait_ready`; page-first layouts only - ``max_stall_s``, ``hugepages``; SGLang's call sites
    pass none: every default) and ``host`` (a `hicache.effects.HostSetup`: the ``runtime``,
    default cuda-python or `hicache.testing.fake_cuda`'s; ``limits``, default `probe_limits()`;
    the ``machine`` the budget reads, default `probe_machine()`; ``host_memory_bytes`` instead of
    its available memory; the budget ``lock``, default the host-wide one; the ``ledger``; the
    ``copy_engine``, default one with the host copy mode the probes resolve).
    Bring-up and teardown go through `hicache.effects.bring_up`.
    """

    has_allocator = True
    # SGLang 0.5.23's class defaults its callers read (pool_host/base.py): no decode context
    # parallelism, no shared compacting layout, no page envelope, no storage format of its own
    dcp_size = 1
    dcp_rank = 0
    shared_allocation_domain = None
    stores_page_envelope = False
    storage_format_tag = None
    #: the `HostSetup` a pool of this class takes where its call names no ``host=`` (None: the
    #: process's own pieces); a class made by `hicache.pools.with_host` sets it
    default_host = None

    def __init__(self, device_pool, host_to_device_ratio: float, host_size: float, page_size: int, layout: str,
                 pin_memory: bool = True, device: str = "cpu", allocator_type: str | None = "default", *,
                 page_num: int | None = None, end_layer: int | None = None, pool_label: str = "kv",
                 options=None, host=None) -> None:
        """SGLang's base signature: the older form (a device pool first); the families' other
        forms build through `_build` with their own shapes (`_forms.FORMS`). ``page_num`` sizes
        like an anchor pool (DSA's beside its anchor); ``end_layer`` as SGLang's caller passes it."""
        sizing, options = split_keywords(type(self).__name__, dict(
            given(page_num=page_num, end_layer=end_layer), pin_memory=pin_memory, device=device,
            allocator_type=allocator_type, pool_label=pool_label, options=options, host=host),
            host_to_device_ratio=host_to_device_ratio, host_size=host_size, page_size=page_size)
        self._build(DEVICE_POOL, type(self).shape_class(device_pool), sizing, layout, options)

    @classmethod
    def geometry_of(cls, *args, **kwargs) -> PoolGeometry:
        """The `PoolGeometry` the same constructor call would adopt - its form, facts, size, the
        buffers' descriptor and the family's fields - made with no memory, budget or registration:
        what an engine or a capacity check reads before `from_geometry` brings it up."""
        return sketch(cls, args, kwargs)

    @classmethod
    def from_geometry(cls, geometry: PoolGeometry, /, *, pin_memory: bool = True, device: str = "cpu",
                      allocator_type: str | None = "default", pool_label: str = "kv", is_dummy: bool | None = None,
                      options=None, host=None):
        """A pool that adopts ``geometry`` whole - this class's (`geometry_of`, or a pool's
        ``geometry``) - and brings it up with SGLang's options, ``options`` and ``host`` as the
        constructor takes them (``is_dummy``: None, as its form says); the geometry is checked
        against the class, its server's io backend and the options before any memory."""
        settings, host_setup = adoption(cls, geometry, dict(
            pin_memory=pin_memory, device=device, allocator_type=allocator_type, pool_label=pool_label,
            is_dummy=is_dummy, options=options, host=host))
        pool = cls.__new__(cls)
        pool._come_up(geometry, settings, host_setup)
        return pool

    def _build(self, form, shape, sizing, layout: str, options) -> None:
        """The one constructor body: the geometry, made outside the pool from ``shape`` (the
        family's builder over its device view), then brought up (`_come_up`)."""
        name = type(self).__name__
        check_dummy(name, form, options)
        # the host's pieces: runtime, limits, budget lock, server, ... (host=, else the class's)
        host_setup = options.host_setup(name, type(self).default_host)
        geometry = make_geometry(name, shape, form, sizing, layout, pool_label=options.pool_label,
                                 server=host_setup.server)
        self._come_up(geometry, options, host_setup)

    def _come_up(self, geometry: PoolGeometry, options, host_setup) -> None:
        """``geometry`` adopted whole, never changed after; then settings, plan, allocator, the
        bring-up, copy lanes and pages."""
        name = type(self).__name__
        self.can_use_write_back_jit = False  # SGLang's staged write-back JIT kernel is CUDA-only
        self.is_dummy = bool(options.is_dummy)
        self.pin_memory, self.device, self.pool_label = options.pin_memory, options.device, options.pool_label
        self.host_setup = host_setup
        self.runtime = self.host_setup.runtime
        self.ledger = self.host_setup.ledger  # None: the process ledger (what CUDA holds for this process)
        self.lock = threading.RLock()
        self._in_flight = CopiesInFlight(name)  # transfers running: destroy() waits for them
        self.registration = None
        self.kv_buffer = None
        self._destroyed = False
        self._host = None  # the effects.HostPools handle: memory, registration, budget entry
        self._pages = None
        self._progress = None  # a progressive pool's `ProgressivePages`
        self._ranges = RangeRecords()  # SGLang's record of what is registered, on each buffer
        self._transfers = None
        self._adopt(geometry)
        settings = options.settings
        self._settings(self.host_setup.limits, settings.progressive, settings.hugepages, settings.max_stall_s,
                       settings.numa_node)
        self.pool_plan = plan_pool(self.descriptor, self._limits)
        self.allocator = pool_allocator(  # the storage back end's, with this pool's NUMA node and pages
            options.allocator_type, fallback=settings.allocator_fallback or "default", strict=settings.strict_allocator,
            sglangs=geometry.form.sglang_allocators, server=self.host_setup.server, numa_node=self.numa_node,
            hugepages=self.hugepages, limits=self._limits)
        if self.host_setup.copy_engine is None:
            self.host_setup = attrs.evolve(self.host_setup, copy_engine=CopyEngine())
        self.copy_engine = self.host_setup.copy_engine
        self._l3 = L3Pages(name, geometry, self.copy_engine, self._alive)  # the parts over the buffers
        self._pointers = PagePointers(name, geometry, self._alive)
        if self.is_dummy:  # SGLang's allocator-only pool: indices, no memory
            self._pages = PageAllocator(self.page_num, self.logical_page_size)
            self._copies = DeviceCopies(name, geometry, None, self._in_flight, self._alive)
            return
        self._reserve()
        try:
            self._transfers = Transfers(self._host_view, self.geometry.streams, page_size=self.page_size,
                                        host_slots=self.size, copy_engine=self.copy_engine, name=name,
                                        ready_slots=None if self._progress is None else self._progress.ready_slots,
                                        registered=self._registered_now)
            self._copies = DeviceCopies(name, geometry, self._transfers, self._in_flight, self._alive)
            self._transfers.warm(geometry.device)  # the gather's kernel compiles now, not at a transfer
            if self._pages is None and self.has_allocator:
                self._pages = PageAllocator(self.page_num, self.logical_page_size)
        except BaseException:  # never leave a half-built pool holding pinned memory
            self.destroy()
            raise

    @property
    def metrics_name(self) -> str:
        """The ``pool`` label of this pool's metrics (`hicache.metrics`): class and pool label."""
        return f"{type(self).__name__}:{self.pool_label}"

    @property
    def sglang_form(self) -> str:
        """Whose constructor built the pool: "0.5.23" or "older" (SGLang before 0.5.23)."""
        return self.geometry.form.sglang

    # -- the geometry, adopted once (nothing below writes these fields again) ---------------
    def _adopt(self, geometry) -> None:
        """Everything the pool reports of what it is: the device view, layout, facts, size,
        descriptor and the family's SGLang-facing fields (`Shape.fields`)."""
        facts = geometry.facts
        self.geometry, self.device_pool, self.layout = geometry, geometry.device, geometry.layout
        self.dtype, self.layer_num, self.target_layer_num = facts.dtype, facts.layer_num, facts.target_layer_num
        self.start_layer, self.end_layer, self.page_size = facts.start_layer, facts.end_layer, facts.page_size
        self.dcp_size, self.dcp_rank = facts.dcp_size, facts.dcp_rank
        self.device_capacity_tokens = facts.device_capacity_tokens
        self.size_per_token, self.page_num, self.size = geometry.size_per_token, geometry.page_num, geometry.size
        self.descriptor = geometry.descriptor
        for name, value in geometry.fields.items():
            setattr(self, name, value)

    def _settings(self, limits, progressive, hugepages, max_stall_s, numa_node) -> None:
        """Progressive, page size (keywords beat HICACHE_*), limits, stall budget, NUMA node."""
        settings = pool_settings() if progressive is None or hugepages is None else None  # HICACHE_*
        self.progressive = settings.progressive if progressive is None else bool(progressive)
        self.hugepages = settings.hugepages if hugepages is None else hugepages
        check_hugepages(LayoutError, type(self).__name__, self.hugepages)
        self._limits = limits if limits is not None else probe_limits()
        if limits is None and self.geometry.form.server_chunk:
            self._limits = under_server_chunk(self._limits, self.host_setup.server)
        if self.hugepages in HUGETLBFS_MODES and self._limits.hugepage_bytes is None:
            # hugetlbfs: boundaries on the huge page, so no two calls share one (vLLM PR #51081);
            # the base is then hugepage aligned (or, if "prefer" falls back, page aligned: finer)
            self._limits = attrs.evolve(self._limits, hugepage_bytes=DEFAULT_HUGEPAGE_BYTES, base_alignment_bytes=max(
                self._limits.base_alignment_bytes, DEFAULT_HUGEPAGE_BYTES))
        self.max_stall_s = Progressive(max_stall_s=max_stall_s).max_stall_s  # checked before any memory
        self.numa_node, note = resolve_numa_node(numa_node)
        if note:
            logger.info("%s: %s", type(self).__name__, note)

    # -- what the family says, through its shape (read from the geometry, never recomputed) ----
    #: the family's `Shape` (its pure builder); the older form builds it from the device pool
    shape_class: type = None

    @classmethod
    def descriptor_class(cls):
        """The hicache.plan layout descriptor class of this family."""
        return cls.shape_class.descriptor_class

    def layout_descriptor(self, page_num: int):
        """This pool's layout descriptor for ``page_num`` pages."""
        return self.geometry.shape.descriptor(self.layout, self.geometry.facts, page_num)

    def streams(self) -> list[Stream]:
        """The copy streams between host buffers and the device pool."""
        return list(self.geometry.streams)

    def buffer_dtypes(self) -> list:
        """The torch dtype of each buffer."""
        return list(self.geometry.buffer_dtypes)

    def get_size_per_token(self) -> int:
        """Bytes one token (or slot) takes across all layers and buffers."""
        return self.geometry.token_bytes

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
        as one transaction, or progressively) and return the buffer (a list when several)."""
        framework_pin = self.pin_memory and _device_type(self.device_pool) in _FRAMEWORK_PINNED
        register = self.pin_memory and not framework_pin
        allocator = FrameworkPinnedAllocator() if framework_pin else self.allocator
        refusal = self.progressive and not_progressive_because(
            self.geometry, register=register, has_allocator=self.has_allocator and self.own_slots,
            maps_unfaulted=isinstance(allocator, HostAllocator) and allocator.can_map_unfaulted)
        if refusal:
            logger.info("%s: registering all of it before it serves, not progressively: %s", type(self).__name__,
                        refusal)
        if self.progressive and not refusal:  # its pages come free as they register (`ProgressivePages`)
            self._progress = ProgressivePages(self.geometry, self.pool_plan, self.max_stall_s, self.lock, self._ranges)
            self._pages = self._progress.pages
        mode = None if self._progress is None else self._progress.mode()
        report = Report(self.metrics_name, page_num=self.page_num, ready_pages=self.ready_pages,
                        numa_node=self.numa_node)  # the metrics see it from the bring-up itself
        # one admission: hicache's host-wide budget, or the server's scope where one is in force
        # (its HostSetup's server: SGLang's host_memory_budget_scope books it instead)
        requests = BufferRequest.of_pool(self.pool_plan, self.geometry.buffer_dtypes, register=register)
        host = attrs.evolve(self.host_setup, allocator=allocator, device=self.device)  # the pool's own allocator
        self._host = bring_up(requests, mode=mode, host=host, report=report)
        # a handle dropped by a Ctrl-C right after this returns is released by its finalizer
        self.registration = self._host.registration
        tensors = self._host.tensors
        self._record_ranges(tensors)
        self.fd = getattr(self.allocator, "fd", None)  # SGLang's shm allocator's descriptor
        return tensors[0] if len(tensors) == 1 else list(tensors)

    def _record_ranges(self, tensors) -> None:
        """Each buffer carries SGLang's record of what is registered in it (`RangeRecords`);
        progressive pools extend it as chunks register (`ProgressivePages.mode`)."""
        with self.lock:  # a progressive pool's background chunks note theirs under it
            self._ranges.attach(tensors, self._host.registered_ranges)

    @property
    def buffers(self) -> list:
        """The host buffers as a list (one per BufferSpec)."""
        return listed(self.kv_buffer, type(self).__name__)

    # -- pages ------------------------------------------------------------------------------
    def _alive(self) -> None:
        if self._destroyed:
            raise RegistrationStateError(f"{type(self).__name__} was destroyed: its memory is gone")
        host = self._host
        if host is not None and host.state == "leaked":
            raise RegistrationStateError(
                f"{type(self).__name__}.destroy() failed: {len(host.leaked)} range(s) stay registered, so the "
                "pool refuses alloc, free, transfers and page access; call destroy() again to retry"
            )

    def _allocator_or_raise(self) -> PageAllocator:
        self._alive()
        if self._pages is None:
            raise NoAllocatorError(f"{type(self).__name__} has no allocator of its own: it reuses the indices of "
                                   "the pool it shadows (SGLang's SWA pool for DeepSeek-V4 state)")
        return self._pages

    _slot_allocator = _allocator_or_raise  # SGLang's slot calls (`SlotsMixin`) check the pool first

    @property
    def logical_size(self) -> int:
        """Slots the radix cache and controllers see: ``dcp_size`` of them share a row."""
        return self.size * self.dcp_size

    @property
    def logical_page_size(self) -> int:
        """The page in that same logical space (the widened DCP page)."""
        return self.page_size * self.dcp_size

    # -- teardown ---------------------------------------------------------------------------
    def destroy(self) -> None:
        """Stop the background registration, wait for copies in flight, then release: unregister,
        free the memory, give the budget back; idempotent.

        If a range cannot be unregistered, `ReleaseError` is raised, the memory is kept (memory
        CUDA still has pinned is never freed) and the pool refuses use from then on; calling
        destroy() again retries. Stopping and waiting are interruptible and leave everything
        held for a second destroy(); once releasing begins a Ctrl-C is held until it is done.
        """
        host = self._host
        if host is not None:  # outside the lock: the background thread takes it per call
            host.stop()
        with self.lock:
            if self._destroyed:
                return
            self._l3.close()  # the page path checks the pool's state again from here on
            self._in_flight.drain()  # no launch may follow the release below
            self._wait_for_device_copies()
            try:
                if host is not None:  # one teardown, whatever the mode; a leak keeps the memory (and the views)
                    host.release(before_free=self._drop_views)
            finally:
                if host is None or host.state == "released":
                    self._drop_views()
                    self._destroyed = True
                    if self._progress is not None:  # no page goes back into a destroyed pool's allocator
                        self._progress.close()

    def _drop_views(self) -> None:
        """Let go of this pool's views of its memory (idempotent): a kept one leaves the unmap to
        its own death and one munmap, not the release's parallel pieces (issue #53)."""
        if self.kv_buffer is not None:
            self._ranges.clear(self.buffers)
            self.kv_buffer = None
        if self._transfers is not None:
            self._transfers.forget()

    def _host_view(self, stream: Stream, layer: int):
        """The host tensor one copy lane reads or writes for ``layer`` (a family may override it)."""
        return host_view(self.buffers, self.geometry, stream, layer)

    def _wait_for_device_copies(self) -> None:
        """Transfers run asynchronously on CUDA streams: none may still use memory we unpin or free."""
        if _device_type(self.device_pool) == "cuda":
            self.copy_engine.synchronize()

    def __repr__(self) -> str:
        return (
            f"<{type(self).__name__} {self.layout} {self.page_num} pages x {self.page_size}, "
            f"{format_gb(self.pool_plan.total_bytes)}>"
        )

