"""Real CUDA: conformance of the cuda-python adapter and a chunked pool that copies correctly.
Marked `gpu`: skipped with the reason on machines without a usable CUDA driver."""

from __future__ import annotations

import json
import pathlib
import subprocess
import sys

import pytest

from hicache.effects import CudaPythonRuntime, apply_plan, probe_cuda
from hicache.effects._copy import _gather  # the gather's tile constants and warm-up record, under test
from hicache.effects._host._memory import allocate_host
from hicache.plan import Limits, plan_registration
from hicache.testing import check_runtime_conformance
from hicache.pools import HostPoolOptions
from hicache.effects import HostSetup

SCRIPT = pathlib.Path(__file__).resolve().parents[1] / "scripts" / "gpu_check.py"


@pytest.fixture(autouse=True)
def _the_real_machine():
    """The GPU tests bring up real pools on a real machine: its own memory figures, not the
    3 GB machine every other test sees (with it, each pool here was refused by the budget)."""
    import psutil

    small = psutil.virtual_memory
    psutil.virtual_memory = getattr(small, "__wrapped__", small)
    yield
    psutil.virtual_memory = small


def _cuda_device_pool(seed: int):
    """torch and a 4-layer MHA device pool on the GPU filled with seeded random values (skips
    without a CUDA build of torch)."""
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA build of torch (the development pin is the CPU build)")
    from hicache.testing import MHADevicePool

    device = MHADevicePool(size=4096, layer_num=4, head_num=8, head_dim=128, page_size=64)
    device.randomize(seed)
    device.k_buffer = [t.cuda() for t in device.k_buffer]
    device.v_buffer = [t.cuda() for t in device.v_buffer]
    device.device = "cuda"
    return torch, device


def _back_up_zero_load(pool, device, host_idx, device_idx, backend) -> None:
    """SGLang's write-back of the slots, the device zeroed, then its load of each of the 4 layers."""
    pool.backup_from_device_all_layer(device, host_idx, device_idx, backend)
    for t in device.tensors():
        t.zero_()
    for layer in range(4):
        pool.load_to_device_per_layer(device, host_idx, device_idx, layer, backend)


@pytest.mark.gpu
def test_cuda_python_runtime_conforms():
    """The real adapter: 712 on overlap, interior unregister fails, errors drained."""
    buffer = allocate_host(3 * 4096)
    try:
        check_runtime_conformance(CudaPythonRuntime(), buffer.ptr, buffer.nbytes)
    finally:
        buffer.free()


@pytest.mark.gpu
def test_chunked_registration_of_real_memory():
    """A 64 MiB buffer registers in 4 calls and releases cleanly."""
    buffer = allocate_host(64 * 2**20)
    plan = plan_registration(buffer.nbytes, granularity_bytes=2**20, limits=Limits(chunk_limit_bytes=16 * 2**20))
    with apply_plan(plan, base_ptr=buffer.ptr, runtime=CudaPythonRuntime()) as registration:
        assert registration.status().call_count == 4
    buffer.free()


@pytest.mark.gpu
def test_gpu_check_script_passes():
    """scripts/gpu_check.py verifies boundary pages byte for byte."""
    out = subprocess.run([sys.executable, str(SCRIPT)], capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stdout + out.stderr
    assert json.loads(out.stdout)["bytes_match"] is True


def test_gpu_check_without_cuda_says_so():
    """Without CUDA the GPU check exits 2 with a one-line JSON reason."""
    if probe_cuda().available:
        pytest.skip("CUDA is available here")
    out = subprocess.run([sys.executable, str(SCRIPT)], capture_output=True, text=True, timeout=120)
    assert out.returncode == 2
    assert "CUDA unavailable" in json.loads(out.stdout)["reason"]


@pytest.mark.gpu
@pytest.mark.parametrize("layout", ["page_first_direct", "layer_first", "page_first", "page_head"])
@pytest.mark.parametrize("side_stream", [False, True])
@pytest.mark.parametrize("transfer, backend", [("dma", "direct"), ("gather", "kernel"), ("auto", "kernel")])
def test_pool_round_trip_on_cuda(layout, side_stream, transfer, backend):
    """A registered MHA pool backs up GPU pages and loads them back per layer, from torch's
    default (NULL) stream - batched on a side stream - or from a stream of the caller's, with
    the copy engine, the GPU's gather, or the table's choice."""
    torch, device = _cuda_device_pool(seed=5)
    from hicache.effects import CopyEngine
    from hicache.pools import MHATokenToKVPoolHost

    pool = MHATokenToKVPoolHost(device, 1.0, 0, 64, layout, True, "cpu", host=HostSetup(limits=Limits(chunk_limit_bytes=4 * 2**20), copy_engine=CopyEngine(transfer=transfer)))
    try:
        pages = torch.randperm(4096 // 64 - 1, generator=torch.Generator().manual_seed(1))[:16] + 1
        device_idx = (pages[:, None] * 64 + torch.arange(64)).reshape(-1).cuda()
        host_idx = pool.alloc(device_idx.numel())
        original = [t[device_idx].clone() for t in device.tensors()]
        stream = torch.cuda.Stream() if side_stream else torch.cuda.current_stream()
        with torch.cuda.stream(stream):
            _back_up_zero_load(pool, device, host_idx, device_idx, backend)
        stream.synchronize()
        assert all(torch.equal(a, t[device_idx]) for a, t in zip(original, device.tensors()))
    finally:
        pool.destroy()


@pytest.mark.gpu
def test_progressive_pool_serves_pages_while_it_registers_on_cuda():
    """A progressive 1 GB MHA pool: the pages `alloc` hands out right after the constructor
    returns back up GPU pages and load them back byte for byte through cudaMemcpyBatchAsync
    while the rest still registers; `wait_ready()` ends with every page ready."""
    torch, device = _cuda_device_pool(seed=7)
    from hicache.pools import MHATokenToKVPoolHost

    pool = MHATokenToKVPoolHost(device, 1.0, 1, 64, "page_first_direct", True, "cpu", options=HostPoolOptions(progressive=True))
    try:
        assert 0 < pool.ready_pages() <= pool.page_num
        host_idx = pool.alloc(16 * 64)
        assert host_idx is not None, f"only {pool.ready_pages()} pages ready after the constructor"
        pages = torch.randperm(4096 // 64 - 1, generator=torch.Generator().manual_seed(2))[:16] + 1
        device_idx = (pages[:, None] * 64 + torch.arange(64)).reshape(-1).cuda()
        original = [t[device_idx].clone() for t in device.tensors()]
        _back_up_zero_load(pool, device, host_idx, device_idx, "direct")
        torch.cuda.synchronize()
        assert all(torch.equal(a, t[device_idx]) for a, t in zip(original, device.tensors()))
        assert pool.wait_ready(timeout=300) is True and pool.ready_pages() == pool.page_num
    finally:
        pool.destroy()


@pytest.mark.gpu
def test_a_gather_pool_compiles_its_kernel_at_build_and_no_transfer_compiles():
    """On a real GPU a page_first pool built for the gather has its kernel compiled, loaded and
    launched once its warm-up thread ends (the process's record: ready for 8-byte words), and a
    backup then a load after that compile nothing (Triton's compile calls counted) and move
    the rows bit for bit."""
    torch, device = _cuda_device_pool(seed=9)
    from hicache.effects import CopyEngine
    from hicache.pools import MHATokenToKVPoolHost

    kernel = _gather._kernel(False)
    if not callable(getattr(kernel, "compile", None)):
        pytest.skip(f"this Triton's JITFunction has no compile hook to count ({type(kernel).__module__})")
    compiled: list = []
    original = kernel.compile
    kernel.compile = lambda *args, **kwargs: (compiled.append(args), original(*args, **kwargs))[1]
    try:
        pool = MHATokenToKVPoolHost(device, 1.0, 0, 64, "page_first", True, "cpu", host=HostSetup(
            limits=Limits(chunk_limit_bytes=4 * 2**20), copy_engine=CopyEngine(transfer="gather")))
        try:
            assert _gather.WARMTH.settle(120)
            states = _gather.WARMTH.states()
            assert states.get((str(device.k_buffer[0].device), 8), "not tried") is None, states
            built = len(compiled)
            device_idx = torch.arange(64, 64 * 9).cuda()
            host_idx = pool.alloc(device_idx.numel())
            original_rows = [t[device_idx].clone() for t in device.tensors()]
            _back_up_zero_load(pool, device, host_idx, device_idx, "kernel")
            torch.cuda.synchronize()
            assert len(compiled) == built, "a transfer compiled the kernel"
            assert all(torch.equal(a, t[device_idx]) for a, t in zip(original_rows, device.tensors()))
        finally:
            pool.destroy()
    finally:
        kernel.compile = original


def test_the_first_transfer_figure_runs_on_cpu(monkeypatch, tmp_path):
    """scripts/gpu_transfers.py's `first_transfer`, the code the GPU check runs, at a small size
    on CPU (Triton's interpreter): every figure is there and the gather moved the backups."""
    import importlib

    torch = pytest.importorskip("torch")
    sys.path.insert(0, str(SCRIPT.parent))
    gpu_transfers = importlib.import_module("gpu_transfers")  # a script beside gpu_check.py, not a package
    for name, value in (("LAYERS", 2), ("PAGES", 16), ("MOVED", 8), ("HEADS", 2), ("DIM", 8)):
        monkeypatch.setattr(gpu_transfers, name, value)
    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path))  # the figure sets a fresh one; restored after
    figures = gpu_transfers.first_transfer(torch, "cpu")
    assert set(figures) == {"constructor_s", "warm_after_constructor_s", "first_backup_s", "next_backups_median_s",
                            "engine"}
    assert figures["engine"] == "gather" and all(v >= 0 for k, v in figures.items() if k.endswith("_s"))


@pytest.mark.timeout(120)
@pytest.mark.parametrize("family, layout, engine", [("mha", "page_first", "gather"), ("mla", "page_first_direct", "dma")])
def test_a_transfer_table_row_runs_on_cpu(monkeypatch, family, layout, engine):
    """scripts/gpu_transfers.py's `family_row`, the code each row of the GPU check's transfer table
    runs, at a small size on CPU under the fake driver (the gather through Triton's interpreter):
    the engine asked for moved both ways, the rows came back bit for bit, every figure is there."""
    import importlib

    from hicache.testing import fake_cuda

    torch = pytest.importorskip("torch")
    sys.path.insert(0, str(SCRIPT.parent))
    gpu_transfers = importlib.import_module("gpu_transfers")
    for name, value in (("LAYERS", 2), ("PAGES", 16), ("MOVED", 8), ("HEADS", 2), ("DIM", 8), ("PAGE", 4)):
        monkeypatch.setattr(gpu_transfers, name, value)
    with fake_cuda() as fake:
        row = gpu_transfers.family_row(torch, family, layout, engine, target="cpu")
        assert fake.held() == set()
    moved = "gather" if engine == "gather" else "host"  # the copy engine's batch is the host copy on CPU
    assert row["engines"] == {"backup": moved, "load": moved} and row["bit_exact"] is True
    assert row["moved_bytes"] > 0 and row["load_gbps"] >= 0 and row["backup_gbps"] >= 0


def test_a_tile_row_runs_on_cpu_and_puts_the_kernel_constants_back(monkeypatch):
    """scripts/gpu_transfers.py's `tile_row` (the gather with other tile constants) on CPU under
    the fake driver: the round trip is bit-exact with 8 pieces a program and 512-byte steps, the
    row says which, and the module's constants are the defaults again after it."""
    import importlib

    from hicache.testing import fake_cuda

    torch = pytest.importorskip("torch")
    sys.path.insert(0, str(SCRIPT.parent))
    gpu_transfers = importlib.import_module("gpu_transfers")
    for name, value in (("LAYERS", 2), ("PAGES", 16), ("MOVED", 8), ("HEADS", 2), ("DIM", 8), ("PAGE", 4)):
        monkeypatch.setattr(gpu_transfers, name, value)
    defaults = _gather.ROWS, _gather.CHUNK_BYTES
    seen = []
    run = _gather.GatherCopy.run
    monkeypatch.setattr(_gather.GatherCopy, "run", lambda self: seen.append((_gather.ROWS, self.chunk * self.word)) or run(self))
    with fake_cuda():
        row = gpu_transfers.tile_row(torch, 8, 512, target="cpu")
    assert row["bit_exact"] is True and row["engines"] == {"backup": "gather", "load": "gather"}
    assert (row["rows_per_program"], row["chunk_bytes"]) == (8, 512) and (_gather.ROWS, _gather.CHUNK_BYTES) == defaults
    assert seen and set(seen) == {(8, 512)}  # 8 pieces a program, 512 bytes a step, every batch


def _family_cases():
    sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
    from test_pools import CASES

    return CASES


@pytest.mark.gpu
@pytest.mark.parametrize("name, layout", _family_cases(), ids=[f"{n}-{l}" for n, l in _family_cases()])
def test_every_family_and_layout_round_trips_on_cuda_with_each_engine(name, layout):
    """Every family x layout on a real GPU, with SGLang's `direct` backend on the copy engine
    and its `kernel` backend on the gather and on the table's choice: a backup of random device
    pages then a per-layer load gives back the device rows bit for bit, and the three engines
    leave the same host bytes."""
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA build of torch (the development pin is the CPU build)")
    round_trip_each_engine(name, layout, "cuda")


def round_trip_each_engine(name, layout, target):
    """The round trip above on ``target`` ("cuda"; "cpu" to try this code without a GPU)."""
    import torch
    from test_pools import make, round_trip

    from hicache.effects import CopyEngine

    host_bytes = []
    for transfer, backend in (("dma", "direct"), ("gather", "kernel"), ("auto", "kernel")):
        pool, device = make(name, layout, pin_memory=True, limits=Limits(chunk_limit_bytes=4 * 2**20),
                            copy_engine=CopyEngine(transfer=transfer))
        try:
            host_bytes.append(round_trip(pool, device, seed=11, pages_seed=5, pages=3, backend=backend,
                                         target=target)[1])
        finally:
            pool.destroy()
    assert all(torch.equal(a, b) for a, b in zip(host_bytes[0], host_bytes[1]))
    assert all(torch.equal(a, b) for a, b in zip(host_bytes[0], host_bytes[2]))


def test_every_stand_in_moves_all_its_buffers_to_a_device():
    """The device stand-ins' `to()` (the GPU tests put them on CUDA with it) moves every buffer
    of every family, the Mamba cache's namespace included ("meta" stands in for a GPU here)."""
    torch = pytest.importorskip("torch")
    from test_pools import FAMILIES

    for name, (_, device_pool) in FAMILIES.items():
        device = device_pool()
        assert device.to("meta") is device and device.device == "meta", name
        assert device.tensors() and all(t.device.type == "meta" for t in device.tensors()), name
        assert all(t.device.type == "meta" for t in vars(device).values() if isinstance(t, torch.Tensor)), name


def test_the_bring_up_table_runs_on_cpu_under_the_fake_driver(monkeypatch):
    """scripts/gpu_bringup.py's table, the code the GPU check runs, at small sizes under the fake
    driver: interleaved rounds of hicache's defaults and SGLang's path, each brought up and
    released (nothing left registered), the call cap's calls, each buffer's page rules, a size
    the machine has no room for skipped with the reason."""
    import importlib

    sys.path.insert(0, str(SCRIPT.parent))
    gpu_bringup = importlib.import_module("gpu_bringup")  # a script beside gpu_check.py, not a package

    from hicache.testing import FakeRuntime

    monkeypatch.setenv("HICACHE_CALL_CAP", "16MiB")
    runtime = FakeRuntime()
    table = gpu_bringup.bringup_table(runtime, sizes={"48 MiB": 48 * 2**20, "too big": 10**15}, rounds=2,
                                      available=2**40)
    small = table["48 MiB"]
    assert len(small["ours_usable_s"]) == len(small["sglang_usable_s"]) == 2 and small["speedup"] > 0
    assert small["calls"] == 4 and sum(nbytes for _, _, nbytes in small["page_rules"]) == 40 * 2**20
    assert "needs" in table["too big"]["skipped"] and runtime.held() == set()


def test_the_bring_up_table_skips_a_size_its_time_left_cannot_hold_and_shows_each_row_as_it_ends(monkeypatch):
    """With a deadline (the GPU check's 5 minutes), a size whose time - scaled by bytes from the
    size measured before it - would run past it is skipped, saying how long it needs and how long
    is left; a size that fits is measured; each row is handed out as it ends (a run cut short
    still shows the rows it measured). Seconds come from an injected clock: 1 s per MiB moved."""
    import importlib

    sys.path.insert(0, str(SCRIPT.parent))
    gpu_bringup = importlib.import_module("gpu_bringup")

    from hicache.testing import FakeRuntime

    now = [0.0]
    moved = {"ours": 0, "sglang": 0}

    def paths(who):
        def run(nbytes, runtime):
            now[0] += nbytes / 2**20  # the clock advances by what the round moves
            moved[who] += nbytes
            return (0.5, 0.1, {}) if who == "ours" else (2.0, 0.2)
        return run

    monkeypatch.setattr(gpu_bringup, "_ours", paths("ours"))
    monkeypatch.setattr(gpu_bringup, "_sglangs", paths("sglang"))
    rows: list = []
    sizes = {"a": 4 * 2**20, "b": 8 * 2**20, "c": 2 * 2**20}
    # "a": 4 runs x 4 MiB = 16 s; "b" scaled from it: 32 s, ends at 48 of 55; "c": 8 s, 7 left
    table = gpu_bringup.bringup_table(FakeRuntime(), sizes=sizes, rounds=2, available=2**40, deadline=55.0,
                                      clock=lambda: now[0], emit=lambda name, row: rows.append((name, row)))
    assert table["a"]["speedup"] == 4.0 and table["b"]["speedup"] == 4.0
    assert "skipped" in table["c"] and "needs about 8 s" in table["c"]["skipped"] and "7 s left" in table["c"]["skipped"]
    assert [name for name, _ in rows] == ["a", "b", "c"] and rows[0][1] is table["a"]
    assert moved == {"ours": 2 * (4 + 8) * 2**20, "sglang": 2 * (4 + 8) * 2**20}
    table = gpu_bringup.bringup_table(FakeRuntime(), sizes={"a": 4 * 2**20}, rounds=2, available=2**40,
                                      deadline=1.0, clock=lambda: now[0])
    assert table["a"]["speedup"] == 4.0  # the first size has nothing to scale from: it is measured
