"""hicache's host pools against SGLang 0.5.23's own, both built by 0.5.23's constructor from the
same device-buffer description (SGLang's real device pools on CPU), in one run (#25).

Each line times the same calls on SGLang's pool and on hicache's, interleaved; ratio = SGLang's
time / hicache's (> 1: hicache is faster), and SGLang's call against itself (A/A: the row's noise
floor). Both unpinned: the registration is not what is timed.
- alloc + free at 10/50/90/99 % full (a 1M-slot pool, 64-token pages, 1-32-page requests):
  SGLang's `alloc`/`free` (its free-slot tensor and release list) vs hicache's.
- For MHA, MLA and K-only in page_first_direct, page_first and layer_first (`_cases`):
  `get_page_buffer_meta` for 256 pages (MHA and MLA, where SGLang's pool has it),
  `get_data_page(flat=True)` + `set_from_flat_data_page` for 256 pages, and SGLang's `HiCacheFile`
  `batch_set_v2` / `batch_get_v2` of 256 pages to tmpfs (/dev/shm; both pools' gets read the
  same files, see `_file`).
- Mamba's state slots: `get_data_page` + `set_from_flat_data_page` (`_mamba`).
Rounds: HICACHE_BENCH_ROUNDS (default 31: a page row is milliseconds, and its median over a few rounds moves by +-8 % on a shared box). Needs `make sglang`; says so and exits 0 without.
"""

from __future__ import annotations

import os
import shutil
import statistics
import sys
import tempfile
import warnings
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))

from _timing import interleaved, median_line  # noqa: E402
from bench_allocator import _pairs_per_second, _script  # noqa: E402

from hicache.effects import HostSetup, package_version  # noqa: E402
from hicache.testing import fake_cuda, sglang_on_cpu  # noqa: E402

ROOM = dict(host=HostSetup(host_memory_bytes=10**13))
PAGES_IO = 256


def _sglang():
    sglang_on_cpu()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        import sglang.srt.mem_cache.hicache_storage as storage
        import sglang.srt.mem_cache.memory_pool as memory_pool
        import sglang.srt.mem_cache.pool_host.base as base
        import sglang.srt.mem_cache.pool_host.mha as mha
        import sglang.srt.mem_cache.pool_host.mla as mla
    return storage, memory_pool, base, mha, mla


def _pair(theirs_cls, ours_cls, info, layout, page, base, **kw):
    with base.host_memory_budget_scope(10**13):
        theirs = theirs_cls(info, 2.0, 0, page, layout, pin_memory=False, **kw)
    ours = ours_cls(info, 2.0, 0, page, layout, pin_memory=False, **kw, **ROOM)
    return theirs, ours


def _alloc_free(pools, rounds: int) -> None:
    """Steady state at each occupancy: pairs of (alloc 1-32 pages, free a random held one)."""
    theirs, ours = pools
    for occupancy in (0.10, 0.50, 0.90, 0.99):
        fill, pairs = _script(occupancy, seed=int(occupancy * 100))  # bench_allocator's script and loop

        def cleared(pool):
            pool.clear()
            return pool

        times = {"ours": [], "theirs": []}
        for _ in range(rounds):  # interleaved; the fill is not timed
            for name, pool in (("ours", ours), ("theirs", theirs)):
                times[name].append(len(pairs) / _pairs_per_second(lambda pool=pool: cleared(pool), fill, pairs))
        print(median_line(f"alloc + free, {int(occupancy * 100)} % full, {len(pairs)} pairs (1M slots, 64-token pages)",
                          times["ours"], "SGLang 0.5.23's pool", times["theirs"]), flush=True)


def _calls(name, pools, make_call, rounds: int) -> None:
    """One line: hicache's pool against SGLang's, and SGLang's call timed a second time in the
    same rounds (A/A: the ratio of identical work, this box's noise floor for the row - a row
    at 0.98x beside an A/A of 1.04x is parity, not a loss)."""
    theirs, ours = pools
    times = interleaved({"ours": make_call(ours), "theirs": make_call(theirs), "theirs again": make_call(theirs)},
                        rounds=rounds, warmup=1)
    ms = {key: [t * 1e3 for t in values] for key, values in times.items()}
    same = statistics.median(ms["theirs"]) / statistics.median(ms["theirs again"])
    print(median_line(name, ms["ours"], "SGLang 0.5.23's pool", ms["theirs"], unit="ms")
          + f" | A/A (SGLang's call against itself) {same:.2f}x", flush=True)


def main() -> int:
    if package_version("sglang") is None:
        print("bench_sglang_pools: SGLang is not installed (make sglang); skipped")
        return 0
    import torch

    from hicache import pools as ours_pools

    storage, memory_pool, base, mha, mla = _sglang()
    rounds = int(os.environ.get("HICACHE_BENCH_ROUNDS", "31"))
    with fake_cuda():
        # alloc + free: a 1M-slot pool with a tiny token (what is timed is the bookkeeping)
        small = memory_pool.MHATokenToKVPool(size=4096, page_size=64, dtype=torch.bfloat16, head_num=1, head_dim=8,
                                             layer_num=1, device="cpu", enable_memory_saver=False)
        info = small.get_device_pool_infos()[0].buffer_info
        pools = _pair(mha.MHATokenToKVPoolHost, ours_pools.MHATokenToKVPoolHost, info, "page_first_direct", 64, base,
                      device_capacity_tokens=4096, start_layer=0, end_layer=0, host_token_capacity=1 << 20)
        _alloc_free(pools, rounds)
        for pool in pools:
            pool.destroy()

        # pages: 8 layers x 8 heads x 128 dims bf16 (MHA), 8 layers x 576 bf16 (MLA), 16-token pages
        page = 16
        devices = _devices(memory_pool, torch, page)
        indices = torch.cat([torch.arange(p * page, (p + 1) * page) for p in range(3, 3 + 2 * PAGES_IO, 2)])
        tmp = Path(tempfile.mkdtemp(prefix="hicache-bench-", dir="/dev/shm" if os.path.isdir("/dev/shm") else None))
        try:
            for (family, layout), make in _cases(mha, mla, ours_pools, devices, page, base).items():
                pair, owned = make()
                try:
                    _pages(storage, pair, indices, page, tmp / f"{family}_{layout}", family, layout, rounds, torch)
                finally:
                    for pool in owned:
                        pool.destroy()
            _mamba(ours_pools, base, rounds, torch)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    return 0


def _devices(memory_pool, torch, page: int) -> dict:
    """SGLang's real device pools on CPU that the host pools are described from."""
    common = dict(size=4096, page_size=page, dtype=torch.bfloat16, layer_num=8, device="cpu",
                  enable_memory_saver=False)
    return {
        "mha": memory_pool.MHATokenToKVPool(head_num=8, head_dim=128, **common),
        "mla": memory_pool.MLATokenToKVPool(kv_lora_rank=512, qk_rope_head_dim=64, **common),
        "k_only": memory_pool.MHATokenToKOnlyPool(head_num=1, head_dim=128, **common),
    }


def _cases(mha, mla, ours_pools, devices, page: int, base) -> dict:
    """(family, layout) -> a function making ((SGLang's pool, hicache's), every pool to destroy
    after): every layout SGLang's flat pages serve, for each family with them (issue #35 item 3)."""
    kw = dict(device_capacity_tokens=4096, start_layer=0, end_layer=7, host_token_capacity=1024 * page)
    info = {name: devices[name].get_device_pool_infos()[0].buffer_info for name in ("mha", "mla")}

    def plain(theirs_cls, ours_cls, family, layout, **extra):
        pair = _pair(theirs_cls, ours_cls, info[family], layout, page, base, **kw, **extra)
        return pair, pair

    def k_only(layout):  # sized by its MHA anchor (MiniMax's index-K)
        anchors = _pair(mha.MHATokenToKVPoolHost, ours_pools.MHATokenToKVPoolHost, info["mha"], layout, page, base,
                        **kw)
        with base.host_memory_budget_scope(10**13):
            theirs = mha.MHATokenToKOnlyPoolHost(devices["k_only"], anchors[0], layout, pin_memory=False)
        ours = ours_pools.MHATokenToKOnlyPoolHost(devices["k_only"], anchors[1], layout, **ROOM)
        return (theirs, ours), (theirs, ours, *anchors)

    cases = {}
    for layout in ("page_first_direct", "page_first", "layer_first"):
        cases["MHA", layout] = lambda layout=layout: plain(
            mha.MHATokenToKVPoolHost, ours_pools.MHATokenToKVPoolHost, "mha", layout)
        cases["MLA", layout] = lambda layout=layout: plain(
            mla.MLATokenToKVPoolHost, ours_pools.MLATokenToKVPoolHost, "mla", layout, target_layer_num=8)
        cases["K-only", layout] = lambda layout=layout: k_only(layout)
    return cases


def _pages(storage, pair, indices, page: int, where: Path, family: str, layout: str, rounds: int, torch) -> None:
    """Zero-copy meta (where SGLang's pool has it), flat pages and HiCacheFile for one case."""
    label = f"{family} {layout}"
    for pool in pair:
        for buffer in _buffers(pool):
            buffer.view(torch.int16).random_(-30000, 30000)
    if family in ("MHA", "MLA") and layout != "page_first":  # SGLang's meta layouts
        _calls(f"get_page_buffer_meta, {PAGES_IO} pages, {label}", pair,
               lambda pool: lambda: pool.get_page_buffer_meta(indices), rounds)
    starts = [int(indices[i * page]) for i in range(PAGES_IO)]
    targets = [s + page for s in starts]

    def pages(pool):
        def run():
            for source, target in zip(starts, targets):
                pool.set_from_flat_data_page(target, pool.get_data_page(source, flat=True))
        return run

    _calls(f"get_data_page + set_from_flat_data_page, {PAGES_IO} pages, {label}", pair, pages, rounds)
    _file(storage, pair, indices, where, label, rounds, is_mla=family == "MLA")


def _buffers(pool) -> list:
    for name in ("kv_buffer", "k_buffer"):
        buffer = getattr(pool, name, None)
        if buffer is not None:
            return list(buffer) if isinstance(buffer, (list, tuple)) else [buffer]
    return list(pool.get_hybrid_pool_buffer())


def _mamba(ours_pools, base, rounds: int, torch) -> None:
    """Mamba state slots (a page is one slot's raw bytes): get_data_page + set_from_flat_data_page."""
    from sglang.srt.mem_cache.device_pool_info import MambaStateBufferInfo
    from sglang.srt.mem_cache.pool_host.mamba import MambaPoolHost

    generator = torch.Generator().manual_seed(2)
    info = MambaStateBufferInfo(temporal=torch.randn(8, 9, 32, 128, 64, generator=generator),
                                conv=(torch.randn(8, 9, 3, 4096, generator=generator).to(torch.bfloat16),))
    kw = dict(device_capacity=8, layout="page_first_direct")
    with base.host_memory_budget_scope(10**13):
        theirs = MambaPoolHost(info, 2.0, 0, pin_memory=False, **kw)
    ours = ours_pools.MambaPoolHost(info, 2.0, 0, **kw, **ROOM)
    try:
        slots = list(range(1, theirs.size // 2))

        def pages(pool):
            def run():
                for slot in slots:
                    pool.set_from_flat_data_page(slot + len(slots), pool.get_data_page(slot))
            return run

        _calls(f"get_data_page + set_from_flat_data_page, {len(slots)} slots, Mamba page_first_direct",
               (theirs, ours), pages, rounds)
    finally:
        for pool in (theirs, ours):
            pool.destroy()


def _file(storage, pools, indices, where: Path, label: str, rounds: int, *, is_mla: bool) -> None:
    """SGLang's HiCacheFile: batch_set_v2 then batch_get_v2 of 256 pages, tmpfs."""
    config = storage.HiCacheStorageConfig(tp_rank=0, tp_size=1, pp_rank=0, pp_size=1, attn_cp_rank=0, attn_cp_size=1,
                                          is_mla_model=is_mla, enable_storage_metrics=False,
                                          is_page_first_layout=True, model_name="bench")
    keys = [f"page-{i}" for i in range(PAGES_IO)]
    transfer = [storage.PoolTransfer(name=storage.PoolName.KV, host_indices=indices, keys=keys)]

    def backend(pool, tag):
        made = storage.HiCacheFile(config, file_path=str(where / tag))
        made.register_mem_host_pool_v2(pool, storage.PoolName.KV)
        return made

    backends = {id(pool): backend(pool, tag) for pool, tag in zip(pools, ("theirs", "ours"))}
    _calls(f"HiCacheFile batch_set_v2, {PAGES_IO} pages to tmpfs, {label}", pools,
           lambda pool: lambda: backends[id(pool)].batch_set_v2(transfer), rounds)
    # Both pools read the one set of files SGLang's pool wrote (the same page bytes layout): two
    # sets of tmpfs files read at different speeds depending on where the kernel placed them -
    # after the 1M-slot pools were freed, SGLang's pool read hicache's files 1.3x slower than its
    # own, and hicache's pool SGLang's at SGLang's speed - which is not the pools' code.
    readers = {id(pool): backend(pool, "theirs") for pool in pools}
    _calls(f"HiCacheFile batch_get_v2, {PAGES_IO} pages from tmpfs (one set of files), {label}", pools,
           lambda pool: lambda: readers[id(pool)].batch_get_v2(transfer), rounds)


if __name__ == "__main__":
    raise SystemExit(main())
