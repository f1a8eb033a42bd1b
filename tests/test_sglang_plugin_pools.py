"""SGLang 0.5.23's other host-pool families under the hicache plug-in, and an interrupt at each
register call through SGLang's own constructor.

Mamba (`MambaPoolHost` over a `MambaStateBufferInfo`), DSA's indexer (`DSAIndexerPoolHost` beside
its MLA anchor, from SGLang's `make_dsa_indexer_pool_decl`) and DeepSeek-V4's paged and state
pools (`DeepSeekV4PagedHostPool`, `DeepSeekV4StateHostPool` over SGLang's `CompressStatePool`),
all built by SGLang's real code on CPU with a small kernel pin cap so every buffer takes several
calls: each call is hicache's plan (within the cap, every boundary on the granularity SGLang
passed, the calls tiling the buffer), the ranges SGLang records are exactly those registered,
and SGLang's own destroy() leaves nothing held. Needs `make sglang`."""

from __future__ import annotations

import os

import pytest
from sglang_support import cuda_at_destroy, published, recording_allocators, sglang  # noqa: F401 - sglang: a fixture

from hicache.testing import fake_cuda
from hicache.effects import HostSetup

torch = pytest.importorskip("torch")

CAP = 16 * 1024  # HICACHE_KERNEL_PIN_CAP: several calls per buffer even for these small pools


@pytest.fixture
def plugged(sglang, monkeypatch):
    """SGLang with the plug-in loaded by its own loader, and a record of the granularity SGLang
    passed for each buffer (by its size)."""
    import sglang.srt.plugins as plugins

    from hicache.compat import sglang as compat

    plugins.load_plugins()
    granularities: dict[int, object] = {}
    real = compat._chunk_plan

    def spy(total, granularity, base_alignment):
        granularities[total] = granularity
        return real(total, granularity, base_alignment)

    monkeypatch.setattr(compat, "_chunk_plan", spy)
    return granularities


def _tensors(pool) -> list:
    """Every host buffer the pool registered: each tensor carrying SGLang's ranges attribute."""
    seen, found = set(), []
    values = list(vars(pool).values())
    while values:
        value = values.pop()
        if isinstance(value, (list, tuple)):
            values.extend(value)
        elif isinstance(value, torch.Tensor) and hasattr(value, "_sglang_cuda_host_registered_ranges"):
            if id(value) not in seen:
                seen.add(id(value))
                found.append(value)
    return found


def _small_cap(monkeypatch, layout: str, cap: int = CAP):
    """A kernel pin cap that splits every buffer - except layer-first ones, which SGLang passes
    without a copy unit: they must be one call each (hicache refuses to split them blind)."""
    if layout == "layer_first":
        return None
    monkeypatch.setenv("HICACHE_KERNEL_PIN_CAP", str(cap))
    return cap


def _check_calls(fake, buffers, granularities, cap) -> None:
    recorded = set()
    for buffer in buffers:
        base, nbytes = buffer.data_ptr(), buffer.numel() * buffer.element_size()
        ranges = sorted(tuple(r) for r in buffer._sglang_cuda_host_registered_ranges)
        assert ranges[0][0] == base and sum(size for _, size in ranges) == nbytes
        assert all(p + s == q for (p, s), (q, _) in zip(ranges, ranges[1:]))  # they tile the buffer
        granularity = granularities[nbytes]
        if cap is None or granularity is None:
            assert len(ranges) == 1 if granularity is None else all(size <= 2**38 for _, size in ranges)
        else:
            assert all(size <= cap for _, size in ranges) and len(ranges) > 1
            assert all((ptr - base) % granularity == 0 for ptr, _ in ranges)  # no page straddles one
        recorded |= set(ranges)
    assert recorded == fake.held()
    assert len([e for e in fake.cudart.log if e[0] == "register"]) == len(recorded)


def _budget():
    from sglang.srt.mem_cache.pool_host.base import host_memory_budget_scope

    return host_memory_budget_scope(10**12)  # SGLang's own way to give its check a budget


@pytest.mark.parametrize("layout", ["page_first", "page_first_direct"])
def test_sglangs_mamba_pool(plugged, layout, monkeypatch):
    """SGLang's Mamba host pool comes up and tears down through the plug-in with nothing left
    registered."""
    from sglang.srt.mem_cache.device_pool_info import MambaStateBufferInfo
    from sglang.srt.mem_cache.pool_host.mamba import MambaPoolHost

    cap = _small_cap(monkeypatch, layout)
    info = MambaStateBufferInfo(temporal=torch.zeros(2, 9, 16, 32), conv=(torch.zeros(2, 9, 8, 32),))
    with fake_cuda() as fake:
        with _budget():
            host = MambaPoolHost(info, 2.0, 0, device_capacity=8, layout=layout)
        _check_calls(fake, _tensors(host), plugged, cap)
        host.destroy()
        assert fake.held() == set()
        fake.check_valid()


def _dsa_device_and_anchor(anchor_cls):
    """SGLang's DSA device pool (2 layers, 64-token pages) and its MLA anchor host pool, built by
    ``anchor_cls`` (SGLang's, or the name pools mode replaced) under SGLang's budget scope."""
    from sglang.srt.mem_cache.memory_pool import DSATokenToKVPool

    device = DSATokenToKVPool(size=256, page_size=64, kv_lora_rank=64, dtype=torch.bfloat16, qk_rope_head_dim=16,
                              layer_num=2, device="cpu", index_head_dim=128, enable_memory_saver=False,
                              kv_cache_dim=80)
    info = device.get_device_pool_infos()[0].buffer_info
    with _budget():
        anchor = anchor_cls(info, 2.0, 0, 64, "page_first", True, "cpu", device_capacity_tokens=256, start_layer=0,
                            end_layer=2, target_layer_num=2)
    return device, anchor


def test_sglangs_dsa_indexer_pool_beside_its_mla_anchor(plugged, monkeypatch):
    """SGLang's DSA indexer pool beside its MLA anchor comes up and tears down through the plug-in,
    nothing left registered."""
    from sglang.srt.mem_cache.pool_host.dsa import DSAIndexerPoolHost, make_dsa_indexer_pool_decl
    from sglang.srt.mem_cache.pool_host.mla import MLATokenToKVPoolHost

    cap = _small_cap(monkeypatch, "page_first", 64 * 1024)  # above its 20 KiB page
    with published(), fake_cuda() as fake:
        device, anchor = _dsa_device_and_anchor(MLATokenToKVPoolHost)
        with _budget():
            indexer = DSAIndexerPoolHost(make_dsa_indexer_pool_decl(device), anchor)
        _check_calls(fake, _tensors(anchor) + _tensors(indexer), plugged, cap)
        cuda_at_destroy(monkeypatch, "sglang.srt.mem_cache.pool_host.dsa")
        indexer.destroy()
        anchor.destroy()
        assert fake.held() == set()
        fake.check_valid()


@pytest.mark.parametrize("layout", ["layer_first", "page_first", "page_first_direct"])
def test_sglangs_deepseek_v4_paged_pool(plugged, layout, monkeypatch):
    """SGLang's DeepSeek-V4 paged pool comes up and tears down through the plug-in, nothing left
    registered."""
    from sglang.srt.mem_cache.memory_pool_host import DeepSeekV4PagedHostPool

    cap = _small_cap(monkeypatch, layout)
    device_buffers = [torch.zeros(16, 512, dtype=torch.uint8) for _ in range(3)]
    with fake_cuda() as fake:
        with _budget():
            host = DeepSeekV4PagedHostPool("c4", device_buffers, 512, 96, 64, layout=layout, page_aligned_only=True)
        _check_calls(fake, _tensors(host), plugged, cap)
        host.destroy()
        assert fake.held() == set()
        fake.check_valid()


@pytest.mark.parametrize("layout", ["layer_first", "page_first"])
def test_sglangs_deepseek_v4_state_pool(plugged, layout, monkeypatch):
    """SGLang's DeepSeek-V4 state pool comes up and tears down through the plug-in, nothing left
    registered."""
    from sglang.srt.mem_cache.deepseek_v4_compress_state import CompressStatePool
    from sglang.srt.mem_cache.memory_pool_host import DeepSeekV4StateHostPool

    cap = _small_cap(monkeypatch, layout)
    states = [CompressStatePool(size=64, ring_size=4, overlap=False, head_dim=64, dtype=torch.float32, device="cpu",
                                enable_memory_saver=False, ratio=4, swa_page_size=16) for _ in range(2)]
    with fake_cuda() as fake:
        with _budget():
            host = DeepSeekV4StateHostPool("state", states, 48, 16, layout=layout)
        _check_calls(fake, _tensors(host), plugged, cap)
        host.destroy()
        assert fake.held() == set()
        fake.check_valid()


def test_in_pools_mode_hisparses_deepseek_v4_pool_stays_sglangs_and_the_trees_are_hicaches(sglang, monkeypatch):
    """HICACHE_SGLANG_POOLS=1: SGLang's HiSparse coordinator builds its DeepSeek-V4 C4 pool
    ("dsv4_hisparse_c4", through the name its module imported) as SGLang's own class - its decode
    backups copy single tokens of the fused row, which hicache's V4 pools refuse - pinned through
    the seam; the same replaced class builds hicache's for the tree's pools. Nothing stays held."""
    import sglang.srt.managers.hisparse_coordinator as coordinator
    import sglang.srt.mem_cache.hybrid_cache.hybrid_pool_assembler as assembler

    from sglang_support import plug

    plug(monkeypatch, pools=True)
    assert coordinator.DeepSeekV4PagedHostPool is assembler.DeepSeekV4PagedHostPool  # the one class pools mode put
    rows = [torch.zeros(16, 512, dtype=torch.uint8) for _ in range(2)]
    built = dict(device_buffers=rows, item_bytes=512, num_host_pages=8, slot_page_size=64, layout="layer_first")
    with fake_cuda() as fake:
        with _budget():
            theirs = coordinator.DeepSeekV4PagedHostPool(pool_name="dsv4_hisparse_c4", **built)
            ours = assembler.DeepSeekV4PagedHostPool("deepseek_v4_c4", **built)
        try:
            assert type(theirs).__module__ == "sglang.srt.mem_cache.memory_pool_host"
            assert callable(theirs.backup_tokens_from_device_all_layer)
            assert type(ours).__module__.startswith("hicache.") and ours.pool_name == "deepseek_v4_c4"
            assert {tuple(r) for t in _tensors(theirs) for r in t._sglang_cuda_host_registered_ranges} < fake.held()
        finally:
            theirs.destroy()
            ours.destroy()
        assert fake.held() == set()
        fake.check_valid()


def test_pools_mode_built_again_over_its_own_classes_is_an_error_naming_the_class(sglang, monkeypatch):
    """Keeping SGLang's class for HiSparse's pool needs SGLang's class: asked again once hicache's
    is in its place (a second load without a reset), the plug-in says so instead of keeping its own."""
    from sglang_support import plug

    from hicache.compat.sglang_plugin import served_pool_classes

    plug(monkeypatch, pools=True)
    with pytest.raises(RuntimeError, match="DeepSeekV4PagedHostPool is hicache's already"):
        served_pool_classes()


def test_a_ctrl_c_at_each_register_call_leaves_sglangs_constructor_holding_nothing(plugged, monkeypatch):
    """KeyboardInterrupt at call k (before it takes effect, and after it did), for every k of an
    MHA pool's registration: SGLang's constructor raises KeyboardInterrupt, nothing stays
    registered, and every buffer hicache mapped for it is unmapped again."""
    from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool
    from sglang.srt.mem_cache.pool_host.mha import MHATokenToKVPoolHost

    made = recording_allocators(monkeypatch)
    _small_cap(monkeypatch, "page_first_direct")
    device = MHATokenToKVPool(size=256, page_size=16, dtype=torch.bfloat16, head_num=2, head_dim=64, layer_num=3,
                              device="cpu", enable_memory_saver=False)
    info = device.get_device_pool_infos()[0].buffer_info

    def build():
        with _budget():
            return MHATokenToKVPoolHost(info, 2.0, 0, 16, "page_first_direct", True, "cpu",
                                        device_capacity_tokens=256, start_layer=0, end_layer=3)

    with fake_cuda() as fake:
        whole = build()
        calls = len([e for e in fake.cudart.log if e[0] == "register"])
        whole.destroy()
    assert calls > 3
    for k in range(calls):
        for when in ("before", "after"):
            made.clear()
            with fake_cuda(interrupt_register={k: when}) as fake, pytest.raises(KeyboardInterrupt):
                build()
            assert fake.held() == set(), (k, when)
            assert made and all(allocator.owned() == [] for allocator in made), (k, when)
            fake.check_valid()


def test_hicache_pools_inside_sglangs_budget_scope_leave_no_claim_once_up(plugged):
    """With the plug-in loaded, SGLang's admission check (wrapped: it claims an admitted request
    on the host-wide lock) admits hicache's pool inside SGLang's budget scope; once the pool is
    up its claim is paid off - none left to shrink the host's room for the next rank. (The pool
    class the plug-in gives SGLang: it asks SGLang's process.)"""
    from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool
    from sglang.srt.mem_cache.pool_host.base import host_memory_budget_scope

    from hicache.compat.sglang_plugin import served_pool_classes
    from hicache.effects.admission import budget_lock

    MHATokenToKVPoolHost = served_pool_classes()["sglang.srt.mem_cache.pool_host.mha.MHATokenToKVPoolHost"]

    device = MHATokenToKVPool(size=256, page_size=16, dtype=torch.bfloat16, head_num=2, head_dim=64, layer_num=2,
                              device="cpu", enable_memory_saver=False)
    info = device.get_device_pool_infos()[0].buffer_info
    with fake_cuda(), host_memory_budget_scope(10**9):
        pool = MHATokenToKVPoolHost(info, 2.0, 0, 16, "page_first", device_capacity_tokens=256, start_layer=0,
                                    end_layer=1, host=HostSetup(host_memory_bytes=10**6))
        try:
            with budget_lock() as lock:
                assert lock.pending_bytes() == 0 and os.getpid() not in lock.claims()
        finally:
            pool.destroy()


def test_in_pools_mode_a_pool_hicache_does_not_serve_fails_sglangs_constructor_naming_the_switch(sglang,
                                                                                                monkeypatch):
    """HICACHE_SGLANG_POOLS=1 with a model whose pools hicache's classes do not serve (FP4 or
    MXFP8 KV scales, a relocatable device pool, layer-sharded MLA, Mamba's per-slot side state):
    SGLang's own constructor name - what its assembler calls - raises a `NotServedError` that
    says why and names the switch that serves it (SGLang's own pools, still under hicache's
    registration), before a byte is registered; bad inputs SGLang refuses too get no such hint,
    and hicache's classes used directly (no plug-in) name no SGLang switch."""
    import re

    import sglang.srt.mem_cache.pool_host.mamba as smamba
    import sglang.srt.mem_cache.pool_host.mha as smha
    import sglang.srt.mem_cache.pool_host.mla as smla
    from sglang_support import plug
    from test_sglang_conformance import KW, LAYERS, PAGE, ROOM, _refused_inputs

    import hicache.pools as pools
    from hicache.compat.sglang_plugin import NOT_SERVED_HINT
    from hicache.errors import LayoutError, NotServedError

    plug(monkeypatch, pools=True)
    names = {"mha": (smha.MHATokenToKVPoolHost, pools.MHATokenToKVPoolHost),
             "mla": (smla.MLATokenToKVPoolHost, pools.MLATokenToKVPoolHost),
             "mamba": (smamba.MambaPoolHost, pools.MambaPoolHost)}
    assert all(theirs.__module__.startswith("hicache.") for theirs, _ in names.values())  # pools mode's classes
    with fake_cuda() as fake:
        for family, info, extra, words, sglang_serves in _refused_inputs():
            for cls, plugged in zip(names[family], (True, False)):
                kw = dict(extra) if family == "mamba" else dict(KW, **extra)
                if family == "mla":
                    kw.setdefault("target_layer_num", LAYERS)
                with pytest.raises(LayoutError, match=re.escape(words)) as caught:
                    with _budget():
                        if family == "mamba":
                            cls(info, 2.0, 0, device_capacity=8, layout="page_first", **kw, **ROOM)
                        else:
                            cls(info, 2.0, 0, PAGE, "page_first", **kw, **ROOM)
                assert isinstance(caught.value, NotServedError) == sglang_serves, words
                assert (NOT_SERVED_HINT in str(caught.value)) == (sglang_serves and plugged), (words, plugged)
                assert fake.held() == set() and fake.cudart.register_calls == 0, words


def test_in_pools_mode_a_layer_sharded_dsa_indexer_fails_its_constructor_naming_the_switch(sglang, monkeypatch):
    """HICACHE_SGLANG_POOLS=1 and a DSA model whose device pool is layer-sharded: SGLang's
    `DSAIndexerPoolHost` name (hicache's class now) beside its MLA anchor raises a `NotServedError`
    naming the sharding and the switch, registering nothing of its own; the anchor is unharmed."""
    import sglang.srt.mem_cache.pool_host.dsa as sdsa
    import sglang.srt.mem_cache.pool_host.mla as smla
    from sglang_support import plug

    from hicache.compat.sglang_plugin import NOT_SERVED_HINT
    from hicache.errors import NotServedError

    plug(monkeypatch, pools=True)
    assert all(cls.__module__.startswith("hicache.") for cls in (sdsa.DSAIndexerPoolHost, smla.MLATokenToKVPoolHost))
    with published(), fake_cuda() as fake:
        device, anchor = _dsa_device_and_anchor(smla.MLATokenToKVPoolHost)
        held = fake.held()
        device.layer_shard_enabled = True
        with pytest.raises(NotServedError, match="layer-sharded DSA device pool") as caught:
            with _budget():
                sdsa.DSAIndexerPoolHost(sdsa.make_dsa_indexer_pool_decl(device), anchor)
        assert NOT_SERVED_HINT in str(caught.value) and fake.held() == held
        anchor.destroy()
        assert fake.held() == set()
