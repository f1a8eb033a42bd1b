"""Progressive pools: the constructor returns once the first page is usable, the rest registers
in the background; only ready pages are handed out; failures and destroy() leave nothing
behind. A slow fake driver (FakeCudart(register_bytes_per_s=...)) makes registration take time."""

from __future__ import annotations

import threading

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from doors import doors
from machine import ROOMY

from hicache.effects import HostLedger
from hicache.errors import ApplyError
from hicache.plan import Limits
from hicache.pools import MHATokenToKOnlyPoolHost, MHATokenToKVPoolHost, MLATokenToKVPoolHost
from hicache.testing import FakeRuntime, MHADevicePool, MLADevicePool
from hicache.pools import HostPoolOptions
from hicache.effects import HostSetup

pytestmark = pytest.mark.concurrency  # processes, threads, signals or waits: `make test-loaded`

torch = pytest.importorskip("torch")
P = 4


def _pool(runtime, ledger, *, family="mla", layout="page_first_direct", chunk=16 * 1024, **kw):
    if family == "mla":
        device = MLADevicePool(size=256, layer_num=2, kv_lora_rank=28, qk_rope_head_dim=4, page_size=P)
        cls = MLATokenToKVPoolHost
    else:
        device = MHADevicePool(size=256, layer_num=2, head_num=2, head_dim=8, page_size=P)
        cls = MHATokenToKVPoolHost
    return cls(device, 2.0, 0, P, layout, True, "cpu", **doors(limits=Limits(chunk_limit_bytes=chunk), runtime=runtime,
                                                        ledger=ledger, machine=ROOMY, progressive=True, **kw))


def _inside(held, ptr, size):
    return any(base <= ptr and ptr + size <= base + length for base, length in held)


def _page_bytes_registered(pool, runtime, page):
    for slice_ in pool._l3.page_blocks(pool.kv_buffer, page * P):
        if not _inside(runtime.held(), slice_.data_ptr(), slice_.numel() * slice_.element_size()):
            return False
    return True


@pytest.mark.parametrize("family", ["mla", "mha"])
def test_pages_become_usable_front_to_back_and_only_registered_ones_are_handed_out(family):
    # 50 ms a chunk: the constructor's own first-time work (a process's first pool imports
    # prometheus_client for its metrics, ~40 ms) must not outlast the background's calls
    """A progressive page-first pool serves before it is fully registered, front to back, and every
    page it hands out is registered."""
    runtime, ledger = FakeRuntime(register_bytes_per_s=16 * 1024 / 0.05), HostLedger()
    pool = _pool(runtime, ledger, family=family)
    calls = len(runtime.cudart.timeline)
    total = sum(b.plan.call_count for b in pool.pool_plan.buffers)
    assert 0 < pool.ready_pages() and calls < total  # served before everything was registered
    handed = []
    while True:  # allocate as pages become ready, checking each against the fake driver
        slots = pool.alloc(P)
        if slots is None:
            if pool.ready_pages() == pool.page_num and pool.available_size() == 0:
                break
            if pool.wait_ready(timeout=0.002):
                continue
            continue
        page = int(slots[0]) // P
        assert _page_bytes_registered(pool, runtime, page), page
        handed.append(page)
    assert pool.wait_ready() is True and pool.ready_pages() == pool.page_num
    assert sorted(handed) == list(range(pool.page_num))
    assert len(runtime.held()) == total
    pool.destroy()
    assert runtime.held() == set() and ledger.held() == ()
    assert not any(t.name == "hicache-progressive" for t in threading.enumerate())


def test_a_background_failure_keeps_the_registered_prefix_and_wait_ready_raises():
    """A failing background call keeps the registered prefix usable and makes wait_ready raise the
    ApplyError."""
    runtime, ledger = FakeRuntime(fail_register={5: 2}), HostLedger()
    pool = _pool(runtime, ledger, chunk=4096)  # 16 chunks: the sixth call fails
    with pytest.raises(ApplyError):
        pool.wait_ready()
    ready = pool.ready_pages()
    assert 0 < ready < pool.page_num
    assert pool.available_size() == ready * P  # the prefix stays usable
    slots = pool.alloc(ready * P)
    assert slots is not None and all(_page_bytes_registered(pool, runtime, int(s) // P) for s in slots[::P])
    assert pool.alloc(P) is None
    pool.destroy()
    assert runtime.held() == set() and ledger.held() == ()


def test_destroy_during_the_background_registration_stops_it_and_leaves_nothing():
    """destroy() during the background registration stops it, leaves nothing registered or claimed,
    and no thread behind."""
    runtime, ledger = FakeRuntime(register_bytes_per_s=16 * 1024 / 0.02), HostLedger()  # 20 ms a chunk
    pool = _pool(runtime, ledger)
    assert pool.ready_pages() < pool.page_num
    pool.destroy()
    assert runtime.held() == set() and ledger.held() == ()
    assert not any(t.name == "hicache-progressive" for t in threading.enumerate())
    assert len(runtime.cudart.timeline) < sum(b.plan.call_count for b in pool.pool_plan.buffers)


def test_layer_first_registers_everything_before_returning():
    """A layer_first pool asked to be progressive registers every call before its constructor
    returns."""
    runtime, ledger = FakeRuntime(), HostLedger()
    pool = _pool(runtime, ledger, layout="layer_first")
    assert pool.ready_pages() == pool.page_num and pool.wait_ready() is True
    assert len(runtime.held()) == sum(b.plan.call_count for b in pool.pool_plan.buffers)
    pool.destroy()
    assert runtime.held() == set()


def test_a_failure_while_registering_the_first_pages_leaves_nothing():
    """The constructor's own chunks fail: nothing stays registered or mapped, the error is raised."""
    runtime, ledger = FakeRuntime(fail_register={1: 2}), HostLedger()
    with pytest.raises(ApplyError):
        _pool(runtime, ledger, family="mha", chunk=4096)  # MHA: K and V heads make several first chunks
    assert runtime.held() == set() and ledger.held() == ()


def test_background_calls_are_paced_to_the_stall_budget_and_still_form_a_valid_plan():
    """With a fake driver pinning 1 MB/s and a 5 ms stall budget, every call after the first
    registers at most what 5 ms allow (never below the 4 KiB boundary alignment), and what ends
    up registered in each buffer is a RegistrationPlan that passes every law."""
    from hicache.plan import Range, RegistrationPlan

    rate, stall = 1e6, 0.005
    runtime, ledger = FakeRuntime(register_bytes_per_s=rate), HostLedger()
    pool = _pool(runtime, ledger, max_stall_s=stall)
    assert pool.wait_ready() is True
    sizes = [size for _, _, size, _, _ in runtime.cudart.timeline]
    assert len(sizes) > sum(b.plan.call_count for b in pool.pool_plan.buffers)  # chunks were split
    assert all(size <= max(rate * stall, 4096) for size in sizes[1:]), sizes
    for buffer, tensor in zip(pool.pool_plan.buffers, pool.buffers):
        base, plan = tensor.data_ptr(), buffer.plan
        held = sorted((ptr - base, size) for ptr, size in runtime.held() if base <= ptr < base + plan.total_bytes)
        paced = RegistrationPlan(total_bytes=plan.total_bytes, granularity_bytes=plan.granularity_bytes,
                                 step_bytes=plan.step_bytes, limits=plan.limits,
                                 ranges=tuple(Range(o, s) for o, s in held), alignment_bytes=plan.alignment_bytes)
        assert paced.call_count == len(held)
    pool.destroy()
    assert runtime.held() == set()


@pytest.mark.parametrize("family", ["mla", "mha"])
def test_calls_on_a_big_chunk_wait_only_for_their_own_bytes(monkeypatch, family):
    """One chunk spans each buffer (the default 64 GiB chunk does for a 100 GB pool) and the
    driver is fast (a 0.25 s budget is the whole buffer): the first page is served - the
    constructor returns, for MHA after a call on K and one on V - before the last piece is
    faulted, and every call starts only once all of its bytes are (order, not timing)."""
    import threading
    import time as _time

    from hicache.effects._bringup import _faulting as _pipeline

    from hicache.effects._cuda import _progressive
    pieces = []
    real = _pipeline.prefault
    served = threading.Event()  # the constructor returned: the order is made, not hoped for under load
    held_back = []

    def slow_prefault(buffer, **kw):
        _time.sleep(0.005)
        if kw["start"] + kw["length"] >= buffer.nbytes:  # a buffer's last piece: no first call needs it
            assert served.wait(60), "hang guard: the constructor never returned"
            held_back.append(kw["start"])
        report = real(buffer, **kw)
        pieces.append((buffer.ptr + kw["start"], kw["length"], _time.perf_counter()))
        return report

    monkeypatch.setattr(_pipeline, "prefault", slow_prefault)
    monkeypatch.setattr(_pipeline, "PIECE_BYTES", 16 * 1024)
    monkeypatch.setattr(_pipeline, "FIRST_PIECE_BYTES", 4096)
    monkeypatch.setattr(_progressive, "FIRST_CALL_BYTES", 4096)
    runtime, ledger = FakeRuntime(register_bytes_per_s=1e9), HostLedger()
    pool = _pool(runtime, ledger, family=family, chunk=2**40)
    returned = _time.perf_counter()
    served.set()
    assert all(b.plan.call_count == 1 for b in pool.pool_plan.buffers)  # one chunk: the whole buffer
    assert pool.wait_ready() is True
    assert held_back  # each buffer's last piece waited for the constructor
    assert returned < max(p[2] for p in pieces)  # served before the buffer was wholly faulted
    for _, ptr, size, start, _ in runtime.cudart.timeline:
        covering = [p for p in pieces if p[0] < ptr + size and ptr < p[0] + p[1]]
        assert sum(min(p[0] + p[1], ptr + size) - max(p[0], ptr) for p in covering) == size
        assert all(p[2] <= start for p in covering)
    pool.destroy()
    assert runtime.held() == set() and ledger.held() == ()


@pytest.mark.parametrize("family", ["mla", "mha"])
def test_the_constructor_returns_once_the_first_page_is_registered_in_every_buffer(monkeypatch, family):
    """One chunk per buffer, holding both K/V halves for MHA (as the default 64 GiB chunk does):
    the constructor makes exactly the calls the first page needs - one per buffer and K/V half -
    not all of K before V's first page; the next call ends only after it has returned (each
    takes 100 ms)."""
    import time as _time

    from hicache.effects._cuda import _progressive
    monkeypatch.setattr(_progressive, "FIRST_CALL_BYTES", 4096)
    runtime, ledger = FakeRuntime(register_bytes_per_s=4096 / 0.1), HostLedger()
    pool = _pool(runtime, ledger, family=family, chunk=2**40, max_stall_s=0.1)
    returned = _time.perf_counter()
    pool.destroy()  # stops after the call in flight
    halves = 2 if family == "mha" else 1
    assert all(b.plan.call_count == 1 for b in pool.pool_plan.buffers)
    before = [call for call in runtime.cudart.timeline if call[4] <= returned]
    assert len(before) == len(pool.pool_plan.buffers) * halves, before
    assert len(runtime.cudart.timeline) <= len(before) + 1
    assert runtime.held() == set() and ledger.held() == ()


@st.composite
def progressive_pools(draw):
    family = draw(st.sampled_from(["mla", "mha"]))
    layout = draw(st.sampled_from(["page_first", "page_first_direct"]))
    page = draw(st.sampled_from([1, 2, 4, 8]))
    layers = draw(st.integers(1, 3))
    if family == "mla":
        device = MLADevicePool(size=64, layer_num=layers, kv_lora_rank=draw(st.sampled_from([12, 28, 60])),
                               qk_rope_head_dim=4, page_size=page)
    else:
        device = MHADevicePool(size=64, layer_num=layers, head_num=draw(st.integers(1, 3)),
                               head_dim=draw(st.sampled_from([4, 8, 24])), page_size=page)
    ratio = draw(st.sampled_from([2.0, 3.0, 5.0]))
    chunk = draw(st.sampled_from([4096, 3 * 4096, 16 * 4096, 2**40]))
    stall = draw(st.sampled_from([0.001, 0.01, 0.25]))
    return family, layout, page, device, ratio, chunk, stall


@settings(max_examples=50)  # each maps, registers and releases a pool: ~40 ms, ~0.2 s on a loaded box
@given(progressive_pools())
def test_any_page_first_pool_registers_its_plan_exactly_and_hands_out_only_registered_pages(shape):
    """Any page-first pool, any chunk limit, any stall budget: what ends up registered tiles
    every buffer exactly (no byte twice, none left out), each buffer's calls form a
    RegistrationPlan that passes every law and keep the plan's boundary alignment (the cuts at
    the K/V halves and the paced calls included: two calls never share an OS page), and every page the pool hands out on the way is registered in every buffer."""
    from hicache.plan import Range, RegistrationPlan

    family, layout, page, device, ratio, chunk, stall = shape
    cls = MLATokenToKVPoolHost if family == "mla" else MHATokenToKVPoolHost
    runtime, ledger = FakeRuntime(register_bytes_per_s=5e8), HostLedger()
    pool = cls(device, ratio, 0, page, layout, True, "cpu", host=HostSetup(limits=Limits(chunk_limit_bytes=chunk), runtime=runtime, ledger=ledger, machine=ROOMY), options=HostPoolOptions(progressive=True, max_stall_s=stall))
    try:
        while pool.available_size() or not pool.wait_ready(timeout=0):
            slots = pool.alloc(page)
            if slots is not None:
                for slice_ in pool._l3.page_blocks(pool.kv_buffer, int(slots[0])):
                    assert _inside(runtime.held(), slice_.data_ptr(), slice_.numel() * slice_.element_size())
        assert pool.wait_ready() is True and pool.ready_pages() == pool.page_num
        for buffer, tensor in zip(pool.pool_plan.buffers, pool.buffers):
            base, plan = tensor.data_ptr(), buffer.plan
            held = sorted((ptr - base, size) for ptr, size in runtime.held() if base <= ptr < base + plan.total_bytes)
            assert held[0][0] == 0 and all(a + s == b for (a, s), (b, _) in zip(held, held[1:]))
            assert held[-1][0] + held[-1][1] == plan.total_bytes
            alignment = plan.alignment_bytes or plan.granularity_bytes or plan.total_bytes
            assert all(offset % alignment == 0 for offset, _ in held), (alignment, held)  # no shared OS page
            RegistrationPlan(total_bytes=plan.total_bytes, granularity_bytes=plan.granularity_bytes,
                             step_bytes=plan.step_bytes, limits=plan.limits,
                             ranges=tuple(Range(o, s) for o, s in held), alignment_bytes=plan.alignment_bytes)
    finally:
        pool.destroy()
    assert runtime.held() == set() and ledger.held() == ()


def _mamba_pool(runtime, ledger, layout):
    from types import SimpleNamespace

    from hicache.pools import MambaPoolHost

    cache = SimpleNamespace(temporal=torch.randn(3, 65, 2, 4), conv=[torch.randn(3, 65, 3, 2).to(torch.bfloat16)])
    device = SimpleNamespace(num_mamba_layers=3, mamba_cache=cache, size=64, device="cpu")
    return MambaPoolHost(device, 40.0, 0, layout=layout, host=HostSetup(runtime=runtime, ledger=ledger, machine=ROOMY, limits=Limits(chunk_limit_bytes=4096)), options=HostPoolOptions(progressive=True))


def _deepseek_v4_pool(runtime, ledger, layout):
    from hicache.pools import DeepSeekV4PagedHostPool

    buffers = [torch.randint(0, 256, (12, 48), dtype=torch.uint8) for _ in range(3)]
    # the window pool: the V4 paged pool that hands out its own slots (the others are whole: below)
    return DeepSeekV4PagedHostPool(pool_name="swa", device_buffers=buffers, item_bytes=48, num_host_pages=400,
                                   slot_page_size=4, layout=layout, host=HostSetup(runtime=runtime, ledger=ledger, machine=ROOMY, limits=Limits(chunk_limit_bytes=8192)), options=HostPoolOptions(progressive=True))


@pytest.mark.parametrize("layout", ["page_first", "page_first_direct"])
@pytest.mark.parametrize("make", [_mamba_pool, _deepseek_v4_pool], ids=["mamba", "deepseek-v4"])
def test_other_families_come_up_progressively_and_hand_out_only_registered_pages(make, layout):
    """Every page-first family comes up progressively and hands out only pages inside registered
    ranges."""
    runtime, ledger = FakeRuntime(register_bytes_per_s=1e6), HostLedger()
    pool = make(runtime, ledger, layout)
    assert 0 < pool.ready_pages() < pool.page_num  # served before everything was registered
    while pool.available_size() or not pool.wait_ready(timeout=0):
        slots = pool.alloc(pool.page_size)
        if slots is not None:
            for slice_ in pool._l3.page_blocks(pool.kv_buffer, int(slots[0])):
                assert _inside(runtime.held(), slice_.data_ptr(), slice_.numel() * slice_.element_size())
    assert pool.wait_ready() is True and pool.ready_pages() == pool.page_num
    pool.destroy()
    assert runtime.held() == set() and ledger.held() == ()


def test_a_pool_beside_an_anchor_is_whole_before_it_serves_while_its_anchor_registers(caplog):
    """A pool whose slots are its anchor's (the K-only index beside its KV: SGLang 0.5.23's
    `from_anchor`, as its assembler builds MiniMax's sparse layout) registers all of itself before
    its constructor returns, even asked to be progressive: the anchor hands out slots by its own
    readiness, so every slot the anchor has ready takes a copy in the side pool at once (it was a
    TransferError while the side pool's own background registration lagged the anchor's)."""
    caplog.set_level("INFO", logger="hicache")
    runtime, ledger = FakeRuntime(register_bytes_per_s=1e5), HostLedger()
    anchor = _pool(runtime, ledger, family="mha", layout="page_first")
    assert 0 < anchor.ready_pages() < anchor.page_num  # the anchor serves while it registers
    device = MHADevicePool(size=512, layer_num=2, head_num=1, head_dim=16, page_size=P, k_only=True)
    index = MHATokenToKOnlyPoolHost.from_anchor(device, anchor, "page_first", **doors(
        limits=Limits(chunk_limit_bytes=4096), runtime=runtime, ledger=ledger, machine=ROOMY, progressive=True))
    try:
        assert index.ready_pages() == index.page_num == anchor.page_num
        assert "not progressively: its slots are another pool's (its anchor's)" in caplog.text  # the log says why
        slots = anchor.alloc(anchor.ready_pages() * P)  # every slot the anchor has ready
        device.k_buffer[1][: len(slots)] = torch.randn(device.k_buffer[1][: len(slots)].shape).to(device.dtype)
        index.backup_from_device_all_layer(device, slots, torch.arange(len(slots)), "direct")
        want = device.k_buffer[1][: len(slots)].clone()
        device.k_buffer[1].zero_()
        index.load_to_device_per_layer(device, slots, torch.arange(len(slots)), 1, "direct")
        assert torch.equal(device.k_buffer[1][: len(slots)].view(torch.int16), want.view(torch.int16))
    finally:
        index.destroy()
        anchor.destroy()
    assert runtime.held() == set() and ledger.held() == ()


def test_deepseek_v4s_side_pools_are_whole_before_they_serve_and_its_window_pool_serves_while_it_registers(caplog):
    """SGLang 0.5.23's DeepSeek-V4 group copies its C4 KV, index keys and C128 KV at the slots of
    its memoryless KV anchor (`LogicalHostPool`: every slot at once), so those pools register all
    of themselves before they return, even asked to be progressive (a slot past their own
    registration was a TransferError); its window pool ("swa"), whose own allocator hands out
    what it copies, serves while it registers."""
    from hicache.pools import DeepSeekV4PagedHostPool, LogicalHostPool

    caplog.set_level("INFO", logger="hicache")
    runtime, ledger = FakeRuntime(register_bytes_per_s=1e5), HostLedger()
    rows = [torch.randint(0, 256, (9, 1024), dtype=torch.uint8) for _ in range(2)]  # page rows of 2 layers
    made = [DeepSeekV4PagedHostPool(name, rows, 1024, 16, P, "page_first", **doors(
        limits=Limits(chunk_limit_bytes=4096), runtime=runtime, ledger=ledger, machine=ROOMY, progressive=True))
        for name in ("deepseek_v4_c4", "swa")]
    c4, window = made
    try:
        assert 0 < window.ready_pages() < window.page_num
        assert c4.ready_pages() == c4.page_num
        assert "not progressively: its slots are another pool's (its anchor's)" in caplog.text  # the log says why
        slots = LogicalHostPool(16 * P, P).alloc(16 * P)  # every slot the anchor hands out, at once
        on_device = torch.arange(8 * P).repeat(2)  # device pages 0-7, twice over
        want = [layer[:8].clone() for layer in rows]
        c4.backup_from_device_all_layer(None, slots, on_device, "direct")
        for layer in rows:
            layer.zero_()
        c4.load_to_device_per_layer(None, slots[-8 * P:], on_device[:8 * P], 1, "direct")  # the last 8 host pages
        assert torch.equal(rows[1][:8], want[1]) and not rows[0].any()
    finally:
        for pool in made:
            pool.destroy()
    assert runtime.held() == set() and ledger.held() == ()


# -- turning it on where SGLang builds the pool (no hicache keywords there) -----------------------
def _sglang_style_pool(**kw):
    """As HiRadixCache builds it: five positional arguments, SGLang's defaults, nothing else
    (hicache's test-only keywords aside)."""
    device = MHADevicePool(size=256, layer_num=2, head_num=2, head_dim=8, page_size=P)
    return MHATokenToKVPoolHost(device, 2.0, 0, P, "page_first_direct",
                                **doors(machine=ROOMY, limits=Limits(chunk_limit_bytes=4096), **kw))


def test_hicache_progressive_turns_it_on_for_a_pool_built_as_sglang_builds_it(monkeypatch):
    """HICACHE_PROGRESSIVE=1 makes a pool built with SGLang's arguments progressive, and it ends
    fully registered."""
    from hicache.testing import fake_cuda

    monkeypatch.setenv("HICACHE_PROGRESSIVE", "1")
    with fake_cuda(register_bytes_per_s=4096 / 0.01) as cuda:  # 10 ms a call
        pool = _sglang_style_pool()
        assert pool.progressive is True and pool.ready_pages() < pool.page_num
        assert pool.wait_ready() is True
        pool.destroy()
        assert cuda.held() == set()
        pool = _sglang_style_pool(progressive=False)  # the keyword beats the variable
        assert pool.progressive is False and pool.ready_pages() == pool.page_num
        pool.destroy()
    monkeypatch.setenv("HICACHE_PROGRESSIVE", "0")
    with fake_cuda():
        pool = _sglang_style_pool()
        assert pool.progressive is False
        pool.destroy()


def test_hicache_hugepages_sets_the_page_size_of_a_pool_built_as_sglang_builds_it(monkeypatch):
    """HICACHE_HUGEPAGES sets the page mode of a pool built with SGLang's arguments (thp, off)."""
    from hicache.testing import fake_cuda

    monkeypatch.setenv("HICACHE_HUGEPAGES", "thp")
    with fake_cuda():
        pool = _sglang_style_pool()
        assert pool.allocator.hugepages == "thp"
        pool.destroy()
        pool = _sglang_style_pool(hugepages="off")  # the keyword beats the variable
        assert pool.allocator.hugepages == "off"
        pool.destroy()


@pytest.mark.parametrize("name, value", [("HICACHE_PROGRESSIVE", "maybe"), ("HICACHE_HUGEPAGES", "huge")])
def test_a_bad_pool_setting_in_the_environment_names_the_variable_and_the_value(monkeypatch, name, value):
    """A bad HICACHE_PROGRESSIVE / HICACHE_HUGEPAGES fails the constructor naming variable and
    value, with nothing registered."""
    from hicache.errors import HicacheError
    from hicache.testing import fake_cuda

    monkeypatch.setenv(name, value)
    with fake_cuda() as cuda, pytest.raises(HicacheError) as info:
        _sglang_style_pool()
    assert name in str(info.value) and repr(value) in str(info.value)
    assert cuda.held() == set()


def test_hugetlbfs_pools_keep_their_plan_on_the_huge_page(monkeypatch):
    """HICACHE_HUGEPAGES=prefer (no pages reserved here: it falls back to 4 KiB pages): the
    plan's boundaries still fall on 2 MiB, so no two calls share a huge page where there is one."""
    from hicache.testing import fake_cuda

    monkeypatch.setenv("HICACHE_HUGEPAGES", "prefer")
    device = MHADevicePool(size=4096, layer_num=2, head_num=4, head_dim=64, page_size=64)
    with fake_cuda() as cuda:
        pool = MHATokenToKVPoolHost(device, 4.0, 0, 64, "page_first_direct", host=HostSetup(machine=ROOMY, limits=Limits(chunk_limit_bytes=4 * 2**20)))
        assert pool.allocator.hugepages == "prefer" and pool.allocator.hugepage_bytes == 2 * 2**20
        plan = pool.pool_plan.buffers[0].plan
        assert plan.call_count > 1 and all(r.offset % (2 * 2**20) == 0 for r in plan.ranges)
        pool.destroy()
        assert cuda.held() == set()


@given(st.integers(0, 3 * 2**17))
def test_a_chunks_pre_fault_pieces_ramp_up_then_down(pages):
    """A chunk is faulted in pieces that tile it exactly, none over PIECE_BYTES: the first is
    FIRST_PIECE_BYTES (its first call waits for little faulting) and so is at most the last
    (the last call, made once all faulting is done, registers little)."""
    from hicache.effects._bringup._faulting import FIRST_PIECE_BYTES, piece_sizes
    from hicache.effects._bringup._faulting import PIECE_BYTES

    size = pages * 4096
    sizes = piece_sizes(size)
    assert sum(sizes) == size and all(0 < s <= PIECE_BYTES for s in sizes)
    if size:
        assert sizes[0] == min(FIRST_PIECE_BYTES, size) and sizes[-1] <= FIRST_PIECE_BYTES


@pytest.mark.parametrize("family", ["mla", "mha"])
def test_every_thread_exists_before_the_first_pre_fault_call(monkeypatch, family):
    """Starting a thread maps its stack, which waits behind any pre-fault call in flight (the
    mmap lock): the background registration thread is started before faulting begins, not
    after the first page's calls (measured on 2 cores: ~4.5 ms per start, twice per pool,
    on the first page's path)."""
    from hicache.effects._host import _memory as _host_memory
    seen = []
    real = _host_memory._madvise()

    def madvise(addr, length, advice):
        seen.append({t.name for t in threading.enumerate()})
        return real(addr, length, advice)

    started = []
    real_start = threading.Thread.start

    def start(thread):
        started.append(thread.name)
        real_start(thread)

    monkeypatch.setattr(_host_memory, "_madvise", lambda: madvise)
    monkeypatch.setattr(threading.Thread, "start", start)
    runtime, ledger = FakeRuntime(register_bytes_per_s=1e9), HostLedger()
    pool = _pool(runtime, ledger, family=family, chunk=2**40)
    assert pool.wait_ready() is True
    pool.destroy()
    assert seen and "hicache-progressive" in seen[0] and "hicache-prefault-pipeline" in seen[0]
    # by construction, not by a race: the pre-fault begins only once the registration thread runs
    assert started.index("hicache-progressive") < started.index("hicache-prefault-pipeline")
    assert runtime.held() == set() and ledger.held() == ()


@pytest.mark.parametrize("bad", [-1, 0, 1e-9, float("nan"), float("inf"), "0.25", True, [0.25]])
def test_a_bad_max_stall_is_refused_where_it_enters_before_any_memory(bad):
    """`max_stall_s` is checked where it enters - the bring-up's `Progressive`, the progressive
    registration itself, and a pool's constructor - before anything is mapped or registered: a
    clear PlanError naming the field and the value (not 3,073 one-page calls for 1e-9, nor a raw
    error after the bring-up began)."""
    from hicache.effects import Progressive
    from hicache.effects._cuda._progressive import ProgressiveRegistration
    from hicache.errors import PlanError

    with pytest.raises(PlanError, match=r"max_stall_s must be"):
        Progressive(max_stall_s=bad)
    with pytest.raises(PlanError, match=r"ProgressiveRegistration\.max_stall_s must be"):
        ProgressiveRegistration([], runtime=FakeRuntime(), max_stall_s=bad)
    runtime = FakeRuntime()
    with pytest.raises(PlanError, match=r"max_stall_s must be"):
        _pool(runtime, HostLedger(), max_stall_s=bad)
    assert runtime.cudart.log == []


def test_max_stall_takes_any_real_number_of_seconds():
    """Progressive(max_stall_s=) takes any positive real number of seconds."""
    import numpy as np

    from hicache.effects import Progressive

    for good, seconds in ((np.float32(0.25), 0.25), (np.float64(0.5), 0.5), (1, 1.0), (0.001, 0.001), (None, None)):
        assert Progressive(max_stall_s=good).max_stall_s == seconds


def test_a_background_failure_is_logged_at_the_chunk_it_happened_in(caplog):
    """A refused call on chunk 6 of 8 in the background says chunk 6 of 8 (it said "chunk 1 of
    1": each background call is a one-range plan)."""
    import logging

    from hicache.effects._cuda._progressive import Chunk, ProgressiveRegistration

    runtime = FakeRuntime(fail_register={5: 2})
    base = 1 << 44
    chunks = [Chunk("kv", base + i * 2**20, 2**20, 4096, Limits(chunk_limit_bytes=2**20)) for i in range(8)]
    registration = ProgressiveRegistration(chunks, runtime=runtime, ledger=HostLedger(), max_stall_s=None)
    with caplog.at_level(logging.ERROR, logger="hicache.effects._cuda._progressive"):
        registration.start()
        with pytest.raises(Exception):
            registration.wait(10)
    assert "stopped at chunk 6 of 8 (kv, 0 bytes into it); 5 of 8 chunks wholly registered" in caplog.text
    registration.release()
    assert runtime.held() == set()


def test_release_unregisters_the_calls_newest_first():
    """A progressive registration is torn down as any journal is: its calls unregistered in
    the reverse of the order they were made (the fake's log), every one of them."""
    from hicache.effects import BufferRequest, HostTensorAllocator, Progressive, bring_up
    from hicache.effects import HostSetup
    from hicache.plan import plan_registration
    from hicache.testing import FakeCudart

    plan = plan_registration(8 * 2**20, granularity_bytes=4096, limits=Limits(chunk_limit_bytes=2 * 2**20))
    cudart = FakeCudart()
    handle = bring_up([BufferRequest("kv", (plan.total_bytes,), None, plan)], mode=Progressive(max_stall_s=None),
                      host=HostSetup(runtime=FakeRuntime(cudart), machine=ROOMY, turnstile=None,
                                     allocator=HostTensorAllocator()))
    try:
        assert handle.wait(120)
    finally:
        handle.release()
    registered = [ptr for op, ptr, *_ in cudart.log if op == "register"]
    unregistered = [ptr for op, ptr, *_ in cudart.log if op == "unregister"]
    assert len(registered) == 4 and unregistered == registered[::-1] and cudart.registered == {}


@pytest.mark.parametrize("transfer", ["auto", "gather"])
def test_a_transfer_touching_a_page_not_yet_registered_is_refused_and_copies_nothing(transfer):
    """A progressive pool stopped part-way (a failed background call): a transfer of its ready
    pages runs (each engine), one that touches a page past them - in either direction, among
    ready ones - is a TransferError naming the registered slots, and no byte changes on either side."""
    from hicache.effects import CopyEngine
    from hicache.errors import TransferError

    runtime, ledger = FakeRuntime(fail_register={5: 2}), HostLedger()
    pool = _pool(runtime, ledger, chunk=4096, copy_engine=CopyEngine(transfer=transfer))
    with pytest.raises(ApplyError):
        pool.wait_ready()
    ready = pool.ready_pages()
    assert 0 < ready < pool.page_num
    device = pool.device_pool
    generator = torch.Generator().manual_seed(5)
    for buffer in device.kv_buffer:
        buffer.copy_(torch.randint(-99, 99, buffer.shape, generator=generator).to(buffer.dtype))
    fine = torch.arange(0, min(ready * P, 256))
    pool.backup_from_device_all_layer(device, fine, fine, "kernel")
    pool.load_to_device_per_layer(device, fine, fine, 1, "kernel")
    on_device = torch.arange(P, 3 * P)
    for bad_page in (ready, pool.page_num - 1):
        bad = torch.cat([torch.arange(0, P), torch.arange(bad_page * P, bad_page * P + P)])
        host_before = [b.clone() for b in pool.buffers]
        device_before = [b.clone() for b in device.kv_buffer]
        for call in (lambda: pool.backup_from_device_all_layer(device, bad, on_device, "kernel"),
                     lambda: pool.load_to_device_per_layer(device, bad, on_device, 0, "kernel")):
            with pytest.raises(TransferError, match=f"not registered yet .*slots \\[0, {ready * P}\\)"):
                call()
        assert all(torch.equal(a, b) for a, b in zip(host_before, pool.buffers))
        assert all(torch.equal(a, b) for a, b in zip(device_before, device.kv_buffer))
    pool.destroy()
    assert runtime.held() == set() and ledger.held() == ()


def test_sglangs_range_records_take_chunks_before_and_after_the_tensors_exist():
    """`RangeRecords`: chunks noted before `attach` land on their buffer's record by offset,
    those after on the record itself, pointers from the tensor's base; `clear` empties every
    record and drops later notes; without `expect_chunks` the handle's ranges inside each
    tensor are its record."""
    from hicache.pools._range_records import RANGES_ATTR, RangeRecords

    tensors = [torch.zeros(64, dtype=torch.uint8), torch.zeros(32, dtype=torch.uint8)]
    records = RangeRecords()
    records.expect_chunks()
    records.note(1, 0, 16)
    records.attach(tensors, held=lambda: pytest.fail("progressive records come from the chunks"))
    records.note(0, 32, 32)
    records.note(1, 16, 16)
    base0, base1 = (t.data_ptr() for t in tensors)
    assert getattr(tensors[0], RANGES_ATTR) == [(base0 + 32, 32)]
    assert getattr(tensors[1], RANGES_ATTR) == [(base1, 16), (base1 + 16, 16)]
    records.clear(tensors)
    records.note(0, 0, 32)  # a chunk after the memory went: nothing to record
    assert [getattr(t, RANGES_ATTR) for t in tensors] == [[], []]
    whole = RangeRecords()
    whole.attach(tensors, held=lambda: [(base0, 64), (base1, 32), (1, 8)])
    assert [getattr(t, RANGES_ATTR) for t in tensors] == [[(base0, 64)], [(base1, 32)]]
