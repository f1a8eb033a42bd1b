"""Progressive pools: which pages may be handed out while the rest still registers.

Owns the order chunks register in (by the page they start, across buffers and K/V halves, so
pages become usable front to back) and the count of ready pages: a page is ready when its bytes
lie in registered ranges in every buffer. Only page-first layouts gain (a page's bytes are one
run per buffer and K/V half); layer_first spreads every page over all layers, so a pool asked
to be progressive there registers all of it before returning. The registering, faulting and
teardown are hicache.effects' (`bring_up(mode=Progressive(...))` and its handle). `ProgressivePages`
is the part over the geometry, plan and lock it is given; `ProgressiveMixin` is its calls on the pool.
"""

from __future__ import annotations

import attrs

from hicache.effects import Progressive
from hicache.plan import IntervalSet
from hicache.pools._page_allocator import PageAllocator
from hicache.pools._views import buffer_symbols

PROGRESSIVE_LAYOUTS = ("page_first", "page_first_direct")


def not_progressive_because(geometry, *, register: bool, has_allocator: bool, maps_unfaulted: bool) -> str | None:
    """Why a pool asked to serve while it registers must register all of itself first; None
    when it can serve from its first ready page."""
    if not register:
        return "hicache does not pin it (pin_memory=False, or the framework pins it)"
    if geometry.layout not in PROGRESSIVE_LAYOUTS:
        return f"layout {geometry.layout} spreads every page over all layers"
    if not has_allocator or geometry.form.sizing == "anchor":
        # the anchor hands out the slots by its own readiness: a slot it has ready must be one
        # this pool can copy at once, not once this pool's own registration catches up
        return "its slots are another pool's (its anchor's), handed out by that pool's readiness"
    if not maps_unfaulted:
        return "its allocator faults its memory in itself"
    if geometry.buffer_page_num != geometry.page_num:
        return f"its buffers hold {geometry.buffer_page_num} pages, not the {geometry.page_num} it hands out"
    return None


class PageReadiness:
    """Tracks registered byte ranges per buffer and how many leading pages are ready."""

    def __init__(self, geometry) -> None:
        """From the pool's `PoolGeometry`: its pages, and each buffer's K/V halves."""
        self.page_num = geometry.page_num
        self.streams = []  # (buffer index, start offset of its page 0, page bytes)
        halves = 2 if "2" in buffer_symbols(geometry.family, geometry.layout) else 1
        for index, spec in enumerate(geometry.descriptor.buffers()):
            part = spec.nbytes // halves
            for half in range(halves):
                self.streams.append((index, half * part, part // self.page_num))
        self.covered = [IntervalSet() for _ in geometry.descriptor.buffers()]  # registered bytes per buffer
        self.ready = 0

    def registered(self, buffer: int, offset: int, size: int) -> range:
        """Record a registered chunk; return the pages that became ready."""
        self.covered[buffer].add(offset, size, merge=True)
        first = self.ready
        while self.ready < self.page_num and all(
            self.covered[b].covers(base + self.ready * pb, pb) for b, base, pb in self.streams
        ):
            self.ready += 1
        return range(first, self.ready)

    def stream_at(self, buffer: int, offset: int, alignment: int = 1) -> tuple[int, int]:
        """``(start of page 0, page bytes)`` of the stream (buffer, K/V half) a part starting
        at ``offset`` serves: the last one starting at or before it, once starts are rounded
        down to ``alignment`` as the cuts were."""
        for b, start, page_bytes in reversed(self.streams):
            if b == buffer and start // alignment * alignment <= offset:
                return start, page_bytes
        raise ValueError(f"no stream of buffer {buffer} at offset {offset}")


@attrs.frozen
class Part:
    """A chunk of a progressive pool: one range of the plan, or its piece in one K/V half."""

    buffer: int
    offset: int
    size: int
    stream_start: int  # where page 0 of the half it serves starts (may lie past ``offset``)
    page_bytes: int

    def page_reached(self, done: int) -> int:
        """The page of its half that registering from ``done`` on reaches first."""
        return max(0, self.offset + done - self.stream_start) // self.page_bytes


def ordered_parts(pool_plan, readiness: PageReadiness) -> list[Part]:
    """Every range of the pool's plan (``pool_plan``), cut where a K/V half starts (rounded down to the plan's
    boundary alignment, so each part is still a legal range), ordered by the page each part
    starts at (then buffer, then offset): a single 64 GiB range holding both halves must not
    register all of K before V's first page."""
    parts = []
    for index, buffer in enumerate(pool_plan.buffers):
        plan = buffer.plan
        alignment = plan.alignment_bytes or plan.granularity_bytes or 1
        starts = [start for b, start, _ in readiness.streams if b == index and start > 0]
        for item in plan.ranges:
            end = item.offset + item.size
            cuts = sorted({cut for cut in (start // alignment * alignment for start in starts) if item.offset < cut < end})
            edges = [item.offset, *cuts, end]
            for lo, hi in zip(edges, edges[1:]):
                stream_start, page_bytes = readiness.stream_at(index, lo, alignment)
                parts.append(Part(index, lo, hi - lo, stream_start, page_bytes))
    parts.sort(key=lambda part: (part.page_reached(0), part.buffer, part.offset))
    return parts


class ProgressivePages:
    """A part of a progressive pool (issue #55 item 1): which of its pages may be handed out while
    the rest registers, over what it is given - the pool's ``geometry``, its plan
    (``pool_plan``: the chunks, cut and ordered by `ordered_parts`), ``max_stall_s``, the pool's
    ``lock`` (its slot calls take it too) and SGLang's range records (``ranges``). ``pages`` is
    the pool's slot allocator: every page starts handed out (to the pool itself) and is freed
    into it as it becomes ready."""

    def __init__(self, geometry, pool_plan, max_stall_s, lock, ranges) -> None:
        self.geometry, self.pool_plan, self.max_stall_s, self.lock, self.ranges = (
            geometry, pool_plan, max_stall_s, lock, ranges)
        self.pages = PageAllocator(geometry.page_num, geometry.logical_page_size)
        self.pages.alloc(geometry.page_num * geometry.logical_page_size)
        self.readiness = PageReadiness(geometry)
        self.closed = False  # the pool was destroyed: no page goes back into its allocator

    def mode(self) -> Progressive:
        """The bring-up's mode: calls go by the page they reach (K and V halves and all buffers
        together); effects faults the memory in the same order, each call waiting for its own
        bytes, and the constructor returns once the first page is registered in every buffer."""
        self.ranges.expect_chunks()  # SGLang's records take the chunks as they register
        parts = ordered_parts(self.pool_plan, self.readiness)

        def on_chunk(position: int, done: int, size: int) -> None:
            part = parts[position]
            with self.lock:
                self.ranges.note(part.buffer, part.offset + done, size)
                ready = self.readiness.registered(part.buffer, part.offset + done, size)
                if len(ready) and not self.closed:
                    self.pages.free(self._slots(ready))

        return Progressive(
            order=[(part.buffer, part.offset, part.size) for part in parts],
            key=lambda position, done: parts[position].page_reached(done),
            on_chunk=on_chunk, ready=lambda: self.readiness.ready > 0, max_stall_s=self.max_stall_s,
        )

    def _slots(self, pages: range):
        import torch

        first = pages.start * self.geometry.logical_page_size
        return torch.arange(first, pages.stop * self.geometry.logical_page_size, dtype=torch.int64)

    def ready_pages(self) -> int:
        with self.lock:
            return self.readiness.ready

    def ready_slots(self) -> int:
        """The host slots a transfer may touch now: those of the ready pages (they grow only,
        so an unlocked read may refuse a page that just became ready, never admit one that is not)."""
        readiness = self.readiness
        ready = readiness.ready
        size = self.geometry.size
        return size if ready >= readiness.page_num else ready * (size // readiness.page_num)

    def close(self) -> None:
        with self.lock:
            self.closed = True


class ProgressiveMixin:
    """`ready_pages` and `wait_ready` on a `HostKVCache`: its `ProgressivePages` part's (None: not
    progressive, every page ready once built) and its bring-up handle's."""

    #: the pool's state these calls read (tests/test_import_rules.py): the part and the handle
    NEEDS = ("_progress", "_host")
    #: whether the slots it copies are handed out by its own allocator, not by another pool's by
    #: that pool's readiness (`not_progressive_because`; DeepSeek-V4's side pools say no)
    own_slots = True

    def ready_pages(self) -> int:
        """Pages whose bytes are registered in every buffer (all of them unless progressive)."""
        return self.geometry.page_num if self._progress is None else self._progress.ready_pages()

    def _registered_now(self) -> tuple:
        """The ``(ptr, size)`` ranges this pool's handle holds registered now (none once released)."""
        host = self._host
        return () if host is None else host.registered_ranges()

    def wait_ready(self, timeout: float | None = None) -> bool:
        """Block until every page is registered (True), or ``timeout`` seconds (False); raise
        the `ApplyError` that stopped a background registration."""
        if self._host is None:
            return True
        return self._host.wait(timeout)
