"""The `hicache` entry point in `sglang.srt.plugins`, judged by SGLang 0.5.23's own code: its
`load_plugins()` discovers the installed entry point and its `HookRegistry` patches the host
pools' bring-up seam; SGLang's real host pools then come up through hicache (under
`hicache.testing.fake_cuda`), SGLang's own `destroy()` leaves nothing registered, a failed
register leaves nothing behind; outside the tested versions, with HICACHE_SGLANG=off or an
SGLANG_PLUGINS list without it, SGLang's functions stay in place.

Needs SGLang's real code (`make sglang`); skips naming that target where it is absent, and
fails instead where HICACHE_REQUIRE_SGLANG=1 (CI)."""

from __future__ import annotations

import pytest
from sglang_support import (  # noqa: F401 - sglang: a fixture
    NAMES, ORIGINALS, load_sglang, need_sglang, plugged, published, recording_allocators, restore, sglang,
)

from store_support import Zygote

from hicache.testing import fake_cuda

torch = pytest.importorskip("torch")


def test_load_plugins_discovers_the_entry_point_and_replaces_the_seam(sglang):
    """SGLang's own loader finds `hicache` in group sglang.srt.plugins (declared in
    pyproject.toml) and its registry patches the three functions, also where SGLang's modules
    imported them by name - and where SGLang's pools look the allocation function up
    (`ALLOC_MEMORY_FUNCS`, whose "cuda" entry a pool built earlier may have resolved)."""
    from importlib.metadata import entry_points

    import sglang.srt.mem_cache.pool_host.base as base
    import sglang.srt.plugins as plugins

    assert sglang.ALLOC_MEMORY_FUNCS["cuda"] is ORIGINALS["alloc_with_host_register"]  # resolved before
    (point,) = [ep for ep in entry_points(group="sglang.srt.plugins") if ep.name == "hicache"]
    assert point.value == "hicache.compat.sglang_plugin:load"
    plugins.load_plugins()
    assert plugged(sglang)
    assert base._cuda_host_unregister is sglang._cuda_host_unregister
    assert sglang.ALLOC_MEMORY_FUNCS["cuda"] is sglang.alloc_with_host_register
    assert sglang.ALLOC_MEMORY_FUNCS["npu"] is not sglang.alloc_with_host_register  # framework-pinned


def test_hicache_sglang_pools_replaces_sglangs_pool_classes_everywhere_and_only_when_asked(sglang, monkeypatch):
    """HICACHE_SGLANG_POOLS=1: SGLang's registry puts hicache's classes where SGLang's were -
    their modules and every module that imported them by name (the assembler's chooser
    resolves them at call time), each a pool class scoped to SGLang's process (`with_host`:
    same name and module); unset: SGLang's own classes stay."""
    import importlib
    import sys

    import sglang.srt.plugins as plugins

    import hicache.pools
    from hicache.compat.sglang_plugin import POOL_CLASSES

    originals = {t: getattr(importlib.import_module(t.rsplit(".", 1)[0]), t.rsplit(".", 1)[1]) for t in POOL_CLASSES}
    plugins.load_plugins()
    for target, original in originals.items():
        module, name = target.rsplit(".", 1)
        assert getattr(sys.modules[module], name) is original  # not asked: SGLang's own

    from sglang_support import restore

    restore(sglang)
    monkeypatch.setenv("HICACHE_SGLANG_POOLS", "1")
    plugins.load_plugins()
    from hicache.compat.sglang_process import SGLangProcess

    for target, name in POOL_CLASSES.items():
        module, attribute = target.rsplit(".", 1)
        placed = getattr(sys.modules[module], attribute)
        assert issubclass(placed, getattr(hicache.pools, name)) and placed.__name__ == name
        if issubclass(placed, hicache.pools.HostKVCache):
            assert placed is not getattr(hicache.pools, name)
            assert isinstance(placed.default_host.server, SGLangProcess)
        holders = [m for n, m in sys.modules.copy().items() if n.startswith("sglang") and m is not None
                   and getattr(m, attribute, None) is originals[target]]
        assert holders == [], f"{attribute} is still SGLang's in {[m.__name__ for m in holders]}"
    from sglang.srt.mem_cache.pool_host import mha

    info = _device_pool().get_device_pool_infos()[0].buffer_info
    assert mha.get_mha_host_pool_cls(info) is mha.MHATokenToKVPoolHost
    assert issubclass(mha.MHATokenToKVPoolHost, hicache.pools.MHATokenToKVPoolHost)


def test_each_load_hooks_every_target_once_and_the_suites_restore_undoes_it(sglang, monkeypatch):
    """Loads of the plug-in in turn (pools mode off, on, off, on; `sglang_support.plug`) leave each
    of its targets hooked exactly once - SGLang's loader wraps what it finds, so a target the
    suite's restore missed was wrapped again by every load (SGLang's available-memory sample was,
    hundreds deep by the end of a run) - and the restore leaves none hooked."""
    import importlib

    from sglang_support import plug

    import sglang.srt.mem_cache.pool_host.common as common
    from hicache.compat.sglang_plugin import AVAILABLE_TARGET, BUDGET_TARGET, POOL_CLASSES, TARGETS

    def hooked(target: str) -> int:
        module, name = target.rsplit(".", 1)
        value, depth = getattr(importlib.import_module(module), name), 0
        if isinstance(value, type):
            return int(value.__module__.startswith("hicache."))
        while getattr(value, "__wrapped__", None) is not None:
            value, depth = value.__wrapped__, depth + 1
        return depth

    functions = [*TARGETS, BUDGET_TARGET, AVAILABLE_TARGET]
    for pools in (False, True, False, True):
        plug(monkeypatch, pools=pools)
        assert {t: hooked(t) for t in functions} == dict.fromkeys(functions, 1)
        assert {t: hooked(t) for t in POOL_CLASSES} == dict.fromkeys(POOL_CLASSES, int(pools))
    restore(common)
    assert {t: hooked(t) for t in [*functions, *POOL_CLASSES]} == dict.fromkeys([*functions, *POOL_CLASSES], 0)


def test_a_bad_hicache_sglang_pools_value_registers_nothing_and_names_the_variable(sglang, monkeypatch):
    """A bad HICACHE_SGLANG_POOLS fails the plug-in's load naming it, with no hook registered."""
    from hicache.compat import sglang_plugin
    from hicache.errors import EnvError

    monkeypatch.setenv("HICACHE_SGLANG_POOLS", "maybe")
    with pytest.raises(EnvError, match="HICACHE_SGLANG_POOLS='maybe'"):
        sglang_plugin.load()
    from sglang.srt.plugins.hook_registry import HookRegistry

    assert not HookRegistry._hooks


@pytest.mark.parametrize("setting", ["HICACHE_SGLANG=off", "SGLANG_PLUGINS=other", "version 0.5.22"])
def test_when_told_not_to_sglangs_own_functions_stay(sglang, monkeypatch, caplog, setting):
    """HICACHE_SGLANG=off, an unlisted plug-in or an untested SGLang version leave SGLang's own
    functions in place (and say why)."""
    import sglang.srt.plugins as plugins

    from hicache.compat import sglang_plugin

    if setting == "version 0.5.22":
        monkeypatch.setattr(sglang_plugin, "sglang_version", lambda: "0.5.22")
    else:
        name, value = setting.split("=")
        monkeypatch.setenv(name, value)
    with caplog.at_level("INFO"):
        plugins.load_plugins()
    assert not any(getattr(sglang, name) is not ORIGINALS[name] for name in NAMES)
    if setting == "version 0.5.22":
        assert "outside the range this plug-in was tested with" in caplog.text


def _device_pool(layers: int = 3):
    from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool

    return MHATokenToKVPool(size=256, page_size=16, dtype=torch.bfloat16, head_num=2, head_dim=64,
                            layer_num=layers, device="cpu", enable_memory_saver=False)


def _host_pool(device_pool, layout: str):
    from sglang.srt.mem_cache.pool_host.base import host_memory_budget_scope
    from sglang.srt.mem_cache.pool_host.mha import MHATokenToKVPoolHost

    info = device_pool.get_device_pool_infos()[0].buffer_info
    with host_memory_budget_scope(10**12):  # SGLang's own way to give its check a budget
        return MHATokenToKVPoolHost(info, 2.0, 0, 16, layout, True, "cpu", device_capacity_tokens=256,
                                    start_layer=0, end_layer=device_pool.layer_num)


@pytest.mark.parametrize("layout", ["layer_first", "page_first", "page_first_direct"])
@pytest.mark.parametrize("built_by", ["assembler", "constructor"])
def test_sglangs_own_mha_pool_comes_up_through_hicache_and_goes_down_clean(sglang, layout, built_by, monkeypatch):
    """SGLang's real MHATokenToKVPoolHost with the plug-in loaded, built by SGLang's assembler
    from the published settings (as a server does) or by its constructor: every register call is
    hicache's (the fake sees them), the ranges attribute SGLang's teardown reads is exactly what
    is registered, each boundary on SGLang's page granularity (a 64 KiB kernel pin cap makes
    several), and SGLang's destroy() leaves nothing registered."""
    import sglang.srt.plugins as plugins
    from sglang.srt.mem_cache.hybrid_cache.hybrid_pool_assembler import build_kv_host_pool
    from sglang.srt.mem_cache.pool_host.base import host_memory_budget_scope

    plugins.load_plugins()
    if layout != "layer_first":  # layer-first buffers come without a copy unit: one call each
        monkeypatch.setenv("HICACHE_KERNEL_PIN_CAP", "64KiB")
    device = _device_pool()
    with fake_cuda() as fake, published(page_size=16, hicache_ratio=2.0, hicache_mem_layout=layout):
        if built_by == "assembler":
            with host_memory_budget_scope(10**12):
                host = build_kv_host_pool(kv_pool=device, page_size=16)
            assert type(host).__name__ == "MHATokenToKVPoolHost" and host.layout == layout
        else:
            host = _host_pool(device, layout)
        buffers = host.kv_buffer if isinstance(host.kv_buffer, list) else [host.kv_buffer]
        recorded = {tuple(r) for b in buffers for r in b._sglang_cuda_host_registered_ranges}
        assert recorded and recorded == fake.held()
        registered = [entry for entry in fake.cudart.log if entry[0] == "register"]
        assert len(registered) == len(recorded)
        if layout != "layer_first":
            page_bytes = host.page_size * host.layout_dim
            assert all(len(b._sglang_cuda_host_registered_ranges) > 1 for b in buffers)
            for b in buffers:
                for ptr, size in b._sglang_cuda_host_registered_ranges:
                    assert (ptr - b.data_ptr()) % page_bytes == 0
        host.destroy()
        assert fake.held() == set()
        fake.check_valid()


def test_sglangs_own_pool_reads_no_smaps_at_bring_up_and_a_scrape_reads_its_page_tiers(sglang, monkeypatch):
    """Seam mode with the metrics on (prometheus_client is in every SGLang server): SGLang's own
    pool's constructor reads no /proc/self/smaps (a read walks every page table of the process:
    53-60 ms with SGLang loaded); a scrape then reads its buffer's page tiers as obtained - every
    byte pre-faulted, so the tiers add up to the buffer - and none once SGLang's destroy() has
    released it."""
    import builtins

    import sglang.srt.plugins as plugins
    from prometheus_client import CollectorRegistry

    from hicache import metrics

    def tiers(registry, pool):
        return {s.labels["tier"]: s.value for family in registry.collect() for s in family.samples
                if s.name == "hicache_host_pool_bytes" and s.labels["pool"] == pool}

    plugins.load_plugins()
    registry = CollectorRegistry()
    assert metrics.install(registry)
    device = _device_pool()
    opened: list = []
    real_open = builtins.open

    def recording_open(file, *args, **kwargs):
        opened.append(str(file))
        return real_open(file, *args, **kwargs)

    with fake_cuda():
        monkeypatch.setattr(builtins, "open", recording_open)
        try:
            host = _host_pool(device, "page_first_direct")
        finally:
            monkeypatch.setattr(builtins, "open", real_open)
        assert not [path for path in opened if path.endswith("smaps")], opened
        pool = host.kv_buffer._hicache_metrics[0]  # the buffer's series (compat.sglang._METRICS_ATTR)
        got = tiers(registry, pool)
        assert sum(got.values()) == host.kv_buffer.numel() * host.kv_buffer.element_size() and set(got) >= {"4k", "thp"}
        host.destroy()
        assert sum(tiers(registry, pool).values()) == 0


@pytest.mark.parametrize("layout", ["layer_first", "page_first_direct"])
def test_sglangs_own_pool_gives_its_pages_back_in_parallel_pieces_once_it_drops_them(sglang, layout, monkeypatch):
    """Seam mode's release (issue #53 item 3): SGLang's own destroy() unregisters through hicache
    and SGLang drops the tensors; each buffer's pages then go back in parallel pieces on hicache's
    release thread before the unmap (an unmap alone frees every page from one thread: 37.5 GiB
    in 2.3-3.3 s on an H200 host), and nothing of it stays mapped."""
    import gc
    import threading

    import sglang.srt.plugins as plugins

    from hicache.effects._host import _release

    monkeypatch.setattr(_release, "RELEASE_PIECE_BYTES", 64 * 1024)  # these small buffers count as large
    given = []
    monkeypatch.setattr(_release, "give_back", lambda ptr, length: given.append((ptr, threading.current_thread().name)))
    plugins.load_plugins()
    device = _device_pool()
    with fake_cuda() as fake:
        host = _host_pool(device, layout)
        buffers = host.kv_buffer if isinstance(host.kv_buffer, list) else [host.kv_buffer]
        ptrs = sorted(b.data_ptr() for b in buffers)
        host.destroy()
        assert fake.held() == set()
        del host, buffers
        gc.collect()  # SGLang's pool sits in reference cycles: its tensors go with the collector
    assert _release.wait_for_releases(timeout=60)  # a hang guard: the thread answers in order
    ours = sorted(call for call in given if call[0] in ptrs)  # (dropped mappings of earlier tests go too)
    assert ours == [(ptr, "hicache-release") for ptr in ptrs]
    with open("/proc/self/maps") as maps:
        spans = [[int(x, 16) for x in line.split()[0].split("-")] for line in maps]
    assert not [ptr for ptr in ptrs if any(low <= ptr < high for low, high in spans)]


def test_sglangs_default_allocator_gives_way_to_hicaches_and_a_back_ends_is_kept(sglang, monkeypatch):
    """SGLang's default HostTensorAllocator (MAP_POPULATE: one thread faults it all inside
    mmap) is replaced for the bring-up by hicache's (parallel pre-fault pipelined with the
    registration); any other allocator (a storage back end's) allocates its own memory."""
    from hicache.compat import sglang as compat
    from hicache.effects import HostTensorAllocator

    made = []
    real = HostTensorAllocator.allocate_unfaulted
    monkeypatch.setattr(HostTensorAllocator, "allocate_unfaulted",
                        lambda self, dims, dtype: made.append(dims) or real(self, dims, dtype))

    class BackEnd:  # a storage back end's allocator: its memory, hicache registers it
        def __init__(self):
            self.calls = 0

        def allocate(self, dims, dtype, device="cpu"):
            self.calls += 1
            return torch.zeros(dims, dtype=dtype)

    with fake_cuda() as fake:
        ours = compat.alloc_with_host_register((64, 4096), torch.uint8, "cpu", True, sglang.HostTensorAllocator(),
                                               registration_granularity_bytes=4096)
        assert made == [(64, 4096)] and fake.held() == {tuple(r) for r in ours._sglang_cuda_host_registered_ranges}
        compat._cuda_host_unregister(ours)
        back_end = BackEnd()
        theirs = compat.alloc_with_host_register((16, 4096), torch.uint8, "cpu", True, back_end,
                                                 registration_granularity_bytes=4096)
        assert back_end.calls == 1 and made == [(64, 4096)] and fake.held()
        compat._cuda_host_unregister(theirs)
        assert fake.held() == set()


@pytest.mark.parametrize("layout", ["layer_first", "page_first", "page_first_direct"])
def test_sglangs_own_mla_pool_comes_up_through_hicache_and_goes_down_clean(sglang, layout):
    """The same for SGLang's real MLATokenToKVPoolHost (one latent buffer per pool), built as a
    server builds it: by SGLang's assembler (`build_kv_host_pool`) from the published settings."""
    import sglang.srt.plugins as plugins
    from sglang.srt.mem_cache.hybrid_cache.hybrid_pool_assembler import build_kv_host_pool
    from sglang.srt.mem_cache.memory_pool import MLATokenToKVPool
    from sglang.srt.mem_cache.pool_host.base import host_memory_budget_scope
    from sglang.srt.mem_cache.pool_host.mla import MLATokenToKVPoolHost

    plugins.load_plugins()
    device = MLATokenToKVPool(size=256, page_size=16, dtype=torch.bfloat16, kv_lora_rank=64, qk_rope_head_dim=16,
                              layer_num=3, device="cpu", enable_memory_saver=False)
    with fake_cuda() as fake, published(page_size=16, hicache_ratio=2.0, hicache_mem_layout=layout):
        with host_memory_budget_scope(10**12):
            host = build_kv_host_pool(kv_pool=device, page_size=16)
        assert isinstance(host, MLATokenToKVPoolHost) and host.layout == layout
        buffers = host.kv_buffer if isinstance(host.kv_buffer, list) else [host.kv_buffer]
        recorded = {tuple(r) for b in buffers for r in b._sglang_cuda_host_registered_ranges}
        assert recorded and recorded == fake.held()
        host.destroy()
        assert fake.held() == set()


def test_the_chunk_setting_is_read_through_sglangs_envs(sglang, monkeypatch):
    """In an SGLang process hicache reads SGLANG_HICACHE_HOST_REGISTER_CHUNK_GB through SGLang's
    own `envs` accessor: its override, its floor of 1 GiB, and its reading of a bad value (a
    warning and the default 256 GiB, where hicache alone would refuse it)."""
    from sglang.srt.environ import envs

    from hicache.compat import sglang as compat

    setting = envs.SGLANG_HICACHE_HOST_REGISTER_CHUNK_GB
    with setting.override(3):
        assert compat.host_register_chunk_bytes() == 3 * 2**30
    with setting.override(0):
        assert compat.host_register_chunk_bytes() == 2**30
    monkeypatch.setenv("SGLANG_HICACHE_HOST_REGISTER_CHUNK_GB", "junk")
    with pytest.warns(UserWarning, match="Invalid value for SGLANG_HICACHE_HOST_REGISTER_CHUNK_GB"):
        assert compat.host_register_chunk_bytes() == 256 * 2**30
    with pytest.raises(ValueError, match="must be an integer number of GiB"):
        compat.host_register_chunk_bytes(env={"SGLANG_HICACHE_HOST_REGISTER_CHUNK_GB": "junk"})


def test_the_plug_in_scopes_its_pool_classes_to_sglangs_process_not_the_process(sglang, monkeypatch):
    """The pool classes the plug-in gives SGLang ask SGLang's process - the chunk setting through
    SGLang's envs, its PP sync, its back ends' allocators - through their default `HostSetup`
    (issue #55 item 3); loading it sets no process-wide server, so a hicache pool built outside
    those classes asks none; HICACHE_SGLANG=off registers nothing."""
    from sglang.srt.environ import envs

    import hicache.pools as pools
    from hicache.compat import sglang_plugin
    from hicache.compat.sglang_process import SGLangProcess

    monkeypatch.setenv("HICACHE_SGLANG", "off")
    assert sglang_plugin.load() == []
    monkeypatch.delenv("HICACHE_SGLANG")
    assert sglang_plugin.load()
    assert pools.server() is pools.NO_SERVER  # nothing process-wide
    served = sglang_plugin.served_pool_classes()
    mla = served["sglang.srt.mem_cache.pool_host.mla.MLATokenToKVPoolHost"]
    process = mla.default_host.server
    assert isinstance(process, SGLangProcess) and mla.__name__ == "MLATokenToKVPoolHost"
    with envs.SGLANG_HICACHE_HOST_REGISTER_CHUNK_GB.override(3):
        assert process.chunk_limit_bytes() == 3 * 2**30
    assert process.synced_size(4096, 2.0) == 4096  # no PP group here: SGLang keeps the size
    assert process.storage_allocator("file") is None  # SGLang's plain default: hicache's serves
    logical = served["sglang.srt.mem_cache.memory_pool_host.LogicalHostPool"]
    assert logical is pools.LogicalHostPool  # holds no memory: no server to ask


def test_the_bring_up_is_told_through_sglangs_own_logger(sglang, monkeypatch, caplog):
    """The plan (calls, largest, every cap and its source), progress per call and the timings
    reach SGLang's logger for the seam (`pool_host.common`), so its log level and logging
    config decide what a server shows. A kernel pin cap (HICACHE_KERNEL_PIN_CAP) binds here."""
    import sglang.srt.plugins as plugins

    from hicache.compat._sglang_log import SGLANG_LOGGER

    plugins.load_plugins()
    monkeypatch.setenv("HICACHE_KERNEL_PIN_CAP", "64KiB")
    device = _device_pool()
    with fake_cuda() as fake, caplog.at_level("INFO", logger=SGLANG_LOGGER):
        host = _host_pool(device, "page_first_direct")
        calls = len([entry for entry in fake.cudart.log if entry[0] == "register"])
        host.destroy()
    lines = [r.getMessage() for r in caplog.records if r.name == SGLANG_LOGGER and "hicache:" in r.getMessage()]
    plans = [line for line in lines if "cudaHostRegister call(s)" in line]
    assert len(plans) == 1  # one buffer holds K and V in this layout
    assert all("kernel cap 64 KiB (HICACHE_KERNEL_PIN_CAP)" in line and "binding: kernel_cap" in line
               and "chunk 256 GiB (SGLang's default 256 GiB)" in line and "driver ceiling" in line for line in plans)
    assert sum(int(line.split(": ")[2].split()[0]) for line in plans) == calls > 2
    progress = [line for line in lines if "hicache: registered" in line]
    assert progress and progress[-1].startswith(f"hicache: registered {calls}/{calls} calls")
    ready = [line for line in lines if " ready: pre-faulted in " in line]
    assert len(ready) == 1 and all("GB/s" in line or "instant" in line for line in ready)


def test_without_the_plug_in_the_same_pool_would_call_the_real_cuda(sglang):
    """Not vacuous: SGLang's own function reaches for torch's CUDA, which a CPU torch lacks."""
    device = _device_pool()
    with fake_cuda(), pytest.raises((AssertionError, RuntimeError)):
        _host_pool(device, "page_first_direct")


def test_a_failed_register_leaves_nothing_registered_and_raises_runtime_error(sglang, monkeypatch):
    """What SGLang's constructor sees when the driver refuses call k (for every k of a buffer
    that takes several calls): a RuntimeError, as its own helper raises, with nothing left
    registered and nothing hicache mapped for it left mapped."""
    import sglang.srt.plugins as plugins

    plugins.load_plugins()
    made = recording_allocators(monkeypatch)
    monkeypatch.setenv("HICACHE_KERNEL_PIN_CAP", "64KiB")
    device = _device_pool()
    with fake_cuda() as fake:
        _host_pool(device, "page_first_direct").destroy()
        calls = len([entry for entry in fake.cudart.log if entry[0] == "register"])
    assert calls > 2
    for k in range(calls):
        made.clear()
        with fake_cuda(fail_register={k: 2}) as fake, pytest.raises(RuntimeError, match="cudaErrorMemoryAllocation"):
            _host_pool(device, "page_first_direct")
        assert fake.held() == set(), k
        assert made and all(allocator.owned() == [] for allocator in made), k


@pytest.mark.parametrize(
    "version, points, env, status, says",
    [
        (None, (), {}, "pass", "SGLang is not installed"),
        ("0.5.23", ("hicache",), {}, "pass", "replaces alloc_with_host_register, _cuda_host_register, _cuda_host_unregister"),
        ("0.5.23", (), {}, "fail", "entry point is not in group sglang.srt.plugins"),
        ("0.5.23", ("hicache", "other"), {"SGLANG_PLUGINS": "other"}, "warn", "leaves hicache out"),
        ("0.5.23", ("hicache",), {"SGLANG_PLUGINS": "other, hicache"}, "pass", "loads in every SGLang process"),
        ("0.5.23", ("hicache",), {"HICACHE_SGLANG": "off"}, "warn", "HICACHE_SGLANG=off"),
        ("0.5.23", ("hicache",), {"HICACHE_SGLANG": "maybe"}, "fail", "HICACHE_SGLANG='maybe' must be on or off"),
        ("0.6.0", ("hicache",), {}, "warn", "outside the tested range (>=0.5.23, <0.5.24)"),
    ],
)
def test_doctor_says_whether_the_plug_in_will_load(monkeypatch, version, points, env, status, says):
    """`hicache doctor`'s sglang rule: installed or not (version), entry point discoverable,
    admitted by SGLANG_PLUGINS, turned off, inside the tested range - and what it replaces.
    Machine-independent: version and entry points are injected."""
    from hicache.cli._doctor import Context, _sglang
    from hicache.compat import sglang_plugin

    monkeypatch.setattr(sglang_plugin, "sglang_version", lambda: version)
    monkeypatch.setattr(sglang_plugin, "entry_point_names", lambda: points)
    context = Context(plan=None, facts=None, resolved=None, env=env, cuda_binding=None, total=0, calls=0,
                      largest=0, ranks=1, limits=None)
    check = _sglang(context)
    assert (check.status, check.name) == (status, "sglang") and says in check.finding + check.hint, check


@pytest.mark.parametrize("version, tested", [
    ("0.5.23", True), ("0.5.23.post1", True), ("0.5.23rc2", True), ("0.5.22", False), ("0.5.22.post3", False),
    ("0.5.24", False), ("0.5.24rc0", False), ("0.5.3", False), ("0.6.0", False), ("1.0.0", False), (None, False),
    ("", False), ("dev", False),
])
def test_only_the_release_the_plug_in_was_tested_with_counts_as_tested(version, tested):
    """0.5.23 and its post releases are tested; the next release (0.5.24) is not - the plug-in
    then patches nothing and says so - nor anything before, nor a version it cannot read."""
    from hicache.compat import sglang_plugin

    assert sglang_plugin.supported(version) is tested


@pytest.mark.concurrency  # four processes at once
@pytest.mark.load_free("its ranks' order is fixed by file barriers (all sample before any maps), whatever the load; "
                       "the same lock's law runs under load in test_ranks_fill and test_ranks")
def test_four_ranks_starting_together_against_room_for_two_admit_exactly_two(tmp_path):
    """Four processes build SGLang's real pool with the plug-in at the same moment on a host
    with room for two (its free memory drops as soon as a pool is mapped): SGLang's own check,
    sampled under hicache's budget lock against the machine less the claims still filling (the
    lock goes at once, issue #35), admits exactly two - also when a rank samples before an
    admitted one has mapped anything; the others fail with SGLang's own "Not enough host memory"
    error."""
    need_sglang()  # the ranks import SGLang (once, in the zygote that forks them)
    ranks = 4  # two refused beside the two admitted
    tokens = 4096  # 4096 tokens x 4 layers x 2 x 2 heads x 64 x 2 bytes = 8 MiB
    pool_bytes = (tokens // 16 + 1) * 16 * 4 * 2 * 2 * 64 * 2
    shared = tmp_path / "host"
    shared.mkdir()
    runtime = tmp_path / "run"
    runtime.mkdir(mode=0o700)
    with Zygote(sglang=True, env={"HICACHE_RUNTIME_DIR": str(runtime)}) as zygote:
        for rank in range(ranks):
            zygote.start(f"rank{rank}", "admission_rank", shared=str(shared), room=pool_bytes * 5 // 2, ranks=ranks,
                         tokens=tokens)
        results = [zygote.result(f"rank{rank}") for rank in range(ranks)]
    admitted = [r for r in results if "admitted" in r]
    assert len(admitted) == 2, results
    assert all("Not enough host memory available" in r["refused"] for r in results if "refused" in r), results


_STAT = ("anon 2000\nshmem 300\nactive_file {active}\ninactive_file {inactive}\ntotal_active_file {active}\n"
         "total_inactive_file {inactive}\n")


def _cgroup_tree(root, version: str, groups: dict) -> None:
    """A /proc and cgroup mount under ``root`` both readers read: /proc/self/cgroup naming the
    last group of ``groups``, the mount in mountinfo (SGLang resolves it there), and per group
    its files ({file: value}; memory.stat from ``active``/``inactive``, memory.min 0)."""
    mount = root / ("sys/fs/cgroup" if version == "v2" else "sys/fs/cgroup/memory")
    line = (f"30 25 0:26 / {mount} rw,nosuid - cgroup2 cgroup2 rw" if version == "v2"
            else f"40 25 0:35 / {mount} rw,nosuid - cgroup cgroup rw,memory")
    (root / "proc/self").mkdir(parents=True)
    (root / "proc/self/mountinfo").write_text(line + "\n")
    own = list(groups)[-1]
    (root / "proc/self/cgroup").write_text(f"0::{own}\n" if version == "v2" else f"4:memory:{own}\n0::/\n")
    for group, files in groups.items():
        directory = mount / group.strip("/")
        directory.mkdir(parents=True, exist_ok=True)
        files = dict(files)
        cache = files.pop("cache", (0, 0))
        (directory / "memory.stat").write_text(_STAT.format(active=cache[0], inactive=cache[1]))
        (directory / "memory.min").write_text("0\n")
        for name, value in files.items():
            (directory / name).write_text(f"{value}\n")


@pytest.mark.parametrize("version, groups", [
    ("v2", {"/job": {"memory.max": 10**10, "memory.current": 9 * 10**9, "cache": (10**9, 5 * 10**9)}}),
    ("v2", {"/pod": {"memory.max": 8 * 10**9, "memory.current": 3 * 10**9, "cache": (0, 10**9)},
            "/pod/ctr": {"memory.max": "max", "memory.current": 2 * 10**9}}),
    ("v2", {"/pod": {"memory.max": 8 * 10**9, "memory.current": 3 * 10**9},
            "/pod/ctr": {"memory.max": 10**10, "memory.current": 9 * 10**9, "cache": (0, 2 * 10**9)}}),
    ("v2", {"/job": {"memory.max": 10**10, "memory.high": 6 * 10**9, "memory.current": 10**9}}),
    ("v1", {"/slurm": {"memory.limit_in_bytes": 9223372036854771712, "memory.usage_in_bytes": 10**9},
            "/slurm/job7": {"memory.limit_in_bytes": 32 * 10**9, "memory.usage_in_bytes": 20 * 10**9,
                            "cache": (3 * 10**9, 4 * 10**9)}}),
])
def test_the_budgets_cgroup_room_is_sglangs_own_headroom(sglang, tmp_path, version, groups):
    """SGLang 0.5.23's own cgroup headroom (`host_memory._cgroup_memory_headroom`, what its
    admission bounds available memory by) as the oracle: over the same fake trees - a group's own
    limit, a parent's, two limits, v2's memory.high, v1 - hicache's cgroup figures (limit less
    usage, the page cache taken off) give the same room, so pools mode admits as SGLang would."""
    from sglang.srt.mem_cache.host_memory import _cgroup_memory_headroom

    from hicache.effects import probe_machine

    _cgroup_tree(tmp_path, version, groups)
    facts = probe_machine(root=str(tmp_path), env={})
    ours = facts.cgroup_limit_bytes - facts.cgroup_usage_bytes
    assert ours == _cgroup_memory_headroom(tmp_path / "proc")
