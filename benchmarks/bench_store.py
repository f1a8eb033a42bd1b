"""The node store against the free alternative: SGLang 0.5.23's own `HiCacheFile` on /dev/shm
(node-shared and restart-surviving too) - the same pages, interleaved rounds, medians with the
per-round min-max (issue #32).

- 128-page batches of a DeepSeek-V3-like MLA page (61 layers x 576 x bf16 x 64 tokens, 4.5 MB)
  and of an MHA page (Llama-3.1-70B at TP 8: 80 layers x 1 KV head x 128 x bf16 x 64 tokens,
  2.6 MB), in hicache's 0.5.23 host pools (the plug-in's, on CPU under the fake driver):
  HiCacheNodeStore's zero-copy `batch_set_v1` / `batch_get_v1` vs HiCacheFile's `batch_set_v2` /
  `batch_get_v2` (a syscall and a staging copy per page). Target: >= 3x.
- `batch_exists` of 128 keys (target <= 200 us), vs HiCacheFile's.
- the census of a 258,000-slot arena vs the census as it was; `get_stats` on a stale step; and
  `clear()` of 32,768 pages vs the clear as it was and vs HiCacheFile.clear of as many files.
- attach of an arena of HICACHE_BENCH_STORE_ARENA_GIB (default 4; the README's figure: 16, whose
  creation alone took 25-40 s of `make bench`'s 10 minutes here) vs creating it.
- the restart figure: seconds from a fresh `HybridCacheController` (a new process, SGLang's
  real code) to its first L3 hit, over an arena vs over HiCacheFile's directory.

HICACHE_BENCH_ROUNDS (default 5) interleaved rounds. Needs `make sglang`; says so and exits 0
without. Uses /dev/shm: about 2.5 GB for the batches, then the arena alone.
"""

from __future__ import annotations

import os
import shutil
import statistics
import sys
import tempfile
import time
import warnings
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
sys.path.insert(0, str(Path(__file__).parent.parent / "tests"))

from _timing import interleaved, median_line  # noqa: E402

from hicache.effects import package_version  # noqa: E402

GiB = 2**30
PAGES = 128
ROUNDS = int(os.environ.get("HICACHE_BENCH_ROUNDS", "5"))


#: tokens per page of each case: the small one is a 16-token page of a small model (64 KiB)
PAGE_TOKENS = {"mla": 64, "mha": 64, "small": 16}
KINDS = [k for k in os.environ.get("HICACHE_BENCH_STORE_KINDS", "small,mla,mha").split(",") if k]


def _pool(kind: str):
    import torch
    from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool, MLATokenToKVPool

    import hicache.pools as pools
    from hicache.effects import HostSetup

    page = PAGE_TOKENS[kind]
    tokens = 2 * PAGES * page
    common = dict(size=tokens, page_size=page, dtype=torch.bfloat16, device="cpu", enable_memory_saver=False)
    if kind == "small":  # 8 layers x 1 KV head x 128 x bf16 x 16 tokens x K and V: 64 KiB
        device = MHATokenToKVPool(head_num=1, head_dim=128, layer_num=8, **common)
        cls, layers = pools.MHATokenToKVPoolHost, 8
    elif kind == "mla":
        device = MLATokenToKVPool(kv_lora_rank=512, qk_rope_head_dim=64, layer_num=61, **common)
        cls, layers = pools.MLATokenToKVPoolHost, 61
    else:
        device = MHATokenToKVPool(head_num=1, head_dim=128, layer_num=80, **common)
        cls, layers = pools.MHATokenToKVPoolHost, 80
    info = device.get_device_pool_infos()[0].buffer_info
    extra = dict(target_layer_num=layers) if kind == "mla" else {}
    host = cls(info, 1.0, 0, page, "page_first_direct", device_capacity_tokens=tokens, start_layer=0,
               end_layer=layers - 1, host=HostSetup(host_memory_bytes=10**12), **extra)
    del device
    for buffer in (host.kv_buffer if isinstance(host.kv_buffer, list) else [host.kv_buffer]):
        buffer.view(torch.int16).random_(-30000, 30000)
    return host


def _config(kind: str, extra: dict):
    from sglang.srt.mem_cache.hicache_storage import HiCacheStorageConfig

    return HiCacheStorageConfig(tp_rank=0, tp_size=1, pp_rank=0, pp_size=1, attn_cp_rank=0, attn_cp_size=1,
                                is_mla_model=kind == "mla", enable_storage_metrics=False, is_page_first_layout=True,
                                model_name="bench", extra_config=extra)


def _batches(kind: str, shm: str) -> list[str]:
    import torch
    from sglang.srt.mem_cache.hicache_storage import HiCacheFile, PoolName, PoolTransfer

    from hicache.compat.sglang_store import HiCacheNodeStore

    host = _pool(kind)
    page_bytes = host.get_data_page(0, flat=True).nbytes
    arena = f"{shm}/arena-{kind}"
    ours = HiCacheNodeStore(_config(kind, {"interface_v1": 1, "arena": arena,
                                           "size_gb": (PAGES + 64) * page_bytes * 1.1 / 1e9}), {})
    ours.register_mem_pool_host(host)
    ours.on_host_pools_registered()
    file_dir = f"{shm}/file-{kind}"
    theirs = HiCacheFile(_config(kind, {}), file_path=file_dir)
    theirs.register_mem_pool_host(host)
    theirs.register_mem_host_pool_v2(host, PoolName.KV)
    page = PAGE_TOKENS[kind]
    source, target = torch.arange(0, PAGES * page), torch.arange(PAGES * page, 2 * PAGES * page)
    keys = [f"{kind}-{i:04d}" for i in range(PAGES)]
    put = [PoolTransfer(name=PoolName.KV, host_indices=source, keys=keys)]
    get = [PoolTransfer(name=PoolName.KV, host_indices=target, keys=keys)]

    def set_ours():
        assert all(ours.batch_set_v1(keys, source))
        return lambda: ours.clear()

    def set_theirs():
        assert all(theirs.batch_set_v2(put)[PoolName.KV])
        return lambda: theirs.clear()

    label = f"{kind} page {page_bytes / 1e6:.3g} MB, {PAGES}-page batch"
    writes = interleaved({"ours": set_ours, "theirs": set_theirs}, rounds=ROUNDS)
    lines = [median_line(f"store batch_set_v1 ({label})", writes["ours"], "HiCacheFile batch_set_v2 on /dev/shm",
                         writes["theirs"])]
    ours.batch_set_v1(keys, source)
    theirs.batch_set_v2(put)
    reads = interleaved({"ours": lambda: ours.batch_get_v1(keys, target),
                         "theirs": lambda: theirs.batch_get_v2(get)}, rounds=ROUNDS)
    assert all(ours.batch_get_v1(keys, target))
    lines.append(median_line(f"store batch_get_v1 ({label})", reads["ours"], "HiCacheFile batch_get_v2 on /dev/shm",
                             reads["theirs"]))
    lookups = interleaved({"ours": lambda: ours.batch_exists(keys), "theirs": lambda: theirs.batch_exists(keys)},
                          rounds=max(ROUNDS, 25))
    assert ours.batch_exists(keys) == theirs.batch_exists(keys) == PAGES
    ours_us = [t * 1e6 for t in lookups["ours"]]
    theirs_us = [t * 1e6 for t in lookups["theirs"]]
    lines.append(median_line(f"store batch_exists of {PAGES} keys ({kind})", ours_us, "HiCacheFile batch_exists",
                             theirs_us, unit="us") + f" | target <= 200 us: {statistics.median(ours_us):.0f} us")
    # the row above asks for keys the store has seen (SGLang's exists-then-read): each hashed once;
    # here each call hashes them all again, as for a prefix the engine never asked about
    def first_sight():
        ours.store._slot_keys.forget()
        return ours.batch_exists(keys)

    lookups = interleaved({"ours": first_sight, "theirs": lambda: theirs.batch_exists(keys)}, rounds=max(ROUNDS, 25))
    lines.append(median_line(f"store batch_exists of {PAGES} keys never asked before ({kind})",
                             [t * 1e6 for t in lookups["ours"]], "HiCacheFile batch_exists",
                             [t * 1e6 for t in lookups["theirs"]], unit="us"))
    ours.close()
    host.destroy()
    shutil.rmtree(file_dir, ignore_errors=True)
    os.unlink(arena)
    return lines


def _checksum_copy(page_bytes: int) -> str:
    """The store's copy that checksums as it goes (the C helper, a 128-page write into slots)
    against plain memmove of the same pages: what the checksum costs the copy (issue #51)."""
    import ctypes

    import torch

    from hicache.effects._arena import _slots

    if _slots._native is None:
        return "store copy+checksum: the C helper is not built (no compiler): skipped"
    src = torch.randint(-2**62, 2**62, (PAGES, page_bytes // 8), dtype=torch.int64)
    dst = torch.zeros_like(src)
    slots, ptrs = [dst[i].data_ptr() for i in range(PAGES)], [src[i].data_ptr() for i in range(PAGES)]

    def summed():
        _slots.NativeSlotOps.copy_pages(0, slots, ptrs, [page_bytes] * PAGES, 1, [1, 2] * PAGES)

    def plain():
        for i in range(PAGES):
            ctypes.memmove(slots[i], ptrs[i], page_bytes)

    times = interleaved({"ours": summed, "theirs": plain}, rounds=max(ROUNDS, 15))
    gbs = PAGES * page_bytes / statistics.median(times["ours"]) / 1e9
    return median_line(f"store copy+checksum ({PAGES} pages of {page_bytes / 1e6:.3g} MB, {gbs:.1f} GB/s)",
                       times["ours"], "ctypes.memmove of the same pages", times["theirs"])


def _census_as_before(index):
    """The census before 2026-12-07's last change: the whole index copied at once, its live rows
    copied twice more, and every live key through `_first_of_each`'s two stable sorts: the baseline."""
    import torch

    from hicache.store._index import Census, _first_of_each

    columns = index._columns().clone()
    gen, k0, k1 = columns[:, 0], columns[:, 1], columns[:, 2]
    live = (gen != 0) & ((gen & 1) == 0) & ((k0 != 0) | (k1 != 0))
    torn = int(((gen & 1) == 1).sum())
    keys = torch.stack([k0[live], k1[live]], dim=1)
    lengths = columns[live][:, 5] & 0xFFFFFFFF
    namespaces = columns[live][:, 6] & 0xFFFF
    if keys.numel():
        _, first = _first_of_each(keys)
        lengths, namespaces = lengths[first], namespaces[first]
    by_namespace = {int(e): int(c) for e, c in zip(*torch.unique(namespaces, return_counts=True))}
    return Census(index.plan.slots, int(lengths.numel()), int(lengths.sum()), torn, by_namespace)


def _census(shm: str):
    """A census of a many-slot arena (`hicache store status`, the metrics' scrape, `get_stats`
    every 10 s) against the census as it was before (`_census_as_before`), which must agree."""
    import torch

    from hicache.store import Namespace, open_store

    store = open_store(f"{shm}/arena-census", size_bytes=GiB, slot_bytes=4096, budget=False)
    try:
        ns = Namespace(model="bench", dtype="uint8", page_tokens=1, layout="flat", pool="kv", page_bytes=4096)
        page = torch.zeros(4096, dtype=torch.uint8)
        live = store.arena.plan.slots * 2 // 5
        for first in range(0, live, 512):
            keys = [f"k{n}" for n in range(first, min(first + 512, live))]
            store.put(ns, keys, [[(page.data_ptr(), 4096)]] * len(keys))
        census = store.census()
        assert census == _census_as_before(store.index), "the census and its baseline disagree"
        times = interleaved({"ours": store.census, "theirs": lambda: _census_as_before(store.index)},
                            rounds=max(ROUNDS, 7))
        yield median_line(f"store census of {store.arena.plan.slots:,} slots ({census.pages:,} pages)", times["ours"],
                          "the census as before (the index copied whole, every key sorted twice)", times["theirs"])
        yield _stale_step(store)
        yield from _clear(store, shm)
    finally:
        store.close()


#: pages a clear empties in the clear rows (beside the census arena's other pages)
CLEAR_PAGES = 32768


def _clear_as_before(store, namespace) -> int:
    """NodeStore.clear before 2026-12-07's change, the baseline: each live slot of the namespace
    reclaimed from Python in turn (its OFD lock, generation, record and publish: 4.5 us a slot)."""
    from hicache.effects import arena as effects_arena
    from hicache.plan import published_generation, reclaimed_generation
    from hicache.plan.store_format import RECORD_BYTES
    from hicache.store._namespaces import NO_NAMESPACE, ZERO_KEY

    index = store.index
    entry = index.entry_of(store._digest(namespace))
    columns = index._columns()
    mine = (columns[:, 6] & 0xFFFF) == entry
    live = (mine & (columns[:, 0] != 0) & ((columns[:, 1] != 0) | (columns[:, 2] != 0))).nonzero().flatten().tolist()
    cleared = 0
    for slot in live:
        record = store.arena.record_addr(slot)
        seen = index.ops.load(record)
        if not index._writing.acquire(blocking=False):
            continue
        try:
            offset = index.plan.record_offset(slot)
            if not effects_arena.try_lock(index.arena.fd, offset, RECORD_BYTES):
                continue
            try:
                if index.ops.load(record) != seen:
                    continue
                odd = reclaimed_generation(seen)
                index.ops.store(record, odd)
                index.records.write_fields(slot, (odd, ZERO_KEY, 0, 0, 0, 0, NO_NAMESPACE, 0, 0, 0))
                index.ops.store(record, published_generation(odd))
                cleared += 1
            finally:
                effects_arena.unlock(index.arena.fd, offset, RECORD_BYTES)
        finally:
            index._writing.release()
    index.free_entries({entry})
    return cleared


def _clear(store, shm: str):
    """`clear()` of CLEAR_PAGES pages of one namespace in an arena holding others' pages too
    (SGLang's /clear_hicache_storage_backend, on its scheduler thread), against the clear as it was
    (`_clear_as_before`) and against SGLang's HiCacheFile.clear over as many page files on
    /dev/shm (one os.remove each). Each round stores the pages again first, untimed."""
    import torch

    from sglang.srt.mem_cache.hicache_storage import HiCacheFile

    from _timing import round_order
    from hicache.store import Namespace

    ns = Namespace(model="bench-clear", dtype="uint8", page_tokens=1, layout="flat", pool="kv", page_bytes=4096)
    page = torch.zeros(4096, dtype=torch.uint8)
    raw = page.numpy().tobytes()
    file_dir = f"{shm}/file-clear"
    theirs = HiCacheFile(_config("small", {}), file_path=file_dir)

    keys = [f"c{n}" for n in range(CLEAR_PAGES)]

    def fill_arena():
        """The pages stored, and how many the arena holds (a full window evicts a few of them)."""
        for first in range(0, CLEAR_PAGES, 512):
            assert all(store.put(ns, keys[first:first + 512], [[(page.data_ptr(), 4096)]] * 512))
        return sum(store.present(ns, keys))

    def fill_files():
        for key in keys:
            with open(f"{file_dir}/{key}.bin", "wb") as out:
                out.write(raw)
        return True

    runs = {"ours": (fill_arena, lambda: store.clear([ns])), "before": (fill_arena, lambda: _clear_as_before(store, ns)),
            "HiCacheFile": (fill_files, theirs.clear)}
    times: dict = {name: [] for name in runs}
    for round_number in range(-1, max(ROUNDS, 5)):  # round -1: a warm-up, not counted
        for name, (fill, clear) in round_order(list(runs.items()), max(round_number, 0)):
            held = fill()
            began = time.perf_counter()
            cleared = clear()
            took = time.perf_counter() - began
            assert cleared == held and not any(store.present(ns, keys)), (name, cleared, held)
            if round_number >= 0:
                times[name].append(took * 1e3)
    label = f"store clear() of {CLEAR_PAGES:,} pages ({store.arena.plan.slots:,} slots)"
    yield median_line(label, times["ours"], "the clear as before (a slot at a time from Python)", times["before"],
                      unit="ms")
    yield median_line(label, times["ours"], "SGLang's HiCacheFile.clear of as many files on /dev/shm",
                      times["HiCacheFile"], unit="ms")


def _stale_step(store) -> str:
    """What SGLang's scheduler step pays in `get_stats` when the census is 10 s old: the last
    census at once, the next one taken beside it (`LatestCensus`, its teardown waits for that
    untimed), against taking the census on the step, as before 2026-12-07."""
    from hicache.compat._census_refresh import LatestCensus

    now = [0.0]
    latest = LatestCensus(store.census, max_age_s=10.0, clock=lambda: now[0])
    latest.get()

    def stale_step():
        now[0] += 10.0
        latest.get()
        return latest.wait

    times = interleaved({"ours": stale_step, "theirs": store.census}, rounds=max(ROUNDS, 7))
    ms = {name: [t * 1e3 for t in each] for name, each in times.items()}
    return median_line(f"get_stats on the step whose census is stale ({store.arena.plan.slots:,} slots)",
                       ms["ours"], "the census taken on the step, as before", ms["theirs"], unit="ms")


def _attach(shm: str) -> str:
    from hicache.effects import arena as effects_arena
    from hicache.plan import plan_store

    size = int(os.environ.get("HICACHE_BENCH_STORE_ARENA_GIB", "4")) * GiB
    path = f"{shm}/arena-attach"
    free = shutil.disk_usage(shm).free
    if free < size + GiB:
        return f"store attach: skipped, /dev/shm has {free / GiB:.1f} GiB free for a {size / GiB:.0f} GiB arena"
    plan = plan_store(size, slot_bytes=4_718_592)
    began = time.perf_counter()
    effects_arena.create_arena(path, plan, label="bench").close()
    created = time.perf_counter() - began
    attaches = []
    for _ in range(max(ROUNDS, 5)):
        began = time.perf_counter()
        effects_arena.attach_arena(path).close()
        attaches.append(time.perf_counter() - began)
    os.unlink(path)
    attach = statistics.median(attaches)
    return (f"store attach of a {size / GiB:.0f} GiB arena: median {attach * 1e3:.2f} ms (min-max "
            f"{min(attaches) * 1e3:.2f}-{max(attaches) * 1e3:.2f} ms, {len(attaches)} attaches) | baseline creating it "
            f"(fallocate + pre-fault): {created:.2f} s | {created / attach:.0f}x faster")


def _restart(shm: str) -> str:
    """Seconds from a fresh controller to its first L3 hit, over an arena and over HiCacheFile."""
    from store_support import Zygote

    figures: dict = {"dynamic": [], "file": []}
    paths = {backend: f"{shm}/restart-{backend}" for backend in figures}
    with Zygote(sglang=True) as zygote:
        common = dict(size_gb=0.2, kind="mha", layout="page_first_direct", pools="hicache", seed=3, pages=64)
        for backend, path in paths.items():  # each back end's pages written by an engine that then dies
            zygote.start(f"{backend}-old", "controller", mode="write", path=path, backend=backend, **common)
            zygote.wait_for(f"{backend}-old", "stored")
            zygote.kill(f"{backend}-old")
        for r in range(max(ROUNDS, 3)):  # interleaved, the order swapped every other round
            for backend in (("dynamic", "file") if r % 2 == 0 else ("file", "dynamic")):
                zygote.start(f"{backend}-{r}", "controller", mode="prefetch", path=paths[backend], backend=backend,
                             **common)
                report = zygote.result(f"{backend}-{r}")
                assert report["byte_exact"], report
                figures[backend].append(report["first_hit_s"])
    for path in paths.values():
        if os.path.isdir(path):
            shutil.rmtree(path)
        elif os.path.exists(path):
            os.unlink(path)
    return median_line("restart: a fresh HybridCacheController to its first L3 hit (64 pages, arena)",
                       figures["dynamic"], "HiCacheFile on /dev/shm", figures["file"])


def main() -> int:
    if package_version("sglang") is None:
        print("bench_store: SGLang is not installed (make sglang); skipped")
        return 0
    from hicache.testing import fake_cuda, sglang_on_cpu

    sglang_on_cpu()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        import sglang.srt.mem_cache.hicache_storage  # noqa: F401
        import sglang.srt.mem_cache.memory_pool  # noqa: F401
    shm = tempfile.mkdtemp(prefix="hicache-bench-", dir="/dev/shm")
    try:
        with fake_cuda():
            for page_bytes in (64 << 10, 4718592):
                print(_checksum_copy(page_bytes), flush=True)
            for kind in KINDS:
                for line in _batches(kind, shm):
                    print(line, flush=True)
        for line in _census(shm):
            print(line, flush=True)
        print(_attach(shm), flush=True)
        print(_restart(shm), flush=True)
    finally:
        shutil.rmtree(shm, ignore_errors=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
