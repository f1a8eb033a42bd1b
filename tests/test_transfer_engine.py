"""The transfer engine (issue #52): the GPU's gather kernel - run here through Triton's
interpreter on CPU tensors, and through its torch fallback - copies exactly the pieces it is
given in every word size; the engine table picks as measured; every family x layout serves
SGLang's `kernel` io backend through it with the same bytes as the copy engine's path."""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from hicache.effects import CopyEngine
from hicache.effects._copy._gather import GatherCopy, _translate, check_registered, word_bytes
from hicache.errors import TransferError
from hicache.plan._transfer import ENGINE_TABLE, MiB, choose_engine

from machine import ROOMY
from test_pool_layout_oracle import LIMITS, mha_host_element
from test_pools import CASES, FAMILIES, _slots, make, round_trip

from hicache.pools import MHATokenToKVPoolHost
from hicache.testing import MHADevicePool
from hicache.effects import HostSetup

from triton_support import require_interpreter

torch = pytest.importorskip("torch")
RUNNERS = ["triton", "torch"]


def _runner(runner: str) -> str:
    if runner == "triton":
        require_interpreter()
    return runner


@st.composite
def pieces(draw):
    """Non-overlapping destination pieces and arbitrary source pieces over 4 KiB buffers, all
    of one alignment (1, 2, 4 or 8 bytes), as a caller's checked descriptors are."""
    align = draw(st.sampled_from([1, 2, 4, 8]))
    count = draw(st.integers(1, 12))
    slots = sorted(draw(st.lists(st.integers(0, 4096 // 128 - 1), min_size=count, max_size=count, unique=True)))
    sizes = [draw(st.integers(1, 128 // align)) * align for _ in slots]
    dsts = [slot * 128 for slot in slots]
    srcs = [draw(st.integers(0, (4096 - size) // align)) * align for size in sizes]
    order = draw(st.permutations(range(count)))
    return [dsts[i] for i in order], [srcs[i] for i in order], [sizes[i] for i in order]


@pytest.mark.parametrize("runner", RUNNERS)
@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(case=pieces(), offset=st.sampled_from([0, 1, 2, 4, 8]))
def test_the_gather_copies_exactly_its_pieces(runner, case, offset):
    """Every piece lands byte for byte and nothing else changes (the oracle: Python slices),
    whatever the word size the pieces allow."""
    dsts, srcs, sizes = case
    src = torch.randint(0, 256, (4096 + 16,), dtype=torch.uint8, generator=torch.Generator().manual_seed(len(dsts)))
    dst = torch.randint(0, 256, (4096 + 16,), dtype=torch.uint8, generator=torch.Generator().manual_seed(7))
    expected = dst.clone()
    for d, s, n in zip(dsts, srcs, sizes):
        expected[offset + d: offset + d + n] = src[offset + s: offset + s + n]
    part = (torch.tensor(dsts), torch.tensor(srcs), torch.tensor(sizes), sum(sizes),
            dst.data_ptr() + offset, src.data_ptr() + offset)
    batch = GatherCopy([part], None, programs=3, runner=_runner(runner))
    assert batch.run() in ("gather-interpreted", "gather-torch")
    assert torch.equal(dst, expected)


@pytest.mark.parametrize("runner", RUNNERS)
def test_a_batch_of_no_bytes_launches_nothing(runner):
    """No parts, or parts of no bytes (a transfer of zero pages): nothing runs, nothing changes."""
    dst = torch.zeros(64, dtype=torch.uint8)
    nothing = (torch.tensor([0]), torch.tensor([0]), torch.tensor([0]), 0, dst.data_ptr(), dst.data_ptr() + 8)
    for parts in ([], [nothing]):
        batch = GatherCopy(parts, None, programs=3, runner=_runner(runner))
        assert batch.count == 0 and batch.run() == "empty"
    assert not bool(dst.any())


def test_the_word_is_the_widest_dividing_every_address_and_size():
    """8 when all are multiples of 8; one odd address or size narrows it."""
    t = lambda *v: torch.tensor(v)  # noqa: E731
    assert word_bytes(t(8, 16), t(0, 64), t(8, 8)) == 8
    assert word_bytes(t(8, 20), t(0, 64), t(8, 8)) == 4
    assert word_bytes(t(8, 16), t(0, 64), t(8, 6)) == 2
    assert word_bytes(t(8, 16), t(1, 64), t(8, 8)) == 1


@pytest.mark.parametrize("rule", ENGINE_TABLE, ids=lambda r: f"{r.direction}-{r.min_piece}")
def test_each_table_row_decides_its_own_pieces(rule):
    """A batch inside a row's piece range goes to that row's engine, with its reason."""
    choice = choose_engine(rule.direction, rule.min_piece, on_gpu=True)
    assert (choice.engine, choice.reason) == (rule.engine, rule.reason)


@settings(max_examples=200, deadline=None)
@given(direction=st.sampled_from(["load", "backup"]),
       piece=st.one_of(st.integers(0, 4 * MiB), st.sampled_from([0, 1, 64 * 2**10 - 1, 64 * 2**10, 2**62])))
def test_every_piece_size_of_each_direction_lies_in_exactly_one_row(direction, piece):
    """The table's law: per direction its rows cover every mean piece size from 0 up, none twice -
    so `choose_engine` always has one answer, and that row's."""
    rows = [rule for rule in ENGINE_TABLE if rule.direction == direction and rule.min_piece <= piece
            and (rule.max_piece is None or piece < rule.max_piece)]
    assert len(rows) == 1
    assert choose_engine(direction, piece, on_gpu=True) == (rows[0].engine, rows[0].reason)


def test_a_direction_that_is_neither_is_refused_naming_it():
    """A direction other than load or backup is a ValueError naming it, whatever the setting."""
    for setting in ("auto", "dma", "gather"):
        with pytest.raises(ValueError, match="direction must be one of .*got 'upload'"):
            choose_engine("upload", 4096, on_gpu=True, setting=setting)


def test_the_setting_and_the_machine_override_the_table():
    """HICACHE_TRANSFER forces an engine; host memory on both sides is a host copy unless
    gather is asked for; no gather here means the copy engine."""
    assert choose_engine("load", 2048, on_gpu=True).engine == "gather"
    assert choose_engine("load", 128 * 2**10, on_gpu=True).engine == "dma"
    assert choose_engine("load", 2048, on_gpu=True, setting="dma").engine == "dma"
    assert choose_engine("load", 4 * MiB, on_gpu=True, setting="gather").engine == "gather"
    assert choose_engine("backup", 2048, on_gpu=False).engine == "host"
    assert choose_engine("backup", 2048, on_gpu=False, setting="gather").engine == "gather"
    assert choose_engine("backup", 2048, on_gpu=True, gather_ready=False).engine == "dma"
    with pytest.raises(ValueError, match="HICACHE_TRANSFER"):
        choose_engine("load", 1, on_gpu=True, setting="fast")


def test_bad_settings_are_refused_naming_the_variable(monkeypatch):
    """HICACHE_TRANSFER=fast or HICACHE_TRANSFER_PROGRAMS=0 stops the engine's construction."""
    from hicache.errors import EnvError

    monkeypatch.setenv("HICACHE_TRANSFER", "fast")
    with pytest.raises(EnvError, match="HICACHE_TRANSFER"):
        CopyEngine()
    monkeypatch.setenv("HICACHE_TRANSFER", "gather")
    monkeypatch.setenv("HICACHE_TRANSFER_PROGRAMS", "0")
    with pytest.raises(EnvError, match="HICACHE_TRANSFER_PROGRAMS"):
        CopyEngine()
    monkeypatch.setenv("HICACHE_TRANSFER_PROGRAMS", "8")
    engine = CopyEngine()
    assert (engine.transfer, engine.programs) == ("gather", 8)


@pytest.mark.parametrize("name, layout", CASES, ids=[f"{n}-{l}" for n, l in CASES])
def test_every_family_and_layout_serves_the_kernel_backend_through_the_gather(name, layout):
    """io_backend="kernel" with the gather engine: a backup then a per-layer load of random
    pages gives the same device rows and the same host bytes as the copy engine's path."""
    results = []
    for transfer in ("gather", "auto"):
        pool, device = make(name, layout, copy_engine=CopyEngine(transfer=transfer, programs=4))
        try:
            _, host_bytes, choice = round_trip(pool, device, seed=11, pages_seed=5, pages=3, backend="kernel")
            if transfer == "gather":  # every layout, page_head's per-head pieces included
                assert choice.engine == "gather"
            results.append(host_bytes)
        finally:
            pool.destroy()
    assert all(torch.equal(a, b) for a, b in zip(*results))


def test_an_unknown_backend_is_refused_naming_the_pair_and_the_flag():
    """io_backend "kernel_ascend" on a CPU pool: a TransferError naming both backends we serve."""
    pool, device = make("mha", "page_first")
    try:
        with pytest.raises(TransferError, match="kernel_ascend.*page_first.*--hicache-io-backend"):
            pool.load_to_device_per_layer(device, torch.arange(4), torch.arange(4), 0, "kernel_ascend")
    finally:
        pool.destroy()


def test_bad_calls_through_the_gather_change_no_byte():
    """50 random bad calls (an index past the pool or negative, a short device tensor, a wrong
    dtype) with the gather engine: each a TransferError, and no host or device byte moves."""
    pool, device = make("mha", "page_first", copy_engine=CopyEngine(transfer="gather", programs=2))
    try:
        device.randomize(2)
        host_idx = _slots(pool, 2)
        good = torch.arange(2 * pool.page_size) + pool.page_size
        generator = torch.Generator().manual_seed(9)
        before = [b.clone() for b in pool.buffers], [t.clone() for t in device.tensors()]
        for trial in range(50):
            kind = trial % 4
            bad_host, bad_device, dev = host_idx, good, device
            if kind == 0:
                bad_host = host_idx.clone()
                bad_host[int(torch.randint(0, bad_host.numel(), (1,), generator=generator))] = pool.size + trial
            elif kind == 1:
                bad_device = good.clone()
                bad_device[-1] = -1 - trial
            elif kind == 2:
                dev = FAMILIES["mha"][1]()
                dev.k_buffer = [t[: pool.page_size] for t in dev.k_buffer]  # a short device tensor
            else:
                dev = FAMILIES["mha"][1]()
                dev.k_buffer = [t.float() for t in dev.k_buffer]  # another dtype
            with pytest.raises(TransferError):
                pool.backup_from_device_all_layer(dev, bad_host, bad_device, "kernel")
        after = [b.clone() for b in pool.buffers], [t.clone() for t in device.tensors()]
        assert all(torch.equal(a, b) for a, b in zip(before[0], after[0]))
        assert all(torch.equal(a, b) for a, b in zip(before[1], after[1]))
    finally:
        pool.destroy()


def test_the_doctor_names_each_layouts_engine_and_refuses_a_bad_setting():
    """`hicache doctor`'s transfer rule: the table's picks per layout, the setting's override, a
    failing check naming a bad value."""
    from hicache.cli._doctor import transfer_check

    auto = transfer_check({})
    assert auto.status == "pass" and "page_first load gather, backup gather" in auto.finding
    assert "layer_first load dma, backup gather" in auto.finding
    forced = transfer_check({"HICACHE_TRANSFER": "dma"})
    assert "page_first load dma, backup dma" in forced.finding
    bad = transfer_check({"HICACHE_TRANSFER": "warp"})
    assert bad.status == "fail" and "warp" in bad.finding


def test_the_doctor_names_what_runs_the_gather_by_what_is_installed():
    """Triton, else torch's index kernels, else (a plain install: no torch) nothing until the
    cuda extra is installed - never a fallback that is not there."""
    from hicache.cli._doctor import transfer_check

    def having(*names):
        return lambda name: name in names

    assert "through Triton" in transfer_check({}, installed=having("triton", "torch")).finding
    assert "torch's index kernels (Triton is not installed)" in transfer_check({}, installed=having("torch")).finding
    bare = transfer_check({}, installed=having())
    assert "torch's index kernels" not in bare.finding and 'torch is not installed (pip install "hicache[cuda]")' in bare.finding


def test_the_doctor_builds_the_kernel_on_a_gpu_and_warns_when_it_cannot():
    """On a GPU (the probe's facts say one) the transfer rule launches the kernel as a pool's
    build does: ready is a pass naming cuda:0; a reason is a warning naming it, the torch
    fallback and the way out; no GPU, or HICACHE_TRANSFER=dma, launches nothing."""
    from types import SimpleNamespace

    from hicache.cli._doctor import transfer_check

    asked: list = []
    gpu = SimpleNamespace(available=True)
    ready = transfer_check({}, cuda=gpu, warm=lambda device, word: asked.append((device, word)))
    assert ready.status == "pass" and "built and launched on cuda:0" in ready.finding
    assert asked == [("cuda:0", 8)]
    broken = transfer_check({}, cuda=gpu, warm=lambda device, word: "RuntimeError: ptxas has no sm_120")
    assert broken.status == "warn" and "ptxas has no sm_120" in broken.finding
    assert "torch's index kernels" in broken.finding and "HICACHE_TRANSFER=dma" in broken.hint
    transfer_check({"HICACHE_TRANSFER": "dma"}, cuda=gpu, warm=lambda device, word: asked.append(device))
    transfer_check({}, cuda=SimpleNamespace(available=False), warm=lambda device, word: asked.append(device))
    assert asked == [("cuda:0", 8)]


class _Driver:
    """cuda-python's cudaHostGetDevicePointer over a registered range [start, end) mapped at +shift."""

    def __init__(self, start: int, end: int, shift: int = 0) -> None:
        self.start, self.end, self.shift, self.drained = start, end, shift, 0

    def cudaHostGetDevicePointer(self, address, flags):  # noqa: N802 - cuda-python's name
        if self.start <= address < self.end:
            return (0, address + self.shift)
        return (1, 0)  # cudaErrorInvalidValue

    def cudaGetLastError(self):  # noqa: N802
        self.drained += 1
        return (0,)


def test_a_gather_over_unregistered_host_memory_is_refused_before_any_launch():
    """The gather asks the driver for every host range's device address first: memory outside
    every registration, or a range whose two ends are not one registration, is a TransferError;
    a registered range maps to the device's address of it."""
    driver = _Driver(0x10000, 0x20000, shift=0x1000)
    engine = CopyEngine(binding=driver)
    assert _translate(engine._host_pointer, 0x10000, 0x800) == 0x11000
    with pytest.raises(TransferError, match="not in registered memory"):
        _translate(engine._host_pointer, 0x1F000, 0x2000)  # runs past the registration's end
    assert driver.drained == 1
    with pytest.raises(TransferError, match="not in registered memory"):
        engine._host_pointer(0x30000)
    split = lambda address: address if address < 0x18000 else address + 0x100000  # noqa: E731 - two registrations
    with pytest.raises(TransferError, match="not one registered range"):
        _translate(split, 0x17000, 0x2000)


def test_a_gather_checks_every_host_piece_against_the_ranges_registered_now():
    """With both ends of a buffer registered but a hole between (a progressive pool part-way, a
    range let go), the ends-only address check passes; the per-piece check refuses the piece in
    the hole before any table reaches the device, and adjacent registrations count as one."""
    held = [(0x10000, 0x1000), (0x11000, 0x1000), (0x14000, 0x1000)]  # hole: [0x12000, 0x14000)
    check_registered(torch.tensor([0x10000, 0x10800, 0x14F00]), torch.tensor([0x1800, 0x800, 0x100]), held)
    check_registered(torch.tensor([0x13000]), torch.tensor([0]), held)  # an empty piece touches nothing
    for address, size in ((0x12000, 8), (0x11F00, 0x200), (0x14F00, 0x101), (0xF000, 8), (0x13FFF, 1)):
        with pytest.raises(TransferError, match=f"{address:#x}.*not inside a registered range"):
            check_registered(torch.tensor([0x10000, address]), torch.tensor([8, size]), held)
    with pytest.raises(TransferError, match="0 held"):
        check_registered(torch.tensor([0x10000]), torch.tensor([8]), [])
    part = (torch.tensor([0, 64]), torch.tensor([0, 0x3000]), torch.tensor([64, 64]), 128, 0x50000, 0x10000)
    moved = []
    with pytest.raises(TransferError, match="0x13000"):
        GatherCopy([part], torch.device("meta"), programs=2, host_side="src",
                   host_pointer=lambda address: moved.append(address) or address, registered=held)
    assert moved == []  # refused before any address was translated or table built
    batch = GatherCopy([part], torch.device("meta"), programs=2, host_side="src", host_pointer=lambda a: a,
                       registered=held + [(0x12000, 0x2000)])
    assert batch.count == 2 and batch.tables[0].device.type == "meta"
    # the device's addresses of the host pieces are what the kernel gets (here 1 MiB away from the host's)
    shifted = GatherCopy([part], torch.device("cpu"), programs=2, host_side="src", runner="torch",
                         host_pointer=lambda address: address + 0x100000, registered=held + [(0x12000, 0x2000)])
    assert shifted.tables[1].tolist() == [0x110000, 0x113000] and shifted.tables[0].tolist() == [0x50000, 0x50040]
    with pytest.raises(ValueError, match="programs must be >= 1, got 0"):
        GatherCopy([part], None, programs=0)
    # a backup: the host side is the destination - its pieces are the ones checked
    backup = (torch.tensor([0, 0x3000]), torch.tensor([0, 64]), torch.tensor([64, 64]), 128, 0x10000, 0x50000)
    with pytest.raises(TransferError, match="0x13000"):
        GatherCopy([backup], torch.device("meta"), programs=2, host_side="dst", host_pointer=lambda a: a,
                   registered=held)
    GatherCopy([backup], torch.device("meta"), programs=2, host_side="dst", host_pointer=lambda a: a,
               registered=held + [(0x12000, 0x2000)])


def _index_set(kind: str, pages: int, page: int, generator):
    """Host-side page ids of one index set: random pages, a run, one page, the last page."""
    if kind == "random":
        return torch.randperm(pages, generator=generator)[:3]
    if kind == "run":
        return torch.arange(1, 4)
    return torch.tensor([0 if kind == "one page" else pages - 1])


@pytest.mark.parametrize("runner", RUNNERS)
@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(layout=st.sampled_from(["layer_first", "page_first", "page_first_direct", "page_head"]),
       dtype=st.sampled_from(["bfloat16", "float32", "uint8"]), head_num=st.sampled_from([1, 2, 3]),
       head_dim=st.sampled_from([1, 3, 8]), page_size=st.sampled_from([1, 4]),
       index_set=st.sampled_from(["random", "run", "one page", "last page"]), seed=st.integers(0, 2**16))
def test_the_gather_puts_every_token_where_the_layout_says_both_ways(runner, layout, dtype, head_num, head_dim,
                                                                       page_size, index_set, seed):
    """The gather engine (Triton's interpreter or torch's index kernels) backs up and loads MHA
    tokens of any row size and dtype: each (K/V, layer, token) host element is where the layout's
    definition puts it (the oracle of test_pool_layout_oracle), every other host byte unchanged,
    and a load brings back exactly the backed-up rows."""
    device = MHADevicePool(size=8 * page_size, layer_num=2, head_num=head_num, head_dim=head_dim,
                           page_size=page_size, dtype=getattr(torch, dtype))
    device.randomize(seed)
    engine = CopyEngine(transfer="gather", programs=3, gather_runner=_runner(runner))
    pool = MHATokenToKVPoolHost(device, 2.0, 0, page_size, layout, False, "cpu", host=HostSetup(limits=LIMITS, machine=ROOMY, copy_engine=engine))
    try:
        generator = torch.Generator().manual_seed(seed)
        host_pages = _index_set(index_set, pool.page_num, page_size, generator)
        device_pages = torch.randperm(device.slots // page_size, generator=generator)[: host_pages.numel()]
        spread = lambda pages: (pages[:, None] * page_size + torch.arange(page_size)).reshape(-1)  # noqa: E731
        host_idx, device_idx = spread(host_pages), spread(device_pages)
        pool.kv_buffer.view(torch.uint8).fill_(0xA5)
        untouched = pool.kv_buffer.clone()
        pool.backup_from_device_all_layer(device, host_idx, device_idx, "kernel")
        assert engine.last_choice.engine == "gather"
        for kv, buffers in ((0, device.k_buffer), (1, device.v_buffer)):
            for layer in range(2):
                for h, d in zip(host_idx.tolist(), device_idx.tolist()):
                    got = mha_host_element(pool.kv_buffer, layout, kv, layer, h, page_size)
                    assert torch.equal(got, buffers[layer][d])
                    mha_host_element(untouched, layout, kv, layer, h, page_size).copy_(got)
        assert torch.equal(pool.kv_buffer.view(torch.uint8), untouched.view(torch.uint8))  # nothing else written
        want = [t.clone() for t in device.tensors()]
        device.zero()
        for layer in range(2):
            pool.load_to_device_per_layer(device, host_idx, device_idx, layer, "kernel")
        for before, after in zip(want, device.tensors()):
            assert torch.equal(before[device_idx], after[device_idx])
            assert not after[~torch.isin(torch.arange(device.slots), device_idx)].view(torch.uint8).any()
    finally:
        pool.destroy()


class _HeldCall:
    """A copy whose run() records its start, waits until released, runs, records its end."""

    def __init__(self, copy, log: list, started, go) -> None:
        self.copy, self.log, self.started, self.go = copy, log, started, go

    def run(self):
        self.log.append("copy-start")
        self.started.set()
        assert self.go.wait(60), "the test never let the copy go"
        result = self.copy()
        self.log.append("copy-end")
        return result


class _HeldCopy(_HeldCall):
    """A prepared copy of the engine's, held as `_HeldCall` holds a copy."""

    def __init__(self, prepared, log: list, started, go) -> None:
        super().__init__(prepared.run, log, started, go)
        self.total, self.choice = prepared.total, prepared.choice


@pytest.mark.concurrency
@pytest.mark.parametrize("transfer", ["gather", "auto"])
def test_destroy_waits_for_a_copy_in_flight_and_no_transfer_starts_after(transfer, monkeypatch):
    """destroy() called while a transfer's copy runs on another thread lets nothing go before
    that copy ends (the order proved from events: copy-start, destroy waiting, copy-end, release);
    a transfer after destroy() - or one starting while it waits - is refused and launches nothing.
    The copy is held wherever it runs: a prepared copy of the engine's, or - on CPU without the C
    helper, where "auto" copies page_first's rows by torch indexing - each of those copies."""
    import threading

    from hicache.errors import RegistrationStateError

    log: list = []
    started, go = threading.Event(), threading.Event()

    class Holding(CopyEngine):
        def prepare_parts(self, parts, **kw):
            return _HeldCopy(super().prepare_parts(parts, **kw), log, started, go)

    from hicache.pools import _transfer

    for name in ("copy_blocks", "copy_tokens"):  # the torch-indexing copies, held the same way
        real = getattr(_transfer, name)
        monkeypatch.setattr(_transfer, name, lambda *a, _real=real, **k: _HeldCall(lambda: _real(*a, **k), log,
                                                                                   started, go).run())

    pool, device = make("mha", "page_first", copy_engine=Holding(transfer=transfer, programs=2))
    device.randomize(4)
    host_idx = _slots(pool, 2)
    device_idx = torch.arange(2 * pool.page_size)
    handle = pool._host
    release = handle.release

    def logged_release(**kw):
        log.append("release")
        return release(**kw)

    handle.release = logged_release
    copier = threading.Thread(target=pool.backup_from_device_all_layer, args=(device, host_idx, device_idx, "kernel"))
    copier.start()
    assert started.wait(60)
    destroyer = threading.Thread(target=pool.destroy)
    destroyer.start()
    try:
        for _ in range(6000):  # until destroy() waits on the copy (its flag: events, not seconds)
            if pool._in_flight.closing:
                break
            threading.Event().wait(0.01)
        assert pool._in_flight.closing and log == ["copy-start"]
        with pytest.raises(RegistrationStateError, match="being destroyed"):
            pool.load_to_device_per_layer(device, host_idx, device_idx, 0, "kernel")
    finally:
        go.set()
    copier.join(60)
    destroyer.join(60)
    assert not copier.is_alive() and not destroyer.is_alive()
    copies = len(log) // 2  # one prepared copy, or one torch-indexing copy per layer
    assert copies >= 1 and log == ["copy-start", "copy-end"] * copies + ["release"]
    with pytest.raises(RegistrationStateError, match="destroyed"):
        pool.backup_from_device_all_layer(device, host_idx, device_idx, "kernel")
    assert log == ["copy-start", "copy-end"] * copies + ["release"]


@pytest.mark.parametrize("keywords, message", [
    ({"programs": 0}, "CopyEngine.programs must be positive, got 0"),
    ({"programs": 4097}, "CopyEngine.programs must be <= 4096, got 4097"),
    ({"programs": 2.5}, "CopyEngine.programs must be an integer, got 2.5 (float)"),
    ({"gather_runner": "cuda"}, "CopyEngine.gather_runner must be one of ('auto', 'triton', 'torch'), got 'cuda'"),
])
def test_a_copy_engine_refuses_a_bad_program_count_or_runner_when_made(keywords, message):
    """`CopyEngine(programs=, gather_runner=)` outside what HICACHE_TRANSFER_PROGRAMS allows (1 to
    4096) or a runner it has not is refused when the engine is made - naming the field and value -
    not at the first gather a pool launches (programs=0 failed there, mid-transfer)."""
    from hicache.errors import PlanError

    with pytest.raises(PlanError) as raised:
        CopyEngine(**keywords)
    assert str(raised.value) == message
    assert CopyEngine(programs=4096, gather_runner="torch").programs == 4096
