"""The page allocator against a set model, and under threads."""

from __future__ import annotations

import re
import threading

import pytest
from machine import ROOMY
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from hicache.errors import PlanError
from hicache.plan import Limits
from hicache.pools import MHATokenToKVPoolHost, PageAllocator
from hicache.testing import MHADevicePool
from hicache.effects import HostSetup

torch = pytest.importorskip("torch")

PAGES, PAGE = 40, 4


def _pagestack_built() -> bool:
    from hicache.pools import _page_allocator

    return _page_allocator._native is not None


NATIVE = [False] + ([True] if _pagestack_built() else [])


@pytest.mark.parametrize("args, kwargs, refusal", [
    ((40, 0), {}, "PageAllocator.page_size must be positive, got 0"),
    ((40, -4), {}, "PageAllocator.page_size must be positive, got -4"),
    ((40, 4.0), {}, "PageAllocator.page_size must be an integer, got 4.0"),
    ((40, True), {}, "PageAllocator.page_size must be an integer, got True"),
    ((-1, 4), {}, "PageAllocator.page_num must be >= 0, got -1"),
    (("40", 4), {}, "PageAllocator.page_num must be an integer, got '40'"),
    ((2**62, 4), {}, "PageAllocator.page_num must be <= 2305843009213693951"),
    ((40, 4), {"native": "no"}, "PageAllocator.native must be True or False, got 'no'"),
])
def test_a_bad_page_count_size_or_switch_is_refused_by_name(args, kwargs, refusal):
    """A page size of 0 (it divided by zero at the first alloc or free), a negative or float count,
    slots past int64's indices, a string for ``native``: a PlanError naming the field and the value."""
    with pytest.raises(PlanError, match=re.escape(refusal)):
        PageAllocator(*args, **kwargs)


def test_numpy_integers_and_no_pages_are_taken():
    """numpy integers (what SGLang's sizes often are) and an allocator of no pages are valid."""
    np = pytest.importorskip("numpy")
    allocator = PageAllocator(np.int64(8), np.int32(4))
    assert (allocator.page_num, allocator.page_size, allocator.available_size()) == (8, 4, 32)
    assert type(allocator.page_num) is int and PageAllocator(0, 4).alloc(4) is None


@pytest.mark.skipif(not _pagestack_built(), reason="hicache.pools._pagestack was not built (no C compiler)")
@pytest.mark.parametrize("name, args", [("alloc", (0,) * 5), ("free", (0,) * 8), ("free", (0,) * 10)])
def test_the_page_stack_refuses_a_call_of_the_wrong_arity(name, args):
    """The page stack's two calls take exactly their 6 and 9 integers: another count is a
    TypeError naming both counts, before any address is read (every one given is 0)."""
    from hicache.pools import _page_allocator

    want = {"alloc": 6, "free": 9}[name]
    with pytest.raises(TypeError, match=f"expected {want} arguments, got {len(args)}"):
        getattr(_page_allocator._native, name)(*args)


@pytest.mark.skipif(not _pagestack_built(), reason="hicache.pools._pagestack was not built (no C compiler)")
@pytest.mark.parametrize("pages", [3, -1])
def test_the_page_stack_pops_no_more_pages_than_it_holds(pages):
    """The page stack's own check under the allocator's: asked for more pages than it holds, or a
    negative count, alloc answers -2 and reads and writes nothing - the stack, the marks and the
    output unchanged (a pop past the stack's bottom would hand out whatever lies below it)."""
    from hicache.pools import _page_allocator

    stack, marks = torch.tensor([7, 1, 0], dtype=torch.int64), torch.zeros(8, dtype=torch.uint8)
    out = torch.full((3 * 4,), -9, dtype=torch.int64)
    top = _page_allocator._native.alloc(stack.data_ptr(), 2, marks.data_ptr(), pages, 4, out.data_ptr())
    assert top == -2 and stack.tolist() == [7, 1, 0] and not marks.any() and (out == -9).all()


class AllocatorMachine(RuleBasedStateMachine):
    """alloc / free / clear / double free checked against a set of free pages."""

    native = False

    def __init__(self):
        super().__init__()
        self.allocator = PageAllocator(PAGES, PAGE, native=self.native)
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

    @rule(data=st.data())
    def fill_to_95_percent(self, data):
        """Steady state of a full, evicting cache: allocate until at most 5 % is free."""
        while len(self.free_pages) > PAGES // 20:
            self.alloc(data.draw(st.integers(1, max(1, len(self.free_pages) - PAGES // 20))))

    @rule(data=st.data())
    def free_then_double_free_in_one_call(self, data):
        """A free that names a page twice, or a page not held, changes nothing."""
        if not self.held:
            return
        slots = self.held[data.draw(st.integers(0, len(self.held) - 1))]
        before = self.allocator.available_size()
        with pytest.raises(RuntimeError, match="double free"):
            self.allocator.free(torch.cat([slots, slots[:PAGE]]))
        assert self.allocator.available_size() == before

    @rule()
    def clear(self):
        self.allocator.clear()
        self.free_pages = set(range(PAGES))
        self.held = []

    @invariant()
    def available_is_exact(self):
        assert self.allocator.available_size() == len(self.free_pages) * PAGE


TestAllocatorMachine = AllocatorMachine.TestCase


class NativeAllocatorMachine(AllocatorMachine):
    native = True


if True in NATIVE:
    TestNativeAllocatorMachine = NativeAllocatorMachine.TestCase


@pytest.mark.concurrency  # threads: `make test-loaded` runs it again under load
@pytest.mark.parametrize("native", NATIVE)
def test_eight_threads_at_high_occupancy_never_share_a_page(native):
    """8 threads alloc and free through one lock (as the pool holds it) around 95 % full."""
    allocator, lock = PageAllocator(400, PAGE, native=native), threading.Lock()
    with lock:
        base = [allocator.alloc(PAGE) for _ in range(380)]  # 95 % full
    owner = torch.full((400 * PAGE,), -1, dtype=torch.int64)
    errors = []

    def worker(me: int):
        rng = torch.Generator().manual_seed(me)
        mine = []
        try:
            for _ in range(400):
                with lock:
                    slots = allocator.alloc(int(torch.randint(1, 3, (1,), generator=rng)) * PAGE)
                    if slots is not None:
                        if (owner[slots] != -1).any():
                            errors.append(f"slot handed out twice: {slots.tolist()}")
                        owner[slots] = me
                        mine.append(slots)
                if mine and int(torch.randint(0, 2, (1,), generator=rng)):
                    with lock:
                        freed = mine.pop(0)
                        owner[freed] = -1
                        allocator.free(freed)
            with lock:
                for freed in mine:
                    owner[freed] = -1
                    allocator.free(freed)
        except Exception as error:  # pragma: no cover - reported below
            errors.append(repr(error))

    _run_threads(worker, 8)
    assert errors == []
    assert allocator.available_size() == 20 * PAGE
    for slots in base:
        allocator.free(slots)
    assert allocator.available_size() == 400 * PAGE


@pytest.mark.concurrency  # threads: `make test-loaded` runs it again under load
def test_threads_never_share_a_slot():
    """Several threads allocating and freeing at once never hold the same slot."""
    device = MHADevicePool(size=512, layer_num=1, head_num=1, head_dim=4, page_size=PAGE)
    pool = MHATokenToKVPoolHost(device, 1.0, 0, PAGE, "page_first", False, "cpu", host=HostSetup(limits=Limits(chunk_limit_bytes=2**20), machine=ROOMY))
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

    _run_threads(worker, 4)
    assert errors == []
    assert pool.available_size() == pool.size
    pool.destroy()


@pytest.mark.parametrize("native", NATIVE)
def test_a_free_page_marked_handed_out_is_reported_as_corruption(native):
    """The books disagree (a page on the free list is marked handed out): alloc refuses to
    hand it out a second time instead of corrupting whoever holds it."""
    allocator = PageAllocator(8, PAGE, native=native)
    marks = allocator._marks if native else allocator._allocated
    marks[0] = 1  # page 0 is next out, but marked as already handed out
    with pytest.raises(RuntimeError, match="corrupted"):
        allocator.alloc(PAGE)
    assert allocator.available_size() == 8 * PAGE  # nothing was handed out


@pytest.mark.parametrize("native", NATIVE)
@pytest.mark.parametrize("dtype", ["int64", "int32"])
def test_a_free_of_part_of_a_page_is_refused_and_changes_nothing(native, dtype):
    """Freeing a page's first tokens but not all of them (a tensor of the pool's own index dtypes,
    the C path's input) is refused naming the page size; the free list is as it was, and the
    whole page frees afterwards."""
    allocator = PageAllocator(8, PAGE, native=native)
    pages = allocator.alloc(2 * PAGE)
    with pytest.raises(PlanError, match=f"not whole pages of {PAGE}"):
        allocator.free(pages[:PAGE - 1].to(getattr(torch, dtype)))
    assert allocator.available_size() == 6 * PAGE
    assert allocator.free(pages) == 2 * PAGE and allocator.available_size() == 8 * PAGE


@pytest.mark.parametrize("native", NATIVE)
@pytest.mark.parametrize("case, error, message", [
    ("a run broken, then a free page", PlanError, "page-aligned runs of whole pages"),
    ("one page twice", RuntimeError, "appears twice in one free"),
    ("a page never handed out", RuntimeError, r"pages \[2\] are not allocated"),
])
def test_each_bad_free_is_named_for_what_is_wrong_and_changes_nothing(native, case, error, message):
    """A free whose first run is broken (its second token another page's; its second run a page
    not handed out), that names one page twice, or a page never handed out, raises naming that
    fault - not another the same call also holds - and the books are as they were: the two pages
    handed out free afterwards."""
    allocator = PageAllocator(8, PAGE, native=native)
    held = allocator.alloc(2 * PAGE)
    first, second = held[:PAGE], held[PAGE:]
    broken = first.clone()
    broken[1] = 5 * PAGE  # starts on its page's first token; its second is another page's
    bad = {"a run broken, then a free page": torch.cat([broken, torch.arange(2 * PAGE, 3 * PAGE)]),
           "one page twice": torch.cat([first, second, first]),
           "a page never handed out": torch.cat([first, torch.arange(2 * PAGE, 3 * PAGE)])}[case]
    with pytest.raises(error, match=message):
        allocator.free(bad)
    assert allocator.available_size() == 6 * PAGE
    assert allocator.free(held) == 2 * PAGE and allocator.available_size() == 8 * PAGE


@pytest.mark.skipif(not _pagestack_built(), reason="hicache.pools._pagestack was not built (no C compiler)")
def test_a_free_that_would_overflow_the_stack_is_refused():
    """Books already wrong - every page on the free stack yet one marked handed out - and that page
    freed: the page stack refuses to push past its capacity (corruption, named) and writes nothing."""
    allocator = PageAllocator(8, PAGE, native=True)
    allocator._marks[3] = 1
    stack = allocator._stack.clone()
    with pytest.raises(RuntimeError, match="overflow the free stack"):
        allocator.free(torch.arange(3 * PAGE, 4 * PAGE))
    assert allocator._stack.equal(stack) and allocator.available_size() == 8 * PAGE and allocator._marks[3] == 1


def _run_threads(worker, count: int) -> None:
    """Run ``worker(0..count-1)`` on ``count`` threads at once and wait for all."""
    threads = [threading.Thread(target=worker, args=(i,)) for i in range(count)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()


@pytest.mark.parametrize("native", NATIVE)
@pytest.mark.parametrize("first_page", [-1, -PAGES, PAGES, PAGES + 3])
def test_a_free_of_a_page_outside_the_pool_is_refused_and_changes_nothing(native, first_page):
    """A page before the first (negative indices: the C path would read and write the byte before
    its marks array, the torch path would wrap to the last page) or at/after ``page_num`` (one
    past the marks) is "out of range", whatever those bytes or pages hold - with every page
    allocated, so a wrapped index would find a page to free. Nothing changes: the same pages stay
    allocated, and freeing them all afterwards works."""
    from hicache.errors import PlanError

    allocator = PageAllocator(PAGES, PAGE, native=native)
    held = [allocator.alloc(PAGE) for _ in range(PAGES)]
    assert allocator.available_size() == 0
    bad = torch.arange(first_page * PAGE, (first_page + 1) * PAGE, dtype=torch.int64)
    for indices in (bad, torch.cat([held[0], bad])):  # alone, and after a good page (which stays held)
        with pytest.raises(PlanError, match=r"out of range \[0, 160\)"):
            allocator.free(indices)
        assert allocator.available_size() == 0
    for pages in held:
        assert allocator.free(pages) == PAGE
    assert allocator.available_size() == PAGES * PAGE
    again = torch.cat([allocator.alloc(PAGE) for _ in range(PAGES)])
    assert sorted(again.tolist()) == list(range(PAGES * PAGE))  # no page outside the pool handed out
