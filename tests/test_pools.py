"""Host KV pools: every family x layout moves pages both ways byte-exactly; lifetimes are safe."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from hicache.effects import HostLedger
from hicache.effects._copy import _host_copy
from hicache.errors import (
    ApplyError,
    CapacityError,
    LayoutError,
    PlanError,
    RegistrationStateError,
    TransferError)
from hicache.plan import Limits
from hicache.pools import (
    AsymmetricMHATokenToKVPoolHost,
    DeepSeekV4PagedHostPool,
    DeepSeekV4StateHostPool,
    DSAIndexerPoolHost,
    HostKVCache,
    MambaPoolHost,
    MHATokenToKOnlyPoolHost,
    MHATokenToKVPoolHost,
    MLATokenToKVPoolHost)
from hicache.testing import (
    AsymmetricMHADevicePool,
    DeepSeekV4DevicePool,
    DSAIndexerDevicePool,
    FakeRuntime,
    MambaDevicePool,
    MHADevicePool,
    MLADevicePool)

from doors import doors
from machine import ROOMY
from hicache.effects import HostSetup

torch = pytest.importorskip("torch")
P = 4
LIMITS = Limits(chunk_limit_bytes=8192, os_page_bytes=64)


def _mha(**kw):
    return MHADevicePool(size=64, layer_num=3, head_num=2, head_dim=8, page_size=P, **kw)


FAMILIES = {
    "mha": (MHATokenToKVPoolHost, lambda: _mha()),
    "mha_k_only": (MHATokenToKOnlyPoolHost, lambda: _mha(k_only=True)),
    "asymmetric": (AsymmetricMHATokenToKVPoolHost,
                   lambda: AsymmetricMHADevicePool(size=64, layer_num=3, head_num=2, k_head_dim=12, v_head_dim=4, page_size=P)),
    "mla": (MLATokenToKVPoolHost, lambda: MLADevicePool(size=64, layer_num=3, kv_lora_rank=16, qk_rope_head_dim=4, page_size=P)),
    "dsa": (DSAIndexerPoolHost, lambda: DSAIndexerDevicePool(size=64, layer_num=3, index_head_dim=16, quant_block_size=8, page_size=P)),
    "mamba": (MambaPoolHost, lambda: MambaDevicePool(size=16, layer_num=3, temporal_shape=(2, 4), conv_shapes=((3, 2),), page_size=1)),
    "v4_paged": (DeepSeekV4PagedHostPool, lambda: DeepSeekV4DevicePool(size=64, layer_num=3, item_bytes=24, page_size=P)),
    "v4_state": (DeepSeekV4StateHostPool, lambda: DeepSeekV4DevicePool(size=64, layer_num=3, state_page_bytes=40, page_size=P)),
}
CASES = [(name, layout) for name, (cls, _) in FAMILIES.items() for layout in cls.descriptor_class().supported()]


def make(name, layout, **kw):
    cls, device = FAMILIES[name]
    device_pool = device()
    kw.setdefault("limits", LIMITS)
    kw.setdefault("machine", ROOMY)
    kw = doors(**kw)
    if cls is MambaPoolHost:  # SGLang's signature: no page size, layout a keyword
        pool = cls(device_pool, 2.0, 0, kw.pop("pin_memory", False), "cpu", layout=layout, **kw)
    else:
        pool = cls(device_pool, 2.0, 0, device_pool.page_size, layout, kw.pop("pin_memory", False), "cpu", **kw)
    return pool, device_pool


def _slots(pool, pages):
    """Host slots for ``pages`` pages (from the allocator when the pool has one)."""
    if pool.has_allocator:
        return pool.alloc(pages * pool.page_size)
    return torch.arange(pages * pool.page_size)


def round_trip(pool, device, *, seed: int, pages_seed: int, pages: int, backend: str, target: str = "cpu"):
    """SGLang's write-back of ``pages`` random device pages, then its per-layer load of them into
    the zeroed device (``device`` randomized with ``seed``, then moved to ``target``): the device
    rows come back bit for bit (asserted). Returns the host slots, the host bytes after the
    write-back and the engine the write-back's batch took."""
    device.randomize(seed)
    if target != "cpu":
        device.to(target)
    page = pool.page_size
    device_pages = torch.randperm(device.slots // page - 1, generator=torch.Generator().manual_seed(pages_seed))[:pages] + 1
    device_idx = (device_pages[:, None] * page + torch.arange(page)).reshape(-1).to(target)
    host_idx = _slots(pool, pages)
    original = [t.clone() for t in device.tensors()]
    pool.backup_from_device_all_layer(device, host_idx, device_idx, backend)
    _synchronize(target)
    choice = pool.copy_engine.last_choice
    host_bytes = [b.clone() for b in pool.buffers]
    device.zero()
    for layer in range(pool.start_layer, pool.end_layer):
        pool.load_to_device_per_layer(device, host_idx, device_idx, layer, backend)
    _synchronize(target)
    rows = (device_pages if any(s.rows for s in pool.streams()) else device_idx.cpu()).to(target)
    axis = 1 if isinstance(pool, MambaPoolHost) else 0
    for before, after in zip(original, device.tensors()):
        assert torch.equal(before.index_select(axis, rows), after.index_select(axis, rows))
    return host_idx, host_bytes, choice


def _synchronize(target: str) -> None:
    if target == "cuda":
        torch.cuda.synchronize()


@pytest.mark.parametrize("name, layout", CASES, ids=[f"{n}-{l}" for n, l in CASES])
@pytest.mark.parametrize(
    "seed, copy_mode, threshold",  # host copies: native as shipped, native threaded+streamed, fallback
    [(0, "auto", None), (1, "auto", 0), (2, "python", 0)])
def test_backup_then_load_round_trips_random_pages(name, layout, seed, copy_mode, threshold, monkeypatch):
    """Back up random device pages, clear the device, load them back layer by layer: same bytes."""
    monkeypatch.setenv(_host_copy.ENV_VAR, copy_mode)
    if threshold is not None:
        monkeypatch.setattr(_host_copy, "PARALLEL_BYTES", threshold)
        monkeypatch.setattr(_host_copy, "STREAM_BYTES", threshold)
    pool, device = make(name, layout)
    try:
        host_idx, _, _ = round_trip(pool, device, seed=seed, pages_seed=seed, pages=5, backend="direct")
        # flat data pages round-trip
        first, second = int(host_idx[0]), int(host_idx[pool.page_size])
        data = pool.get_data_page(first)
        assert data.dim() == 1
        pool.set_from_flat_data_page(second, data)
        assert torch.equal(pool.get_data_page(second), data)
    finally:
        pool.destroy()


#: token sets no whole-page view covers: (host slots from a 2-page allocation, device slots)
UNALIGNED = {
    "scattered tokens": (slice(None), [5, 9, 2, 7, 33, 34, 35, 11]),
    "a page and a half": (slice(0, P + 2), list(range(3 * P, 4 * P + 2))),
}


@pytest.mark.parametrize("case", sorted(UNALIGNED))
@pytest.mark.parametrize("layout", ["layer_first", "page_first", "page_first_direct", "page_head"])
def test_unaligned_token_runs_use_the_token_path(layout, case):
    """MHA slots that are not whole pages - scattered tokens, or a page and a half (no whole-page
    view of it exists) - still round-trip, token by token."""
    pool, device = make("mha", layout)
    try:
        device.randomize(3)
        host_part, device_slots = UNALIGNED[case]
        host_idx = pool.alloc(2 * P)[host_part]
        device_idx = torch.tensor(device_slots)
        original = [t[device_idx].clone() for t in device.tensors()]
        pool.backup_from_device_all_layer(device, host_idx, device_idx, "direct")
        device.zero()
        for layer in range(3):
            pool.load_to_device_per_layer(device, host_idx, device_idx, layer, "direct")
        assert all(torch.equal(a, t[device_idx]) for a, t in zip(original, device.tensors()))
    finally:
        pool.destroy()


@pytest.mark.parametrize("layout", ["layer_first", "page_first_direct"])
def test_indices_changed_in_place_between_layers_are_honoured(layout):
    """The per-layer index memo reuses work only for equal values: an in-place change misses."""
    pool, device = make("mha", layout)
    device.randomize(4)
    host_idx = pool.alloc(2 * P)
    device_idx = torch.arange(4 * P, 6 * P)
    pool.backup_from_device_all_layer(device, host_idx, device_idx, "direct")
    memo = pool._transfers.memo
    first = memo.check(host_idx, device_idx, host_slots=pool.size, device_slots=64, page_size=P)
    again = memo.check(host_idx.clone(), device_idx.clone(), host_slots=pool.size, device_slots=64, page_size=P)
    assert again is first  # equal values in new tensors: a hit
    expected = [t.clone() for t in device.tensors()]
    device_idx += 4 * P  # same tensor object, new pages 8 and 9
    for layer in range(3):
        pool.load_to_device_per_layer(device, host_idx, device_idx, layer, "direct")
    for before, after in zip(expected, device.tensors()):
        assert torch.equal(after[8 * P : 10 * P], before[4 * P : 6 * P])
    with pytest.raises(TransferError, match="device_indices out of range"):
        device_idx += 64  # still the same object, now out of range: checked again
        pool.load_to_device_per_layer(device, host_idx, device_idx, 0, "direct")
    pool.destroy()


def test_destroy_waits_for_asynchronous_cuda_copies_first(monkeypatch):
    """CUDA transfers are asynchronous: destroy synchronizes every device before unpinning."""
    calls = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda index: calls.append(("sync", index)))
    pool, device = make("mha", "layer_first", pin_memory=True, runtime=FakeRuntime())
    device.device = "cuda:0"  # as if the device pool lived on a GPU
    release = pool.registration.release
    monkeypatch.setattr(pool.registration, "release", lambda: calls.append("release") or release())
    pool.destroy()
    assert calls == [("sync", 0), ("sync", 1), "release"]
    cpu_pool, _ = make("mha", "layer_first")
    calls.clear()
    cpu_pool.destroy()
    assert calls == []  # a CPU pool has nothing in flight


def test_sizing_uses_ceil_pages_and_decimal_gb():
    """host_size is decimal GB; a page-aligned token count gets no extra page."""
    pool, device = make("mha", "page_first")
    assert pool.size == 2 * device.size and pool.page_num == 2 * device.size // P
    pool.destroy()
    sized, _ = make("mha", "page_first", page_num=None)
    sized.destroy()
    per_token = 2 * 3 * 2 * 8 * 2
    gb_pool = MHATokenToKVPoolHost(_mha(), 0, 0.001, P, "page_first", False, "cpu", host=HostSetup(limits=LIMITS, machine=ROOMY))
    assert gb_pool.page_num == -(-(10**6 // per_token) // P)
    gb_pool.destroy()


def test_host_smaller_than_device_is_a_warning(caplog):
    """A ratio below 1 logs a warning and builds the pool anyway."""
    device = _mha()
    pool = MHATokenToKVPoolHost(device, 0.5, 0, P, "page_first", False, "cpu", host=HostSetup(limits=LIMITS, machine=ROOMY))
    assert "smaller than the device pool" in caplog.text
    pool.destroy()


def test_refused_budget_is_a_capacity_error_before_allocating():
    """A pool bigger than the host's memory fails with GB figures; nothing is mapped."""
    with pytest.raises(CapacityError, match=r"GB"):
        MHATokenToKVPoolHost(_mha(), 2.0, 0, P, "page_first", False, "cpu", host=HostSetup(limits=LIMITS, host_memory_bytes=10))


def test_pinning_registers_every_buffer_as_one_transaction():
    """pin_memory registers all buffers through the runtime; destroy unregisters and frees."""
    runtime, ledger = FakeRuntime(), HostLedger()
    pool, _ = make("asymmetric", "page_first_direct", pin_memory=True, runtime=runtime, ledger=ledger)
    assert pool.registration.status().state == "active"
    assert {b for b, _ in runtime.held()} >= {pool.buffers[0].data_ptr(), pool.buffers[1].data_ptr()}
    pool.destroy()
    assert runtime.held() == set() and ledger.held() == ()
    pool.destroy()  # idempotent


def test_a_failing_third_buffer_leaves_nothing_registered_or_mapped(monkeypatch):
    """Mamba with three state buffers: the third fails, all roll back, all memory is unmapped."""
    from hicache.pools import HostTensorAllocator

    made = []
    original, unfaulted = HostTensorAllocator.allocate, HostTensorAllocator.allocate_unfaulted

    def tracking(self, dims, dtype, device="cpu", pin_memory=False):
        made.append(self)
        return original(self, dims, dtype, device, pin_memory)

    def tracking_unfaulted(self, dims, dtype):  # the pipelined bring-up's way in
        made.append(self)
        return unfaulted(self, dims, dtype)

    monkeypatch.setattr(HostTensorAllocator, "allocate", tracking)
    monkeypatch.setattr(HostTensorAllocator, "allocate_unfaulted", tracking_unfaulted)
    device = MambaDevicePool(size=16, layer_num=3, temporal_shape=(2, 4), conv_shapes=((3, 2), (5,)), page_size=1)
    probe = MambaPoolHost(device, 2.0, 0, False, "cpu", layout="page_first", host=HostSetup(limits=LIMITS, machine=ROOMY))
    counts = [b.plan.call_count for b in probe.pool_plan.buffers]
    assert len(counts) == 3
    probe.destroy()
    made.clear()
    runtime, ledger = FakeRuntime(fail_register={counts[0] + counts[1]: 2}), HostLedger()
    with pytest.raises(ApplyError, match="conv1"):
        MambaPoolHost(device, 2.0, 0, True, "cpu", layout="page_first", host=HostSetup(limits=LIMITS, runtime=runtime, ledger=ledger, machine=ROOMY))
    assert runtime.held() == set() and ledger.held() == ()
    assert made and all(allocator.buffers == [] for allocator in made)  # every buffer unmapped


def test_destroy_keeps_memory_a_failed_release_left_registered():
    """If an unregister fails, destroy raises and does not free the memory behind it."""
    from hicache.effects._host._memory import QUARANTINE
    from hicache.errors import ReleaseError

    runtime, ledger = FakeRuntime(fail_unregister={0: 1}), HostLedger()
    pool, _ = make("mla", "page_first", pin_memory=True, runtime=runtime, ledger=ledger)
    with pytest.raises(ReleaseError, match="must not be unmapped"):
        pool.destroy()
    buffer = pool.allocator.buffers[0]
    assert not buffer.freed and buffer in QUARANTINE  # kept mapped even after the pool dies


@pytest.mark.parametrize(
    "call, pattern",
    [
        (lambda p, d: p.load_to_device_per_layer(d, torch.arange(4.0), torch.arange(4), 0, "direct"), "1-D int64 or int32"),
        (lambda p, d: p.load_to_device_per_layer(d, torch.arange(4), torch.arange(8), 0, "direct"), "has 4 entries but device_indices has 8"),
        (lambda p, d: p.load_to_device_per_layer(d, torch.arange(4), torch.arange(4), 7, "direct"), r"layer_id 7 out of range \[0, 3\)"),
        (lambda p, d: p.load_to_device_per_layer(d, torch.arange(4), torch.arange(4), 0, "kernel_ascend"), "supported: direct/layer_first"),
        (lambda p, d: p.backup_from_device_all_layer(d, torch.tensor([10**6]), torch.tensor([1]), "direct"), "host_indices out of range"),
        # negative indices would wrap (torch indexing counts from the end): a copy to the wrong slot
        (lambda p, d: p.backup_from_device_all_layer(d, torch.tensor([-1]), torch.tensor([1]), "direct"), r"host_indices out of range \[0, \d+\): min -1"),
        (lambda p, d: p.backup_from_device_all_layer(d, torch.tensor([1]), torch.tensor([-1]), "direct"), r"device_indices out of range \[0, \d+\): min -1"),
        (lambda p, d: p.load_to_device_per_layer(d, torch.tensor([0, -4]), torch.tensor([1, 2]), 0, "direct"), "host_indices out of range"),
        (lambda p, d: p.backup_from_device_all_layer(d, [0, 1], torch.tensor([1, 2]), "direct"), "must be a torch tensor"),
        (lambda p, d: p.get_data_page(10**6), "page index"),
        # a negative page index would wrap to the last page (torch counts from the end): a silent overwrite
        (lambda p, d: p.get_data_page(-1), r"page index -1 out of range \[0, \d+\)"),
        (lambda p, d: p.get_data_page(-P), r"page index -4 out of range"),
        (lambda p, d: p.set_from_flat_data_page(-P, p.get_dummy_flat_data_page()), r"page index -4 out of range"),
        (lambda p, d: p.get_data_page(p.size), r"page index \d+ out of range"),
        (lambda p, d: p.set_from_flat_data_page(torch.tensor(p.size), p.get_dummy_flat_data_page()), "out of range"),
        (lambda p, d: p.alloc(3), "not a multiple of the page size"),
        (lambda p, d: p.free(torch.tensor([1, 2, 3, 4])), "page-aligned runs"),
        # a device pool of another family (no k_buffer), or one whose layer is not a tensor of slots
        (lambda p, d: p.load_to_device_per_layer(SimpleNamespace(kv_buffer=d.k_buffer), torch.arange(4),
                                                 torch.arange(4), 0, "direct"),
         "has no layer 0, buffer 0, K tensor this host pool copies .AttributeError"),
        (lambda p, d: p.backup_from_device_all_layer(SimpleNamespace(k_buffer=[[0.0] * 8] * 3, v_buffer=d.v_buffer),
                                                     torch.arange(4), torch.arange(4), "direct"),
         "layer 0, buffer 0, K of the device pool is not a tensor of slots: list"),
    ])
def test_bad_input_is_a_clear_error(call, pattern):
    """Wrong dtypes, lengths, layers, backends, ranges and unaligned sizes are named."""
    pool, device = make("mha", "layer_first")
    with pytest.raises((TransferError, PlanError), match=pattern):
        call(pool, device)
    pool.destroy()


@pytest.mark.parametrize("name, layout", [("mha", "page_first_direct"), ("mha", "layer_first"), ("mla", "page_first"),
                                          ("asymmetric", "page_first"), ("mamba", "page_first")])
def test_a_flat_page_of_the_wrong_size_is_refused_and_nothing_is_copied(name, layout):
    """set_from_flat_data_page (issue #35 item 3's fast path): a page one element short or one
    long, of another dtype, or something that is no tensor, is a TransferError naming the sizes
    (or dtypes) and leaves the pool's bytes as they were; a page of the right count but strides
    no view can take (a transposed tensor) is copied as SGLang's reshape does, element order kept."""
    pool, _ = make(name, layout)
    try:
        for buffer in pool.buffers:
            buffer.view(torch.uint8).random_(0, 255, generator=torch.Generator().manual_seed(7))
        before = [b.clone() for b in pool.buffers]
        same = lambda: all(torch.equal(a.view(torch.uint8), b.view(torch.uint8)) for a, b in zip(before, pool.buffers))
        page = pool.get_dummy_flat_data_page()
        total = page.numel()
        for wrong in (torch.ones(total - 1, dtype=page.dtype), torch.ones(total + 1, dtype=page.dtype)):
            with pytest.raises(TransferError, match=f"data_page has {wrong.numel()} elements; a page has {total}"):
                pool.set_from_flat_data_page(P, wrong)
        with pytest.raises(TransferError, match="data_page must be a tensor, got list"):
            pool.set_from_flat_data_page(P, [0] * total)
        other = torch.float64 if page.dtype != torch.float64 else torch.float32  # right count, wrong dtype:
        with pytest.raises(TransferError, match=f"data_page is {other}; a page of this pool is {page.dtype}"):
            pool.set_from_flat_data_page(P, torch.ones(total, dtype=other))  # it would convert, not copy
        assert same(), "a refused page was copied"
        source = pool.get_data_page(0).clone()
        assert total % 2 == 0
        strided = source.reshape(2, -1).t().contiguous().t()  # the right elements, strides no view can take
        assert not strided.is_contiguous() and torch.equal(strided.reshape(-1).view(torch.uint8), source.view(torch.uint8))
        pool.set_from_flat_data_page(P, strided)
        assert torch.equal(pool.get_data_page(P).view(torch.uint8), source.view(torch.uint8))
    finally:
        pool.destroy()


def test_pages_follow_a_replaced_kv_buffer_not_the_one_they_were_first_cut_from():
    """The page path caches how a page sits in the buffers (issue #35 item 3); a kv_buffer put in
    its place (as code that swaps a pool's tensor does) is the one read and written after, not
    the tensor the cache was derived from."""
    pool, _ = make("mha", "page_first_direct")
    original = pool.kv_buffer
    try:
        pool.get_data_page(P)  # the geometry is derived and cached here
        replacement = torch.full_like(original, 3)
        pool.kv_buffer = replacement
        assert torch.equal(pool.get_data_page(P), torch.full_like(pool.get_data_page(P), 3))
        pool.set_from_flat_data_page(2 * P, torch.full_like(pool.get_dummy_flat_data_page(), 5))
        assert torch.equal(replacement[:, 2].reshape(-1), torch.full_like(replacement[:, 2].reshape(-1), 5))
    finally:
        pool.kv_buffer = original
        pool.destroy()


@pytest.mark.parametrize("name", ["mha", "mla"])
def test_zero_copy_pointers_only_for_indices_that_start_a_page(name):
    """`get_page_buffer_meta` hands out raw pointers a back end reads or writes a whole page at:
    an index inside a page (or before the first, or past the last) is an error, never a pointer
    into the middle of a page or outside the buffer."""
    pool, _ = make(name, "page_first")
    try:
        ptrs, sizes = pool.get_page_buffer_meta(torch.arange(P, 2 * P))
        assert ptrs and all(size > 0 for size in sizes)
        last = list(range(pool.size - P, pool.size))  # the last page is the pool's: accepted
        for dtype in (torch.int64, torch.int32):  # an index tensor takes the vectorized path
            assert pool.get_page_buffer_meta(torch.tensor(last, dtype=dtype)) == pool.get_page_buffer_meta(last)
        for bad in ([1, 2, 3, 4], [P + 1] * P, [-P] * P, [pool.size] * P, [0] * P + [pool.size] * P,
                    [-P] * P + [0] * P, [0] * P + [P + 2] * P):
            for form in (bad, torch.tensor(bad), torch.tensor(bad, dtype=torch.int32)):
                with pytest.raises(TransferError):
                    pool.get_page_buffer_meta(form)
    finally:
        pool.destroy()


@pytest.mark.parametrize("name", ["mha", "mla"])
def test_zero_copy_pointers_follow_a_replaced_kv_buffer(name):
    """A `kv_buffer` replaced after pointers were handed out (a new tensor; Mooncake, NIXL and 3FS
    read and write at them): the next `get_page_buffer_meta` points into the new tensor, never the
    old one - whether or not the new tensor happens to reuse the old one's id()."""
    pool, _ = make(name, "page_first")
    original = pool.kv_buffer
    try:
        before, _ = pool.get_page_buffer_meta(torch.arange(P, 2 * P))
        replacement = original.clone()
        pool.kv_buffer = replacement
        after, _ = pool.get_page_buffer_meta(torch.arange(P, 2 * P))
        start = replacement.data_ptr()
        end = start + replacement.untyped_storage().nbytes()
        assert after != before and all(start <= ptr < end for ptr in after)
        pool._pointers.kinds = (id(original), pool._pointers.kinds[1])  # the replacement's pointers, under an id() that came back
        pool.kv_buffer = original
        again, _ = pool.get_page_buffer_meta(torch.arange(P, 2 * P))
        assert again == before
    finally:
        pool.kv_buffer = original
        pool.destroy()


@pytest.mark.parametrize("name, layout", [(name, layout) for name in ("mha", "mla", "asymmetric")
                                          for layout in ("page_first", "page_first_direct", "layer_first")
                                          if (name, layout) != ("asymmetric", "layer_first")])  # none such
def test_zero_copy_pointers_of_an_index_tensor_are_the_plain_paths(name, layout):
    """The vectorized path for index tensors answers exactly as the checked plain path for
    lists does, page for page, for any valid set of pages in any order (the plain path is the
    oracle: a break of either shows as a difference)."""
    import random

    pool, _ = make(name, layout)
    try:
        chooser = random.Random(31)
        pages = pool.size // P
        for _ in range(20):
            chosen = chooser.sample(range(pages), chooser.randint(1, pages))
            tokens = [page * P + offset for page in chosen for offset in range(P)]
            assert pool.get_page_buffer_meta(torch.tensor(tokens)) == pool.get_page_buffer_meta(tokens), chosen
    finally:
        pool.destroy()


def test_unsupported_layout_lists_the_supported_ones():
    """A layout the family does not support is a LayoutError listing the others."""
    with pytest.raises(LayoutError, match="supported: page_first, page_first_direct"):
        make("asymmetric", "layer_first")


def test_dsa_needs_whole_pages():
    """The DSA indexer moves page rows: unaligned slots are refused, not half-copied."""
    pool, device = make("dsa", "page_first")
    with pytest.raises(TransferError, match="whole pages"):
        pool.backup_from_device_all_layer(device, torch.arange(1, 5), torch.arange(4, 8), "direct")
    pool.destroy()


def test_deepseek_v4_state_pool_has_no_allocator():
    """alloc/free on the V4 state pool raise a clear error: it reuses the SWA pool's indices."""
    pool, _ = make("v4_state", "page_first")
    with pytest.raises(RegistrationStateError, match="no allocator of its own"):
        pool.alloc(P)
    with pytest.raises(RegistrationStateError, match="no allocator of its own"):
        pool.free(torch.arange(P))
    pool.destroy()


def test_storage_backend_names_get_the_default_allocator_unless_strict():
    """SGLang passes --hicache-storage-backend as allocator_type: unknown names (and None) get
    the default allocator; strict_allocator=True makes them an error; a fallback can be named."""
    for backend in (None, "hf3fs", "mooncake"):
        pool, _ = make("mha", "page_first", allocator_type=backend)
        assert type(pool.allocator).__name__ == "HostTensorAllocator"
        pool.destroy()
    with pytest.raises(PlanError, match="unknown allocator_type 'hf3fs'"):
        make("mha", "page_first", allocator_type="hf3fs", strict_allocator=True)
    pool, _ = make("mha", "page_first", allocator_type="hf3fs", allocator_fallback="torch")
    assert type(pool.allocator).__name__ == "TorchHostTensorAllocator"
    pool.destroy()


def test_dsa_indexer_follows_its_anchor():
    """With an anchor pool the indexer has SGLang's (tokens + page + 1) // page pages; a page size
    that cannot size it is a LayoutError naming it, before any memory."""
    anchor, _ = make("mla", "page_first")
    pool, _ = make("dsa", "page_first", anchor_pool=anchor)
    assert pool.page_num == (anchor.size + P + 1) // P
    pool.destroy()
    cls, device = FAMILIES["dsa"]
    with pytest.raises(LayoutError, match=r"DSAIndexerPoolHost.*page_size.*0"):  # sized by it: checked first
        cls(device(), 2.0, 0, 0, "page_first", anchor_pool=anchor, **doors(limits=LIMITS, machine=ROOMY))
    anchor.destroy()


def test_hisparse_rows_grow_by_whole_pages():
    """alloc_paged_token_slots grows a request's row by pages and fails clearly when short."""
    pool, _ = make("mla", "page_first")
    table = torch.full((2, 64), -1, dtype=torch.int64)
    held = torch.zeros(2, dtype=torch.int64)
    slots = pool.alloc_paged_token_slots(table, held, 0, 0, 5)
    assert slots.numel() == 5 and int(held[0]) == 2 * P
    again = pool.alloc_paged_token_slots(table, held, 0, 2, 3)  # inside what it holds
    assert int(held[0]) == 2 * P and torch.equal(again, table[0, 2:5])
    assert pool.allocated_host_indices(table, 0, 5).numel() == 2 * P  # SGLang's argument order
    assert pool.allocated_host_indices(table, 1, 0).numel() == 0
    assert pool.alloc_paged_token_slots(table, held, 1, 3, 0).numel() == 0  # nothing asked: empty
    assert pool._round_up_to_page_size(5) == 8
    pool.alloc(pool.available_size())
    assert pool.alloc_page(1) is None  # short: None, as SGLang's alloc
    with pytest.raises(RuntimeError, match="out of host pages"):  # as SGLang's callers catch it
        pool.alloc_paged_token_slots(table, held, 1, 0, 3)
    assert int(held[1]) == 0 and (table[1] == -1).all()  # nothing half-done
    pool.destroy()


def test_host_kv_cache_is_abstract():
    """HostKVCache cannot be built without a family."""
    with pytest.raises(TypeError):
        HostKVCache(_mha(), 2.0, 0, P, "page_first", False, "cpu")


def test_a_failure_after_registration_releases_and_frees(monkeypatch):
    """If the pool cannot finish (its page allocator fails), nothing stays pinned or mapped."""
    from hicache.pools import _base

    def broken(*args):
        raise MemoryError("page allocator")

    monkeypatch.setattr(_base, "PageAllocator", broken)
    runtime, ledger = FakeRuntime(), HostLedger()
    with pytest.raises(MemoryError, match="page allocator"):
        make("mha", "page_first_direct", pin_memory=True, runtime=runtime, ledger=ledger)
    assert runtime.cudart.register_calls > 0 and runtime.held() == set() and ledger.held() == ()


def test_a_failed_budget_record_allocates_and_registers_nothing(monkeypatch):
    """The budget entry is written before any memory exists: a failure there leaves nothing."""
    from hicache.effects._hostwide import _lock
    def broken(self, nbytes):
        raise OSError("disk full")

    monkeypatch.setattr(_lock.BudgetLock, "record", broken)
    runtime, ledger = FakeRuntime(), HostLedger()
    with pytest.raises(OSError, match="disk full"):
        make("mha", "page_first_direct", pin_memory=True, runtime=runtime, ledger=ledger)
    assert runtime.cudart.register_calls == 0 and runtime.held() == set() and ledger.held() == ()


@pytest.mark.parametrize("layout", ["layer_first", "page_first_direct"])
def test_the_per_layer_fast_path_notices_every_change(layout):
    """Reused transfers: the same layer loaded again after the indices changed in place, after
    new equal-valued index tensors, and after the device pool swapped a layer's tensor - each
    copies exactly what a fresh transfer would (compared with torch indexing)."""
    pool, device = make("mha", layout)
    device.randomize(7)
    host_idx = pool.alloc(4 * P)
    pool.backup_from_device_all_layer(device, host_idx, torch.arange(1 * P, 5 * P), "direct")
    device_idx = torch.arange(8 * P, 12 * P)

    def load_and_check(layer, idx):
        for t in device.tensors():
            t.zero_()
        pool.load_to_device_per_layer(device, host_idx, idx, layer, "direct")
        for name in ("k_buffer", "v_buffer"):
            got = getattr(device, name)[layer][idx]
            assert got.count_nonzero() > 0, (layer, name)  # something arrived, at exactly idx
            others = torch.ones(getattr(device, name)[layer].shape[0], dtype=torch.bool)
            others[idx] = False
            assert getattr(device, name)[layer][others].count_nonzero() == 0

    load_and_check(0, device_idx)
    load_and_check(0, device_idx)  # reused
    device_idx += 4 * P  # in place: pages 12..15 now
    load_and_check(0, device_idx)
    load_and_check(1, device_idx.clone())  # equal values, new object
    old = device.k_buffer[1]
    device.k_buffer[1] = torch.zeros_like(old)  # the device pool reallocated layer 1's K
    old.zero_()
    load_and_check(1, device_idx)  # into the new tensor ...
    assert old.count_nonzero() == 0  # ... and not into the one the cached copy was built for
    pool.destroy()


def test_a_shorter_later_layer_or_v_tensor_is_refused_not_overrun():
    """Bounds are checked against every tensor a copy touches, not layer 0's K only."""
    pool, device = make("mha", "page_first_direct")
    host_idx = pool.alloc(2 * P)
    device_idx = torch.arange(12 * P, 14 * P)  # inside layer 0's K (64 + 4 slots)
    device.v_buffer[2] = device.v_buffer[2][: 8 * P].clone()  # a short V tensor in layer 2
    before = [t.clone() for t in device.tensors()]
    with pytest.raises(TransferError, match=r"layer 2, buffer 0, V: a block reaches byte"):
        pool.load_to_device_per_layer(device, host_idx, device_idx, 2, "direct")
    with pytest.raises(TransferError, match=r"layer 2, buffer 0, V"):
        pool.backup_from_device_all_layer(device, host_idx, device_idx, "direct")
    assert all(torch.equal(a, b) for a, b in zip(before, device.tensors()))  # nothing copied
    pool.destroy()


def test_a_device_tensor_shrunk_in_place_is_noticed():
    """The same tensor object re-pointed at a shorter storage (``set_``): cached copy plans
    are rebuilt and the now out-of-range copy is refused, never written to the old address."""
    pool, device = make("mha", "page_first_direct")
    host_idx = pool.alloc(2 * P)
    device_idx = torch.arange(12 * P, 14 * P)
    pool.load_to_device_per_layer(device, host_idx, device_idx, 2, "direct")  # plans cached
    v = device.v_buffer[2]
    v.set_(v[: 8 * P].clone())  # same object: new, shorter storage
    with pytest.raises(TransferError, match=r"layer 2, buffer 0, V"):
        pool.load_to_device_per_layer(device, host_idx, device_idx, 2, "direct")
    pool.destroy()


def _mismatched_device(kind):
    device = MHADevicePool(size=64, layer_num=3, head_num=2, head_dim=8, page_size=P)
    if kind == "a later layer of another dtype":
        device.k_buffer[2] = device.k_buffer[2].to(torch.float32)
    elif kind == "fewer layers":
        device = MHADevicePool(size=64, layer_num=2, head_num=2, head_dim=8, page_size=P)
    elif kind == "more heads":
        device = MHADevicePool(size=64, layer_num=3, head_num=4, head_dim=8, page_size=P)
    elif kind == "another family":
        device = MLADevicePool(size=64, layer_num=3, kv_lora_rank=12, qk_rope_head_dim=4, page_size=P)
    for tensor in [*getattr(device, "k_buffer", []), *getattr(device, "v_buffer", []), *getattr(device, "kv_buffer", [])]:
        tensor.fill_(7)
    return device


@pytest.mark.parametrize("layout", ["layer_first", "page_first", "page_first_direct"])
@pytest.mark.parametrize("kind", ["a later layer of another dtype", "fewer layers", "more heads", "another family"])
def test_a_device_pool_that_does_not_match_is_refused_before_any_byte_moves(layout, kind):
    """Every device tensor of a transfer is checked (dtype, elements per slot, the layer exists,
    the family's buffers exist) before the first copy: a clear TransferError, and neither the host
    pool (backup) nor the device pool (load) changed - a float32 layer 2 once left layers 0-1
    backed up in page_first."""
    pool, _ = make("mha", layout)
    try:
        device = _mismatched_device(kind)
        host_indices = pool.alloc(2 * P)
        host_before = [b.clone() for b in (pool.kv_buffer if isinstance(pool.kv_buffer, list) else [pool.kv_buffer])]
        with pytest.raises(TransferError, match="nothing was copied"):
            pool.backup_from_device_all_layer(device, host_indices, torch.arange(P, 3 * P), "direct")
        host_after = pool.kv_buffer if isinstance(pool.kv_buffer, list) else [pool.kv_buffer]
        assert all(torch.equal(a, b) for a, b in zip(host_before, host_after))
        device_before = [t.clone() for t in getattr(device, "k_buffer", getattr(device, "kv_buffer", []))]
        layer = 2 if kind in ("a later layer of another dtype", "fewer layers") else 0  # the one that differs
        with pytest.raises(TransferError, match="nothing was copied"):
            pool.load_to_device_per_layer(device, host_indices, torch.arange(P, 3 * P), layer, "direct")
        assert all(torch.equal(a, b) for a, b in zip(device_before, getattr(device, "k_buffer", getattr(device, "kv_buffer", []))))
    finally:
        pool.destroy()


def test_sglangs_numbers_of_any_real_type_are_read_and_others_named():
    """What SGLang passes may be numpy or torch scalars: an np.float32 ratio and an np.int64
    layer id work as their Python values; a string host_size or a fractional dimension is a clear
    error naming the field - never a comparison error or a silently truncated shape."""
    import numpy as np

    from hicache.compat import sglang as compat

    device = MHADevicePool(size=64, layer_num=3, head_num=2, head_dim=8, page_size=P)
    pool = MHATokenToKVPoolHost(device, np.float32(2.0), 0, P, "layer_first", False, "cpu", host=HostSetup(limits=LIMITS, machine=ROOMY))
    try:
        plain, _ = make("mha", "layer_first")
        assert pool.size == plain.size
        plain.destroy()
        host_indices = pool.alloc(P)
        pool.load_to_device_per_layer(device, host_indices, torch.arange(P, 2 * P), np.int64(1), "direct")
        with pytest.raises(TransferError, match="layer_id must be an integer, got 1.0"):
            pool.load_to_device_per_layer(device, host_indices, torch.arange(P, 2 * P), 1.0, "direct")
    finally:
        pool.destroy()
    with pytest.raises(PlanError, match=r"host_size must be a finite number of GB .* got '2'"):
        MHATokenToKVPoolHost(device, 2.0, "2", P, "layer_first", False, "cpu", host=HostSetup(limits=LIMITS, machine=ROOMY))
    with pytest.raises(TypeError, match=r"dims must be integers, got \(2.5, 1024\)"):
        compat.alloc_with_host_register((2.5, 1024), torch.uint8, "cpu", False, compat.HostTensorAllocator())


def _mapping_of(ptr: int) -> str | None:
    """The range (``low-high``, /proc/self/maps) of the mapping that covers ``ptr``, or None."""
    with open("/proc/self/maps") as maps:
        for line in maps:
            low, high = (int(x, 16) for x in line.split()[0].split("-"))
            if low <= ptr < high:
                return line.split()[0]
    return None


@pytest.mark.parametrize("name, layout", [("mha", "page_first"), ("mla", "layer_first"), ("mamba", "page_first")])
def test_destroy_unmaps_the_memory_at_once_while_the_pool_object_lives_on(name, layout):
    """destroy() returns the pool's memory to the system before it returns, even while the pool
    object itself is still referenced and the garbage collector has not run (a kept view of the
    buffers once deferred the unmap to the pool's death: 4.3 GB per pool stayed resident)."""
    import gc

    gc.disable()
    try:
        pool, device = make(name, layout)
        device.randomize(1)
        host_idx = _slots(pool, 2)
        pool.backup_from_device_all_layer(device, host_idx, torch.arange(host_idx.numel()), "direct")
        ptrs = [b.data_ptr() for b in pool.buffers]
        before = {p: _mapping_of(p) for p in ptrs}
        assert None not in before.values()
        pool.destroy()
        # no mapping is still the one each buffer lived in (the freed range itself may be reused)
        assert all(_mapping_of(p) != before[p] for p in ptrs)
    finally:
        gc.enable()


@pytest.mark.parametrize("name, layout", CASES)
@pytest.mark.parametrize("pinned, progressive", [(False, False), (True, False), (True, True)])
def test_destroy_gives_every_buffer_back_in_parallel_pieces_not_by_a_late_unmap(name, layout, pinned, progressive,
                                                                                monkeypatch):
    """destroy() frees each buffer through the parallel release (`give_back`, issue #53 item 3),
    even after transfers, flat L3 pages and zero-copy pointers cached what they use of it: the pool drops its own views once the memory is
    unregistered and before it is freed (they once left every pool's unmap to the last view's
    death - one thread, munmap alone - so a pool never released in parallel)."""
    from hicache.effects._host import _release

    given, ranges = [], {}
    # the mapping each buffer lived in, read as its pages are given back (just before its unmap):
    # after destroy no mapping may still be that one. (Any mapping covering the address would not
    # do: the freed range is soon reused - ASan's allocator does at once.)
    monkeypatch.setattr(_release, "give_back",
                        lambda ptr, length: (given.append(ptr), ranges.setdefault(ptr, _mapping_of(ptr))))
    pool, device = make(name, layout, pin_memory=pinned, progressive=progressive, runtime=FakeRuntime())
    device.randomize(1)
    assert not progressive or pool.wait_ready(timeout=30)
    host_idx = _slots(pool, 2)
    device_idx = torch.arange(host_idx.numel()) + (0 if name == "mamba" else P)
    pool.backup_from_device_all_layer(device, host_idx, device_idx, "direct")
    pool.load_to_device_per_layer(device, host_idx, device_idx, 0, "direct")
    first, second = int(host_idx[0]), int(host_idx[pool.page_size])  # the L3 page path caches its patterns
    pool.set_from_flat_data_page(second, pool.get_data_page(first, flat=True))
    if name in ("mha", "mla"):  # and the zero-copy pointers theirs
        pool.get_page_buffer_meta(host_idx[: pool.page_size])
    ptrs = sorted(b.data_ptr() for b in pool.buffers if b.numel())
    pool.destroy()
    assert sorted(given) == ptrs and all(ranges[p] is not None for p in ptrs)
    assert all(_mapping_of(p) != ranges[p] for p in ptrs), "a buffer stayed mapped after destroy()"
