"""One geometry per pool (issue #34 items 1, 2): for every family and every constructor form it
serves, what the pool reports (``size``, ``page_num``, ``size_per_token``, its buffers) is what
its plan brought up - the bytes the fake driver registered, the buffers' bytes, the slots its
allocator hands out - and the form recorded is the one the call used; each named constructor
builds its own form and refuses another. The older forms run on hicache's fake device pools, the
0.5.23 forms on SGLang's own descriptions (the wheel, on CPU)."""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
from sglang_support import published, sglang  # noqa: F401 - sglang: a fixture

from hicache.errors import LayoutError
from hicache.plan import Limits, dsa_indexer_pages
from hicache.pools import (
    AsymmetricMHATokenToKVPoolHost,
    DeepSeekV4PagedHostPool,
    DeepSeekV4StateHostPool,
    DSAIndexerPoolHost,
    MambaPoolHost,
    MHATokenToKOnlyPoolHost,
    MHATokenToKVPoolHost,
    MLATokenToKVPoolHost,
)
from hicache.pools import NoServer
from hicache.pools._forms import FORMS
from hicache.pools._geometry import make_geometry
from hicache.testing import (
    AsymmetricMHADevicePool,
    DeepSeekV4DevicePool,
    DSAIndexerDevicePool,
    MambaDevicePool,
    MHADevicePool,
    MLADevicePool,
    fake_cuda,
)

from machine import ROOMY
from hicache.effects import HostSetup

torch = pytest.importorskip("torch")
P = 4
ROOM = dict(host=HostSetup(limits=Limits(chunk_limit_bytes=1 << 20, os_page_bytes=64), machine=ROOMY))


def _mha(**kw):
    return MHADevicePool(size=64, layer_num=3, head_num=2, head_dim=8, page_size=P, **kw)


OLDER = {  # the older SGLang's form: a device pool first (hicache's fakes of SGLang's pools)
    MHATokenToKVPoolHost: _mha,
    MHATokenToKOnlyPoolHost: lambda: _mha(k_only=True),
    AsymmetricMHATokenToKVPoolHost: lambda: AsymmetricMHADevicePool(size=64, layer_num=3, head_num=2, k_head_dim=12,
                                                                    v_head_dim=4, page_size=P),
    MLATokenToKVPoolHost: lambda: MLADevicePool(size=64, layer_num=3, kv_lora_rank=16, qk_rope_head_dim=4,
                                                page_size=P),
    DSAIndexerPoolHost: lambda: DSAIndexerDevicePool(size=64, layer_num=3, index_head_dim=16, quant_block_size=8,
                                                     page_size=P),
    MambaPoolHost: lambda: MambaDevicePool(size=16, layer_num=3, temporal_shape=(2, 4), conv_shapes=((3, 2),),
                                           page_size=1),
    DeepSeekV4PagedHostPool: lambda: DeepSeekV4DevicePool(size=64, layer_num=3, item_bytes=24, page_size=P),
    DeepSeekV4StateHostPool: lambda: DeepSeekV4DevicePool(size=64, layer_num=3, state_page_bytes=40, page_size=P),
}


def _older(cls, layout):
    device = OLDER[cls]()
    if cls is MambaPoolHost:
        return cls(device, 2.0, 0, layout=layout, **ROOM)
    return cls(device, 2.0, 0, device.page_size, layout, **ROOM)


def _reports_what_it_brought_up(pool, fake, others=()) -> None:
    """The pool's reported size is its geometry's, and the geometry's descriptor is what is planned,
    allocated, registered and handed out (``others``: pools beside it, an anchor, whose
    registrations the driver holds too)."""
    geometry = pool.geometry
    assert (pool.size, pool.page_num, pool.size_per_token) == (geometry.size, geometry.page_num,
                                                              geometry.size_per_token)
    assert pool.size == pool.page_num * pool.page_size == geometry.page_num * geometry.facts.page_size
    assert (pool.layer_num, pool.dtype, pool.page_size) == (geometry.facts.layer_num, geometry.facts.dtype,
                                                            geometry.facts.page_size)
    assert pool.descriptor is geometry.descriptor == pool.layout_descriptor(geometry.buffer_page_num)
    # a value of its shape and sizing alone (issue #55 item 1): made again with no pool, it is equal,
    # and every SGLang-facing field the pool carries is the geometry's own object
    again = make_geometry(type(pool).__name__, geometry.shape, geometry.form, geometry.sizing, geometry.layout,
                          pool_label=pool.pool_label)
    assert again == geometry and dict(again.fields).keys() == dict(geometry.fields).keys()
    assert all(getattr(pool, name) is value for name, value in geometry.fields.items())
    specs = geometry.descriptor.buffers()
    assert pool.pool_plan.total_bytes == sum(spec.nbytes for spec in specs)
    if pool.is_dummy:  # SGLang's allocator-only pool: the slots, no memory
        assert pool.kv_buffer is None and fake.held() == set()
    else:
        held = sum(size for _, size in fake.held()) - sum(other.pool_plan.total_bytes for other in others)
        assert held == pool.pool_plan.total_bytes, "registered bytes == planned bytes"
        buffers = pool.buffers
        assert [b.numel() * b.element_size() for b in buffers] == [spec.nbytes for spec in specs]
        assert [math.prod(b.shape) for b in buffers] == [math.prod(spec.shape) for spec in specs]
        assert tuple(b.dtype for b in buffers) == geometry.buffer_dtypes
    if pool.has_allocator:  # every slot it reports can be handed out, and no more
        assert pool.available_size() == pool.size
        assert pool.alloc(pool.size) is not None and pool.alloc(pool.logical_page_size) is None


@pytest.mark.parametrize("cls, layout", [(cls, layout) for cls in OLDER for layout in cls.descriptor_class().supported()],
                         ids=lambda v: v if isinstance(v, str) else v.__name__)
def test_an_older_form_pool_reports_what_it_brought_up(cls, layout):
    """Every family built the older way (a device pool first) reports its geometry's size, and
    that geometry is what was planned, allocated, registered and handed out."""
    with fake_cuda() as fake:
        pool = _older(cls, layout)
        try:
            assert pool.geometry.form.constructor == "from_device_pool" and pool.sglang_form == "older"
            _reports_what_it_brought_up(pool, fake)
        finally:
            pool.destroy()
        assert fake.held() == set()


def _sglang_device(kind: str):
    from sglang.srt.mem_cache.memory_pool import MHATokenToKOnlyPool, MHATokenToKVPool, MLATokenToKVPool

    common = dict(size=256, page_size=16, dtype=torch.bfloat16, layer_num=3, device="cpu", enable_memory_saver=False)
    return {"mha": lambda: MHATokenToKVPool(head_num=2, head_dim=64, **common),
            "asym": lambda: MHATokenToKVPool(head_num=2, head_dim=64, v_head_dim=32, **common),
            "mla": lambda: MLATokenToKVPool(kv_lora_rank=64, qk_rope_head_dim=16, **common),
            "k_only": lambda: MHATokenToKOnlyPool(head_num=1, head_dim=128, **common)}[kind]()


KW = dict(device_capacity_tokens=256, start_layer=0, end_layer=2)


def _built_by_sglangs_forms(form: str, layout: str):
    """``(pools to destroy, the pool under test)`` built by one of SGLang 0.5.23's forms."""
    if form == "mha description":
        info = _sglang_device("mha").get_device_pool_infos()[0].buffer_info
        pool = MHATokenToKVPoolHost.from_buffer_info(info, 2.0, 0, 16, layout, **KW, **ROOM)
        return [pool], pool
    if form == "asymmetric description":
        info = _sglang_device("asym").get_device_pool_infos()[0].buffer_info
        pool = AsymmetricMHATokenToKVPoolHost(info, 2.0, 0, 16, layout, **KW, **ROOM)
        return [pool], pool
    if form in ("mla description", "mla allocation"):
        info = _sglang_device("mla").get_device_pool_infos()[0].buffer_info
        if form == "mla allocation":
            from sglang.srt.mem_cache.pool_host.mla import MLAHostAllocation

            info = MLAHostAllocation(kv_lora_rank=64, qk_rope_head_dim=16, kv_cache_dim=80, dtype=torch.bfloat16,
                                     size_per_token=480)
        pool = MLATokenToKVPoolHost(info, 2.0, 0, 16, layout, **KW, target_layer_num=3, **ROOM)
        return [pool], pool
    if form == "k-only anchor":
        info = _sglang_device("mha").get_device_pool_infos()[0].buffer_info
        anchor = MHATokenToKVPoolHost(info, 2.0, 0, 16, layout, **KW, **ROOM)
        pool = MHATokenToKOnlyPoolHost.from_anchor(_sglang_device("k_only"), anchor, layout, **ROOM)
        return [pool, anchor], pool
    if form == "mamba state description":
        from sglang.srt.mem_cache.device_pool_info import MambaStateBufferInfo

        info = MambaStateBufferInfo(temporal=torch.zeros(2, 9, 16, 32), conv=(torch.zeros(2, 9, 8, 32),))
        pool = MambaPoolHost.from_buffer_info(info, 2.0, 0, device_capacity=8, layout=layout, **ROOM)
        return [pool], pool
    if form == "dsa declaration":
        from sglang.srt.mem_cache.memory_pool import DSATokenToKVPool
        from sglang.srt.mem_cache.pool_host.dsa import make_dsa_indexer_pool_decl

        device = DSATokenToKVPool(size=256, page_size=64, kv_lora_rank=64, dtype=torch.bfloat16, qk_rope_head_dim=16,
                                  layer_num=2, device="cpu", index_head_dim=128, enable_memory_saver=False,
                                  kv_cache_dim=80)
        info = device.get_device_pool_infos()[0].buffer_info
        anchor = MLATokenToKVPoolHost(info, 2.0, 0, 64, layout, device_capacity_tokens=256, start_layer=0,
                                      end_layer=2, target_layer_num=2, **ROOM)
        pool = DSAIndexerPoolHost.from_decl(make_dsa_indexer_pool_decl(device), anchor, **ROOM)
        assert pool.geometry.buffer_page_num == dsa_indexer_pages(anchor.size, 64) != pool.page_num == anchor.page_num
        return [pool, anchor], pool
    if form == "v4 pool_name paged":
        buffers = [torch.zeros(16, 512, dtype=torch.uint8) for _ in range(3)]
        pool = DeepSeekV4PagedHostPool.from_pool_name("c4", buffers, 512, 24, 64, layout=layout, **ROOM)
        assert pool.size_per_token == 512  # SGLang's: one row's bytes
        return [pool], pool
    assert form == "v4 pool_name state"
    states = [SimpleNamespace(kv_score_buffer=SimpleNamespace(kv_score=torch.zeros(64, 2, 64)), ring_size=4)
              for _ in range(2)]
    pool = DeepSeekV4StateHostPool.from_pool_name("state", states, 48, 16, layout=layout, **ROOM)
    return [pool], pool


SGLANG_FORMS = [
    ("mha description", "page_first", "from_buffer_info"), ("mha description", "layer_first", "from_buffer_info"),
    ("asymmetric description", "page_first_direct", "from_buffer_info"),
    ("mla description", "page_first", "from_buffer_info"), ("mla allocation", "page_first", "from_allocation"),
    ("k-only anchor", "page_first", "from_anchor"),
    ("mamba state description", "page_first", "from_buffer_info"),
    ("dsa declaration", "page_first_direct", "from_decl"), ("dsa declaration", "layer_first", "from_decl"),
    ("v4 pool_name paged", "layer_first", "from_pool_name"), ("v4 pool_name paged", "page_first", "from_pool_name"),
    ("v4 pool_name state", "layer_first", "from_pool_name"),
]


@pytest.mark.parametrize("form, layout, constructor", SGLANG_FORMS, ids=lambda v: v.replace(" ", "-"))
def test_a_pool_of_sglangs_forms_reports_what_it_brought_up(sglang, form, layout, constructor):
    """Built by each SGLang 0.5.23 form (its real descriptions), the pool records that form and
    reports what its geometry brought up; `from_geometry` of that geometry brings up the same
    again (MLA's allocation form: allocator-only, as the form says)."""
    with published(), fake_cuda() as fake:
        pools, pool = _built_by_sglangs_forms(form, layout)
        try:
            assert pool.geometry.form.constructor == constructor and pool.sglang_form == "0.5.23"
            _reports_what_it_brought_up(pool, fake, others=pools[1:])
            if pool.geometry.form.allocator_only:  # MLA's allocation: is_dummy as the form says, never memory
                with pytest.raises(LayoutError, match=r"is_dummy=False, but the allocation form's pools hold no memory"):
                    type(pool).from_geometry(pool.geometry, is_dummy=False, **ROOM)
            twin = type(pool).from_geometry(pool.geometry, **ROOM)  # the same geometry, brought up again
            pools.append(twin)
            assert twin.geometry is pool.geometry and twin.sglang_form == "0.5.23"
            _reports_what_it_brought_up(twin, fake, others=[p for p in pools if p is not twin])
        finally:
            for each in pools:
                each.destroy()
        assert fake.held() == set()


def test_the_form_table_covers_every_family():
    """Every family's pool_family names a FORMS row, whose last form is the older device pool's
    (the fallback), and every form's named constructor exists on the family."""
    for cls in OLDER:
        forms = FORMS[cls.pool_family]
        assert forms[-1][0].constructor == "from_device_pool"
        assert all(callable(getattr(cls, form.constructor)) for form, _ in forms)


def test_a_named_constructor_refuses_another_form():
    """``from_buffer_info`` with a device pool (and ``from_device_pool`` with a V4 pool name) is a
    LayoutError naming both forms, before any memory."""
    with fake_cuda() as fake:
        with pytest.raises(LayoutError, match=r"from_buffer_info\(\) was called with the device pool form"):
            MHATokenToKVPoolHost.from_buffer_info(_mha(), 2.0, 0, P, "page_first", **ROOM)
        with pytest.raises(LayoutError, match=r"from_device_pool\(\) was called with the pool_name form"):
            DeepSeekV4PagedHostPool.from_device_pool("c4", [torch.zeros(16, 24, dtype=torch.uint8)], 24, 8, P,
                                                     **ROOM)
        assert fake.held() == set()
        pool = MHATokenToKVPoolHost.from_device_pool(_mha(), 2.0, 0, P, "page_first", **ROOM)
        assert pool.geometry.form.constructor == "from_device_pool"
        pool.destroy()


def test_a_misspelt_keyword_is_a_type_error_naming_the_pool():
    """An unknown keyword is Python's TypeError naming the pool and the word, before any memory -
    the pool the caller built, also where its constructor's code is shared (the MHA pair's); behind
    a dispatch (K-only, DSA) it names the form's constructor too (`_forms.dispatch`)."""
    with fake_cuda() as fake:
        with pytest.raises(TypeError, match=r"^MHATokenToKVPoolHost\.__init__\(\) got an unexpected keyword argument "
                                            "'pagenum'"):
            MHATokenToKVPoolHost(_mha(), 2.0, 0, P, "page_first", pagenum=3, **ROOM)
        with pytest.raises(TypeError, match=r"^AsymmetricMHATokenToKVPoolHost\.__init__\(\) got an unexpected "):
            AsymmetricMHATokenToKVPoolHost(OLDER[AsymmetricMHATokenToKVPoolHost](), 2.0, 0, P, "page_first",
                                           pagenum=3, **ROOM)
        with pytest.raises(TypeError, match=r"^MHATokenToKOnlyPoolHost\.from_device_pool\(\): got an unexpected "
                                            "keyword argument 'pagenum'"):
            MHATokenToKOnlyPoolHost(OLDER[MHATokenToKOnlyPoolHost](), 2.0, 0, P, "page_first", pagenum=3, **ROOM)
        with pytest.raises(TypeError, match=r"^DSAIndexerPoolHost\.from_device_pool\(\): got an unexpected keyword "
                                            "argument "):
            DSAIndexerPoolHost(OLDER[DSAIndexerPoolHost](), 2.0, 0, P, "page_first", pagenum=3, **ROOM)
        assert fake.held() == set()


def test_the_geometry_is_frozen():
    """A pool's geometry cannot be changed after it is made."""
    import attrs

    with fake_cuda():
        pool = _older(MHATokenToKVPoolHost, "page_first")
        try:
            with pytest.raises(attrs.exceptions.FrozenInstanceError):
                pool.geometry.page_num = 1
        finally:
            pool.destroy()


def test_a_dispatched_forms_bad_call_names_the_pool_and_the_form(sglang):
    """K-only's anchor form, DSA's declaration and V4's pool-name forms are bound once against
    their own SGLang signatures (issue #55 item 1): a misspelt keyword, a missing argument or
    one too many is Python's TypeError naming the pool and the form's constructor - before any
    memory, the anchor's excepted."""
    with fake_cuda() as fake:
        info = _sglang_device("mha").get_device_pool_infos()[0].buffer_info
        anchor = MHATokenToKVPoolHost(info, 2.0, 0, 16, "page_first", **KW, **ROOM)
        try:
            held = fake.held()
            k_only = _sglang_device("k_only")
            with pytest.raises(TypeError, match=r"^MHATokenToKOnlyPoolHost\.from_anchor\(\): got an unexpected keyword "
                                                "argument 'pagenum'"):
                MHATokenToKOnlyPoolHost(k_only, anchor, "page_first", pagenum=3, **ROOM)
            with pytest.raises(TypeError, match=r"^MHATokenToKOnlyPoolHost\.from_anchor\(\): .*'layout'"):
                MHATokenToKOnlyPoolHost(k_only, anchor, **ROOM)
            with pytest.raises(TypeError, match=r"^MHATokenToKOnlyPoolHost\.from_anchor\(\): multiple values .*'layout'"):
                MHATokenToKOnlyPoolHost(k_only, anchor, "page_first", layout="page_first", **ROOM)
            assert fake.held() == held
        finally:
            anchor.destroy()
        buffers = [torch.zeros(16, 512, dtype=torch.uint8) for _ in range(3)]
        with pytest.raises(TypeError, match=r"^DeepSeekV4PagedHostPool\.from_pool_name\(\): too many positional"):
            DeepSeekV4PagedHostPool("c4", buffers, 512, 24, 64, "layer_first", "cpu", True, "default", False, 1, **ROOM)
        with pytest.raises(TypeError, match=r"^DeepSeekV4StateHostPool\.from_pool_name\(\): got an unexpected keyword "
                                            "argument 'item_bytes'"):
            DeepSeekV4StateHostPool("state", [], 48, 16, item_bytes=3, **ROOM)
        assert fake.held() == set()


def test_a_dispatching_family_lists_a_builder_for_every_form():
    """A family whose ``builders`` leaves out one of its forms is refused when its class is made,
    naming the form (`_forms.dispatch` would otherwise fail at a caller's first call)."""
    from hicache.pools._forms import ANCHOR, NamedConstructors

    with pytest.raises(TypeError, match=r"Partial\.builders has no builder for its forms \['device pool'\]"):
        class Partial(NamedConstructors):
            pool_family = "mha_k_only"
            builders = {ANCHOR: lambda pool: None}


def _older_geometry(cls, device, layout):
    if cls is MambaPoolHost:
        return cls.geometry_of(device, 2.0, 0, layout=layout, **ROOM)
    return cls.geometry_of(device, 2.0, 0, device.page_size, layout, **ROOM)


@pytest.mark.parametrize("cls, layout", [(cls, layout) for cls in OLDER for layout in cls.descriptor_class().supported()],
                         ids=lambda v: v if isinstance(v, str) else v.__name__)
def test_geometry_of_is_what_the_constructor_adopts_and_from_geometry_brings_it_up(cls, layout):
    """`geometry_of` - the constructor's own call, stopped where the pool would come up (issue #55
    item 1) - is the geometry that call adopts, made with no memory registered; `from_geometry`
    adopts it whole and brings up exactly what it describes, as the constructor does."""
    with fake_cuda() as fake:
        device = OLDER[cls]()
        geometry = _older_geometry(cls, device, layout)
        assert fake.held() == set() and geometry.owner == cls.__name__
        built = _older(cls, layout)
        try:
            assert geometry == built.geometry
            pool = cls.from_geometry(geometry, **ROOM)
            try:
                assert type(pool) is cls and pool.geometry is geometry
                _reports_what_it_brought_up(pool, fake, others=[built])
            finally:
                pool.destroy()
        finally:
            built.destroy()
        assert fake.held() == set()


class _Server(NoServer):
    """A serving process whose io backend no layout here serves."""

    name = "test-server"

    def io_backend(self):
        return "npu-kernel"


def test_from_geometry_refuses_what_it_cannot_bring_up_before_any_memory():
    """`from_geometry` names what it refuses before any memory: not a geometry, another class's
    (an MHA geometry in an MLA pool, or in its asymmetric sibling), a sizing keyword (the geometry
    is sized), ``is_dummy`` with the older form, and a layout the server's io backend cannot copy;
    `geometry_of` fails a bad call as the constructor does."""
    import attrs

    with fake_cuda() as fake:
        geometry = _older_geometry(MHATokenToKVPoolHost, _mha(), "page_first")
        with pytest.raises(TypeError, match=r"from_geometry\(\) takes a hicache.pools.PoolGeometry, got dict"):
            MHATokenToKVPoolHost.from_geometry({}, **ROOM)
        for other in (MLATokenToKVPoolHost, AsymmetricMHATokenToKVPoolHost):
            with pytest.raises(LayoutError, match=rf"^{other.__name__}.from_geometry\(\): the geometry was made for "
                                                  r"MHATokenToKVPoolHost \(device pool form\)"):
                other.from_geometry(geometry, **ROOM)
        with pytest.raises(TypeError, match="unexpected keyword argument 'page_size'"):
            MHATokenToKVPoolHost.from_geometry(geometry, page_size=P, **ROOM)
        with pytest.raises(LayoutError, match="is_dummy .* come with SGLang 0.5.23's constructor"):
            MHATokenToKVPoolHost.from_geometry(geometry, is_dummy=True, **ROOM)
        with pytest.raises(LayoutError, match="io_backend 'npu-kernel'"):
            MHATokenToKVPoolHost.from_geometry(geometry, host=attrs.evolve(ROOM["host"], server=_Server()))
        for call in (MHATokenToKVPoolHost, MHATokenToKVPoolHost.geometry_of):
            with pytest.raises(LayoutError, match="layout 'bogus' is not supported"):
                call(_mha(), 2.0, 0, P, "bogus", **ROOM)
            with pytest.raises(TypeError, match=r"^MHATokenToKVPoolHost\.__init__\(\) got an unexpected keyword"):
                call(_mha(), 2.0, 0, P, "page_first", pagenum=3, **ROOM)
        assert fake.held() == set()
