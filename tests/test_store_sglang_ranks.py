"""HiCacheNodeStore between SGLang 0.5.23 processes (its real pools, assembler and storage
factory, forked from one zygote that imported SGLang once - tests/store_child.py): an engine's
128 pages written zero-copy are found and read byte-exact by another engine with its own pool,
MHA in every layout and MLA, across SGLang's pools with and without the plug-in and hicache's;
MLA at TP=4 under SGLang's backup rule keeps one copy that all four ranks load; MHA at TP=2 keeps
the ranks' pages apart; another model misses. Needs `make sglang`."""

from __future__ import annotations

import pytest
from sglang_support import need_sglang
from store_support import Zygote, shm_dir  # noqa: F401 - shm_dir: a fixture

# Not in `make test-loaded`: its engines take strict turns (a result, or a file barrier after
# every rank said "stored", before the next step), so load changes how long they take, never
# what they see - and the store's concurrent laws (readers beside writers, kill -9 mid-write,
# racing creators, threads of one process) are proved loaded by test_store_processes,
# test_store_index and test_store_arena. Under load its SGLang imports cost over a minute.

PAGES = 128
SIZE_GB = 0.04  # 40 MB: room for every case's pages in a container's 64 MB /dev/shm


@pytest.fixture(scope="module")
def zygote():
    need_sglang()
    with Zygote(sglang=True) as z:
        yield z


def _engine(zygote, task, **args):
    args.setdefault("pages", PAGES)
    zygote.start(task, "sglang_pool", **args)


CASES = [("mha", "layer_first", "sglang", "hicache"), ("mha", "page_first", "hicache", "plugged"),
         ("mha", "page_first_direct", "plugged", "sglang"), ("mha", "page_head", "sglang", "plugged"),
         ("mla", "page_first", "plugged", "hicache"), ("mla", "layer_first", "hicache", "sglang")]


@pytest.mark.parametrize("kind, layout, writer_pools, reader_pools", CASES,
                         ids=[f"{k}-{l}-{w}-to-{r}" for k, l, w, r in CASES])
def test_another_engine_reads_what_one_wrote_byte_exact(zygote, shm_dir, kind, layout, writer_pools, reader_pools):
    """Engine A (its pools as ``writer_pools``) stores 128 pages and ends; engine B, another
    process with its own pool (``reader_pools``), attaches the same arena, finds all 128 and
    loads them into its device pool byte for byte. Nothing stays registered in either."""
    path = str(shm_dir / "arena")
    _engine(zygote, "a", path=path, size_gb=SIZE_GB, kind=kind, layout=layout, pools=writer_pools, seed=7,
            write=True)
    a = zygote.result("a")
    _engine(zygote, "b", path=path, size_gb=SIZE_GB, kind=kind, layout=layout, pools=reader_pools, seed=0,
            write=False, read_seed=7)
    b = zygote.result("b")
    assert a["stored"] and a["created"] and not b["created"]
    assert (a["pool"][0], b["pool"][0]) == ("hicache" if writer_pools == "hicache" else "sglang",
                                            "hicache" if reader_pools == "hicache" else "sglang")
    assert (b["exists"], b["fetched"], b["byte_exact"]) == (PAGES, PAGES, True)
    assert b["stats"]["pages"] == PAGES and b["stats"]["hits"] == PAGES
    assert a["held_after_destroy"] == b["held_after_destroy"] == []


def test_mla_at_tp4_keeps_one_copy_that_every_rank_loads(zygote, shm_dir):
    """Four MLA ranks (SGLang's is_storage_writer: rank 0 only) back the same pages up: the
    arena holds 128 pages - one copy - and each of the four ranks loads the same bytes."""
    path, stored = str(shm_dir / "arena"), str(shm_dir / "stored")
    for rank in range(4):
        _engine(zygote, f"r{rank}", path=path, size_gb=SIZE_GB, kind="mla", layout="page_first", pools="plugged",
                seed=21, write=True, read_seed=21, tp_rank=rank, tp_size=4, wait=stored)
    for rank in range(4):
        zygote.wait_for(f"r{rank}", "stored")
    open(stored, "w").close()  # rank 0's pages are in: now every rank reads
    reports = [zygote.result(f"r{rank}") for rank in range(4)]
    assert [r["writer"] for r in reports] == [True, False, False, False]
    assert [r["byte_exact"] for r in reports] == [True] * 4, [(r["exists"], r["fetched"], r["stats"]) for r in reports]
    assert [r["fetched"] for r in reports] == [PAGES] * 4
    assert {r["stats"]["pages"] for r in reports} == {PAGES}
    assert sum(r["created"] for r in reports) == 1


def test_mha_at_tp2_keeps_the_ranks_pages_apart_and_another_model_misses(zygote, shm_dir):
    """Two MHA ranks store the same keys (their own heads: different bytes): each reads back its
    own pages, the arena holds 2 x 128; an engine of another model finds none of them."""
    path, stored = str(shm_dir / "arena"), str(shm_dir / "stored")
    for rank, seed in ((0, 31), (1, 32)):
        _engine(zygote, f"r{rank}", path=path, size_gb=SIZE_GB, kind="mha", layout="page_first", pools="sglang",
                seed=seed, write=True, read_seed=seed, tp_rank=rank, tp_size=2, wait=stored)
    for rank in range(2):
        zygote.wait_for(f"r{rank}", "stored")
    open(stored, "w").close()
    reports = [zygote.result(f"r{rank}") for rank in range(2)]
    assert [r["byte_exact"] for r in reports] == [True, True], [(r["exists"], r["fetched"], r["stats"]) for r in reports]
    assert {r["stats"]["pages"] for r in reports} == {2 * PAGES}
    _engine(zygote, "other", path=path, size_gb=SIZE_GB, kind="mha", layout="page_first", pools="sglang", seed=0,
            write=False, read_seed=31, tp_rank=0, tp_size=2, model="another/model")
    other = zygote.result("other")
    assert (other["exists"], other["fetched"], other["byte_exact"]) == (0, 0, False)


@pytest.mark.parametrize("host_memory_mode", ["cache", "buffer_only"])
def test_a_restarted_engine_prefetches_what_a_killed_one_stored(zygote, shm_dir, host_memory_mode):
    """SGLang's HybridCacheController with `--hicache-storage-backend dynamic` backs 32 pages up
    through its backup thread and is kill -9ed; a fresh controller in a new process prefetches
    the same tokens through SGLang's prefetch threads (hit query, zero-copy batch_get_v1) and
    loads them into its device pool byte for byte. Its attach faulted no data page in."""
    path = str(shm_dir / "arena")
    args = dict(path=path, size_gb=SIZE_GB, kind="mha", layout="page_first_direct", pools="plugged", seed=3,
                pages=32, host_memory_mode=host_memory_mode)
    zygote.start("old", "controller", mode="write", **args)
    assert zygote.wait_for("old", "stored") == ["stored", str(32 * 16)]
    zygote.kill("old")
    zygote.start("new", "controller", mode="prefetch", **args)
    new = zygote.result("new")
    assert (new["backend"], new["zero_copy"]) == ("HiCacheNodeStore", "_page_get_zero_copy")
    assert (new["hit_tokens"], new["fetched_tokens"], new["byte_exact"]) == (32 * 16, 32 * 16, True)
    assert new["stats"]["pages"] == 32 and new["stats"]["torn"] == 0
    # header and index pages only, plus the kernel's read fault-around (up to 16 neighbouring
    # pages already in tmpfs mapped with the last index page): never the arena's data
    assert 0 < new["attach_resident"] <= new["data_offset"] + 16 * 4096
    assert new["closed"] and new["held_after_destroy"] == []


def test_two_instances_alive_on_one_node_share_pages(zygote, shm_dir):
    """Instance A stores its pages and stays up (its arena mapped); instance B, started beside
    it, hits all of them and loads them byte-exact; then A ends - nothing registered in either."""
    path, done = str(shm_dir / "arena"), str(shm_dir / "done")
    _engine(zygote, "a", path=path, size_gb=SIZE_GB, kind="mla", layout="page_first_direct", pools="plugged", seed=41,
            write=True, wait=done)
    zygote.wait_for("a", "stored")
    _engine(zygote, "b", path=path, size_gb=SIZE_GB, kind="mla", layout="page_first_direct", pools="hicache", seed=0,
            write=False, read_seed=41)
    b = zygote.result("b")
    open(done, "w").close()
    a = zygote.result("a")
    assert (b["exists"], b["fetched"], b["byte_exact"], b.get("loaded_to_device")) == (PAGES, PAGES, True, True)
    assert a["held_after_destroy"] == b["held_after_destroy"] == []
