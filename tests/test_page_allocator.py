"""The page allocator against a set model, and under threads."""

from __future__ import annotations

import threading

import pytest
from machine import ROOMY
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from hicache.plan import Limits
from hicache.pools import MHATokenToKVPoolHost, PageAllocator
from hicache.testing import MHADevicePool

torch = pytest.importorskip("torch")

PAGES, PAGE = 12, 4


class AllocatorMachine(RuleBasedStateMachine):
    """alloc / free / clear / double free checked against a set of free pages."""

    def __init__(self):
        super().__init__()
        self.allocator = PageAllocator(PAGES, PAGE)
        self.free_pages = set(range(PAGES))
        self.held: list = []

    @rule(pages=st.integers(0, PAGES + 2))
    def alloc(self, pages):
        slots = self.allocator.alloc(pages * PAGE)
        if pages > len(self.free_pages):
            assert slots is None
            return
        assert slots is not None and slots.numel() == pages * PAGE
        got = set((slots[::PAGE] // PAGE).tolist())
        assert len(got) == pages and got <= self.free_pages  # never handed out twice
        assert torch.equal(slots.view(-1, PAGE), slots.view(-1, PAGE)[:, :1] + torch.arange(PAGE))
        self.free_pages -= got
        if pages:
            self.held.append(slots)

    @precondition(lambda self: self.held)
    @rule(data=st.data())
    def free(self, data):
        slots = self.held.pop(data.draw(st.integers(0, len(self.held) - 1)))
        self.allocator.free(slots)
        self.free_pages |= set((slots[::PAGE] // PAGE).tolist())
        with pytest.raises(RuntimeError, match="double free"):
            self.allocator.free(slots)

    @rule()
    def clear(self):
        self.allocator.clear()
        self.free_pages = set(range(PAGES))
        self.held = []

    @invariant()
    def available_is_exact(self):
        assert self.allocator.available_size() == len(self.free_pages) * PAGE


TestAllocatorMachine = AllocatorMachine.TestCase


def test_threads_never_share_a_slot():
    """Several threads allocating and freeing at once never hold the same slot."""
    device = MHADevicePool(size=512, layer_num=1, head_num=1, head_dim=4, page_size=PAGE)
    pool = MHATokenToKVPoolHost(device, 1.0, 0, PAGE, "page_first", False, "cpu", limits=Limits(chunk_limit_bytes=2**20), machine=ROOMY)
    owner = torch.full((pool.size,), -1, dtype=torch.int64)
    errors = []
    guard = threading.Lock()

    def worker(me: int):
        generator = torch.Generator().manual_seed(me)
        try:
            for _ in range(300):
                slots = pool.alloc(int(torch.randint(1, 4, (1,), generator=generator)) * PAGE)
                if slots is None:
                    continue
                with guard:
                    if (owner[slots] != -1).any():
                        errors.append(f"slot handed out twice: {slots.tolist()}")
                    owner[slots] = me
                with guard:
                    owner[slots] = -1
                pool.free(slots)
        except Exception as error:  # pragma: no cover - reported below
            errors.append(repr(error))

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []
    assert pool.available_size() == pool.size
    pool.destroy()
