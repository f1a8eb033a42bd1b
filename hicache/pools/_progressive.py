"""Progressive pools: which pages may be handed out while the rest still registers.

Owns the order chunks register in (by the page they start, across buffers and K/V halves, so
pages become usable front to back) and the count of ready pages: a page is ready when its bytes
lie in registered ranges in every buffer. Only page-first layouts gain (a page's bytes are one
run per buffer and K/V half); layer_first spreads every page over all layers, so a pool asked
to be progressive there registers all of it before returning. The registering itself is
hicache.effects' (`ProgressiveRegistration`).
"""

from __future__ import annotations

import bisect

from hicache.effects import BackgroundBringUp, Chunk
from hicache.pools._page_allocator import PageAllocator
from hicache.pools._views import buffer_symbols

PROGRESSIVE_LAYOUTS = ("page_first", "page_first_direct")


class PageReadiness:
    """Tracks registered byte ranges per buffer and how many leading pages are ready."""

    def __init__(self, pool, tensors) -> None:
        self.page_num = pool.page_num
        self.streams = []  # (buffer index, start offset of its page 0, page bytes)
        halves = 2 if "2" in buffer_symbols(pool.descriptor.family, pool.layout) else 1
        for index, spec in enumerate(pool.descriptor.buffers()):
            part = spec.nbytes // halves
            for half in range(halves):
                self.streams.append((index, half * part, part // self.page_num))
        self.covered: list[list[tuple[int, int]]] = [[] for _ in tensors]  # merged, sorted (start, end)
        self.ready = 0

    def _add(self, buffer: int, start: int, end: int) -> None:
        spans = self.covered[buffer]
        spans.append((start, end))
        spans.sort()
        merged = [spans[0]]
        for lo, hi in spans[1:]:
            if lo <= merged[-1][1]:
                merged[-1] = (merged[-1][0], max(merged[-1][1], hi))
            else:
                merged.append((lo, hi))
        self.covered[buffer] = merged

    def _inside(self, buffer: int, start: int, end: int) -> bool:
        spans = self.covered[buffer]
        at = bisect.bisect_right(spans, (start, float("inf"))) - 1
        return at >= 0 and spans[at][0] <= start and end <= spans[at][1]

    def registered(self, buffer: int, offset: int, size: int) -> range:
        """Record a registered chunk; return the pages that became ready."""
        self._add(buffer, offset, offset + size)
        first = self.ready
        while self.ready < self.page_num and all(
            self._inside(b, base + self.ready * pb, base + (self.ready + 1) * pb) for b, base, pb in self.streams
        ):
            self.ready += 1
        return range(first, self.ready)

    def page_position(self, buffer: int, offset: int) -> int:
        """The page a chunk starting at ``offset`` of ``buffer`` begins in (its stream's)."""
        for b, base, pb in reversed(self.streams):
            if b == buffer and offset >= base:
                return (offset - base) // pb
        return 0


def ordered_chunks(pool, tensors, readiness: PageReadiness) -> list[tuple[int, int, int, Chunk]]:
    """Every range of the pool's plan as ``(buffer, offset, size, Chunk)``, ordered by the page
    it starts in (then buffer, then offset): pages become ready front to back."""
    chunks = []
    for index, (buffer, tensor) in enumerate(zip(pool.pool_plan.buffers, tensors)):
        plan, base = buffer.plan, tensor.data_ptr()
        for item in plan.ranges:
            chunk = Chunk(f"{buffer.spec.name}", base + item.offset, item.size, plan.granularity_bytes, plan.limits)
            chunks.append((readiness.page_position(index, item.offset), index, item.offset, item.size, chunk))
    chunks.sort(key=lambda c: (c[0], c[1], c[2]))
    return [(index, offset, size, chunk) for _, index, offset, size, chunk in chunks]


class ProgressiveMixin:
    """Mixed into `HostKVCache`: the progressive start, `ready_pages`, `wait_ready`."""

    def _start_progressive(self, tensors, host_buffers) -> None:
        """Every page starts handed out (to the pool itself) and is freed into the allocator
        as it becomes ready; the first page of every buffer is registered before returning.
        The memory is faulted in the background in the same order, each chunk just before it
        registers."""
        self._pages = PageAllocator(self.page_num, self.page_size)
        self._pages.alloc(self.page_num * self.page_size)
        self._readiness = PageReadiness(self, tensors)
        chunks = ordered_chunks(self, tensors, self._readiness)
        head = sum(1 for index, offset, _, _ in chunks if self._readiness.page_position(index, offset) == 0)

        def on_chunk(position: int, done: int, size: int) -> None:
            index, offset, _, _ = chunks[position]
            with self.lock:
                ready = self._readiness.registered(index, offset + done, size)
                if len(ready) and not self._destroyed:
                    self._pages.free(self._slots(ready))

        self._progressive = BackgroundBringUp(  # stored first: a failing head is undone by destroy()
            [chunk for *_, chunk in chunks], [(index, offset, size) for index, offset, size, _ in chunks],
            host_buffers, runtime=self.runtime, ledger=self.ledger, on_chunk=on_chunk,
            max_stall_s=self.max_stall_s, threads=getattr(self.allocator, "prefault_threads", None),
        )
        self._progressive.start(max(head, 1))

    def _slots(self, pages: range):
        import torch

        first = pages.start * self.page_size
        return torch.arange(first, pages.stop * self.page_size, dtype=torch.int64)

    def ready_pages(self) -> int:
        """Pages whose bytes are registered in every buffer (all of them unless progressive)."""
        if self._readiness is None:
            return self.page_num
        with self.lock:
            return self._readiness.ready

    def wait_ready(self, timeout: float | None = None) -> bool:
        """Block until every page is registered (True), or ``timeout`` seconds (False); raise
        the `ApplyError` that stopped a background registration."""
        if self._progressive is None:
            return True
        return self._progressive.wait(timeout)
