"""SGLang 0.5.23's L3 back ends over hicache's 0.5.23 pools, judged against SGLang's own pools:
its real `HiCacheFile` writes pages from one kind of pool and reads them into the other
(different host slots), both directions, byte for byte - so an L3 store is shared between
servers running SGLang's pools and servers running hicache's - with the same results SGLang's
pool gets. Needs `make sglang`."""

from __future__ import annotations

import pytest
from sglang_support import sglang  # noqa: F401 - a fixture
from test_sglang_conformance import PAGE, _build, _buffers, _classes, _device

from hicache.testing import fake_cuda

torch = pytest.importorskip("torch")

CASES = [("mha", "layer_first"), ("mha", "page_first_direct"), ("mha", "page_head"), ("mla", "page_first"),
         ("mla", "page_first_direct"), ("mla", "layer_first")]


def _file_backend(tmp_path, kind: str):
    from sglang.srt.mem_cache.hicache_storage import HiCacheFile, HiCacheStorageConfig

    config = HiCacheStorageConfig(tp_rank=0, tp_size=1, pp_rank=0, pp_size=1, attn_cp_rank=0, attn_cp_size=1,
                                  is_mla_model=kind == "mla", enable_storage_metrics=False, is_page_first_layout=False,
                                  model_name="conformance")
    return HiCacheFile(config, file_path=str(tmp_path))


def _transfer(indices, keys):
    from sglang.srt.mem_cache.hicache_storage import PoolName, PoolTransfer

    return [PoolTransfer(name=PoolName.KV, host_indices=indices, keys=keys)]


def _page_bytes(pool, start: int):
    return pool.get_data_page(start, flat=True).contiguous().view(torch.uint8)


@pytest.mark.parametrize("kind, layout", CASES, ids=[f"{k}-{l}" for k, l in CASES])
def test_hicache_file_shares_pages_between_sglangs_pool_and_hicaches(sglang, tmp_path, kind, layout):
    """SGLang's HiCacheFile carries pages byte-exactly between SGLang's pool and hicache's, and a
    missing page is a miss."""
    from sglang.srt.mem_cache.hicache_storage import PoolName

    info = _device(kind).get_device_pool_infos()[0].buffer_info
    theirs_cls, ours_cls = _classes(kind)
    with fake_cuda() as fake:
        theirs = _build(theirs_cls, kind, info, layout, hicache=False)
        ours = _build(ours_cls, kind, info, layout, hicache=True)
        try:
            generator = torch.Generator().manual_seed(9)
            for pool in (theirs, ours):
                for buffer in _buffers(pool):
                    buffer.view(torch.int16).copy_(torch.randint(-30000, 30000, buffer.shape, generator=generator,
                                                                 dtype=torch.int16))
            pages = 4
            out_slots = torch.arange(2 * PAGE, (2 + pages) * PAGE)
            in_slots = torch.arange(9 * PAGE, (9 + pages) * PAGE)
            for source, target, tag in ((theirs, ours, "s2h"), (ours, theirs, "h2s")):
                backend = _file_backend(tmp_path / tag, kind)
                keys = [f"{tag}-{i}" for i in range(pages)]
                backend.register_mem_host_pool_v2(source, PoolName.KV)
                wrote = backend.batch_set_v2(_transfer(out_slots, keys))
                backend.register_mem_host_pool_v2(target, PoolName.KV)
                read = backend.batch_get_v2(_transfer(in_slots, keys))
                assert wrote == read == {PoolName.KV: [True] * pages}
                for i in range(pages):
                    assert torch.equal(_page_bytes(target, int(in_slots[i * PAGE])),
                                       _page_bytes(source, int(out_slots[i * PAGE]))), (tag, i)
                missing = backend.batch_get_v2(_transfer(in_slots[:PAGE], ["absent"]))
                assert missing == {PoolName.KV: [False]}
        finally:
            ours.destroy()
            theirs.destroy()
        assert fake.held() == set()
