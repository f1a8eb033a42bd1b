"""SGLang's radix tree with hicache's node store as its L3, across an engine restart.

`UnifiedRadixCache` with HiCache and an L3 back end, as `tests/test_sglang_radix.py` builds it,
with `--hicache-storage-backend dynamic` naming hicache's `HiCacheNodeStore` (an arena in
/dev/shm) - the seam a 0.5.23 server loads it through. An engine serves random traffic; the
tree writes each node through to its host pool and then, by itself, to the store (SGLang's
backup thread). The engine closes - its atexit hook's detach, its pools destroyed - and a new
engine attaches the same arena, as a restarted server does, and serves every request the first
one completed: the scheduler's L3 step prefetches what neither device nor host holds (SGLang's
prefetch thread, `wait_complete`), then the host hit is loaded back.

Laws: every token the restarted engine hands a request holds that request's bytes (the table by
token id; for the hybrids and the sparse attentions also what the store's second pool holds:
Mamba2 states, windows, index keys); every request the first engine completed comes back
whole; and the restarted engine's trace (matches, host hits, tokens from storage, loads) is the
same as over SGLang's own `HiCacheFile` back end - for MHA, MLA, MLA with an MTP draft layer
(whole: the pages of bigrams the tree keeps), DeepSeek's and MiniMax's sparse attention,
DeepSeek-V4 (seven pools; its KV anchor's pages are the store's markers), a Mamba2 hybrid, a sliding-window hybrid, one of both, layer_first and write_back (whose unevicted
requests never reach L3; nor does SGLang fetch every short span of a sliding-window model: no
whole-back law for those), over hicache's pools and over SGLang's own pools alike. (SGLang's own pools
under HiCacheFile do not run on CPU: its dummy page asks for pinned memory.) Both engines
settle each step's writes before the next (`_written`): unsettled, what the restarted engine's
next request finds on host depends on when SGLang's write-back thread finished (one write_back
traffic fetched 64 or 48 tokens for the same request over HiCacheFile and over the store alike,
3 runs in 8 differing). SGLang's own /clear_hicache_storage_backend path empties the store: a
restart then fetches nothing; its PD role switch (store cleared, tree reset) leaves an engine
that serves as a fresh one does. Needs `make sglang`."""

from __future__ import annotations

import json
import shutil
import tempfile
from pathlib import Path

import pytest
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st
from machine import roomy_psutil  # noqa: F401 - a fixture
from sglang_support import loaded_side_first, sglang  # noqa: F401 - sglang: a fixture
from store_support import shm_dir, wait_until  # noqa: F401 - shm_dir: a fixture
from test_sglang_radix import STEPS, _requests, engine, kept, traffic

pytest.importorskip("torch")

ENGINES = {  # family, layout, io_backend, page size, write policy
    "mha": ("mha", "page_first", "kernel", 16, "write_through"),  # SGLang 0.5.23's defaults
    "mla": ("mla", "page_first", "kernel", 16, "write_through"),  # one KV buffer, stored once per page
    "mamba": ("mamba", "page_first", "kernel", 1, "write_through"),  # Mamba2 states: the store's second pool
    "mha-write_back": ("mha", "page_first", "kernel", 16, "write_back"),  # to host, then L3, only when evicted:
    # what the first engine still held on its device at close never reached L3 (no law that it comes back)
    "mha-layer_first": ("mha", "layer_first", "direct", 16, "write_through"),  # L3 pages gathered from layers
    "swa": ("swa", "page_first", "kernel", 16, "write_through"),  # sliding-window KV: the store's second pool
    "mamba-swa": ("mamba-swa", "page_first", "kernel", 1, "write_through"),  # windows and states: three pools
    "dsa": ("dsa", "page_first", "kernel", 64, "write_through"),  # DeepSeek's indexer keys: the store's second pool
    "minimax": ("minimax", "page_first", "kernel", 16, "write_through"),  # MiniMax's index keys: its second pool
    "mtp": ("mtp", "page_first", "kernel", 16, "write_through"),  # an MTP draft layer in the KV pages; EAGLE's tree
    "v4": ("v4", "page_first", "kernel", 256, "write_through"),  # DeepSeek-V4: six pools of page rows, seven in all
}
#: where every completed request comes back whole: not under write_back (above), nor for a
#: sliding-window model, where SGLang prefetches no L3 span shorter than a window's pages that
#: starts below a device prefix (its SWA component's `prepare_prefetch`: "the window head would
#: have to come from the device prefix, which the match validator does not promise"). DeepSeek-V4
#: comes back whole: its window (128 tokens) is under one page (256), so no span is that short
WHOLE_BACK = set(ENGINES) - {"mha-write_back", "swa", "mamba-swa"}


#: the arena's size, GB: no page of a traffic evicted, as none is from HiCacheFile's directory.
#: DeepSeek-V4's: six pools' pages and the anchor's marker a page of tokens, each in a slot of its
#: largest page (the window KV's 449 KiB): 3.1 MiB a page of tokens
ARENA_GB = {"v4": 0.5}


def _flags(store: str, where, family: str) -> dict:
    """The launch flags of an L3 back end: hicache's store through the dynamic seam (its arena
    created by the first engine, attached by the next), or SGLang's HiCacheFile."""
    if store == "hicache":
        extra = {"backend_name": "hicache_node", "module_path": "hicache.compat.sglang_store",
                 "class_name": "HiCacheNodeStore", "interface_v1": 1, "arena": str(where / "arena"),
                 "size_gb": ARENA_GB.get(family, 0.05)}
        backend = "dynamic"
    else:
        extra, backend = {}, "file"
    extra["prefetch_threshold"] = 1  # SGLang's default (256 tokens) would skip these short requests
    return dict(hicache_storage_backend=backend, hicache_storage_backend_extra_config=json.dumps(extra),
                hicache_storage_prefetch_policy="wait_complete")


def _written(serving) -> None:
    """Every write of the step finished, to host and then to L3. A server does not wait; but what
    reaches L3 before the host evicts it then depends on SGLang's backup thread's timing (over
    HiCacheFile too), and only a settled write is one every restart must find."""
    cache = serving.cache
    cache.writing_check(write_back=True)

    def written() -> bool:
        cache.drain_storage_control_queues()  # the scheduler's poll: finished L3 writes release their nodes
        return not cache.ongoing_backup

    wait_until(written)  # SGLang's backup thread answers in its own time


def _restart(monkeypatch, pools: str, store: str, where, steps, family: str = "mha") -> tuple:
    """The first engine serves ``steps`` and waits for its L3 writes; a restarted one serves
    every request the first completed, waiting for its writes after each too. Returns those requests, the restarted engine's rows and
    the tokens storage gave it for each."""
    from sglang.srt.environ import envs

    with envs.SGLANG_HICACHE_FILE_BACKEND_STORAGE_DIR.override(str(where / "files")):
        with engine(monkeypatch, pools, *ENGINES[family], **_flags(store, where, family)) as first:
            assert type(first.cache.cache_controller.storage_backend).__name__ == (
                "HiCacheNodeStore" if store == "hicache" else "HiCacheFile")
            rows = [row for row in traffic(first, steps, settle=_written) if row[0] == "serve"]
        served = [tokens for tokens in _requests(steps, first.unit, first.vocab) if tokens is not None]
        completed = [tokens for tokens, row in zip(served, rows) if row[-1] != "no room"]
        with engine(monkeypatch, pools, *ENGINES[family], **_flags(store, where, family)) as restarted:
            again = []
            for tokens in completed:  # each settled as the first engine's steps are: see `_written`
                again.append(restarted.serve(tokens))
                _written(restarted)
            return completed, again, restarted.fetched


#: traffics an example serves, each through the three engine pairs
RUNS = 2


@pytest.mark.parametrize("family", sorted(ENGINES))
# examples of RUNS traffics, each pair's engines built one after another (the plug-in loads once a
# pair's pools, not once a traffic: sglang_support.plug); 2 examples, as hypothesis's first is its
# simplest; no shrinking, as in test_sglang_radix
@settings(max_examples=2, deadline=None, phases=(Phase.explicit, Phase.reuse, Phase.generate),
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(traffics=st.lists(STEPS, min_size=RUNS, max_size=RUNS))
def test_a_restarted_engine_gets_every_completed_request_back_from_hicaches_store(sglang, monkeypatch,
                                                                                roomy_psutil, shm_dir, family,
                                                                                traffics):
    """Random traffic, an engine restart, the same requests again: whole from the store, the right
    bytes (and what the store's second pool holds), and the same trace as over SGLang's
    HiCacheFile, over hicache's pools and SGLang's."""
    runs, example = {}, Path(tempfile.mkdtemp(dir=shm_dir))  # hypothesis's examples share the fixture
    kind, page = ENGINES[family][0], ENGINES[family][3]
    for pools, store in loaded_side_first((("hicache", "file"), ("hicache", "hicache"), ("sglang", "hicache"))):
        for n, steps in enumerate(traffics):
            where = example / f"{pools}-{store}-{n}"
            where.mkdir()
            try:
                runs[pools, store, n] = _restart(monkeypatch, pools, store, where, steps, family)
            finally:  # its arena gone before the next is made: /dev/shm is memory (DeepSeek-V4's: 0.5 GB each)
                shutil.rmtree(where)
    for n in range(RUNS):
        completed, again, fetched = runs["hicache", "hicache", n]
        if family in WHOLE_BACK:
            for tokens, row in zip(completed, again):
                assert row[2] + row[3] == kept(kind, tokens, page), (
                    f"traffic {n}: a completed request of {len(tokens)} tokens came back as {row}")
        oracle = runs["hicache", "file", n]
        for pools, store in (("hicache", "hicache"), ("sglang", "hicache")):
            run = runs[pools, store, n]
            assert run == oracle, (f"traffic {n}, {pools} pools, {store} store: {run[1:]} against HiCacheFile's "
                                   f"{oracle[1:]}")
        if ENGINES[family][-1] == "write_through":
            assert sum(fetched) > 0 or not any(kept(kind, tokens, page) for tokens in completed)


@pytest.mark.concurrency  # SGLang's storage threads on a busy box (`make test-loaded`); the property above
# stays out of that run: three engine pairs per example at a load of 8 would take minutes
def test_the_restart_fetches_from_storage(sglang, monkeypatch, roomy_psutil, shm_dir):
    """A fixed run, so the property cannot pass without L3: after the restart, requests that the
    first engine completed come back from hicache's store, not only from a warm device."""
    steps = [("serve", 0, 1), ("serve", 0, 2), ("serve", 1, 4), ("serve", 0, 2), ("evict", 7, 0)]
    completed, again, fetched = _restart(monkeypatch, "hicache", "hicache", shm_dir, steps)
    # the third continues the first, whose 2 units the restarted device holds by then: only its 2 new come from L3
    assert [len(tokens) for tokens in completed] == [32, 48, 64, 48] and fetched == [32, 48, 32, 48], fetched
    assert sum(fetched) == len({token for tokens in completed for token in tokens})  # each stored token once
    assert all(row[2] + row[3] == len(tokens) for tokens, row in zip(completed, again))


@pytest.mark.concurrency  # SGLang's storage threads, as above
def test_sglangs_clear_storage_backend_empties_the_store_a_restart_then_fetches_nothing(sglang, monkeypatch,
                                                                                      roomy_psutil, shm_dir):
    """SGLang's /clear_hicache_storage_backend (its tree's `clear_storage_backend`, on the scheduler's
    thread) over hicache's store, after the run above settled its writes: True, the arena keeps no
    page of the engine, and the restarted engine fetches nothing from storage."""
    from sglang.srt.environ import envs

    steps = [("serve", 0, 1), ("serve", 0, 2), ("serve", 1, 4), ("serve", 0, 2), ("evict", 7, 0)]
    with envs.SGLANG_HICACHE_FILE_BACKEND_STORAGE_DIR.override(str(shm_dir / "files")):
        with engine(monkeypatch, "hicache", *ENGINES["mha"], **_flags("hicache", shm_dir, "mha")) as first:
            traffic(first, steps, settle=_written)
            store = first.cache.cache_controller.storage_backend
            assert store.store.census().pages > 0
            assert first.cache.clear_storage_backend() is True
            assert store.store.census().pages == 0
        completed = [tokens for tokens in _requests(steps, first.unit, first.vocab) if tokens is not None]
        with engine(monkeypatch, "hicache", *ENGINES["mha"], **_flags("hicache", shm_dir, "mha")) as restarted:
            for tokens in completed:
                restarted.serve(tokens)
                _written(restarted)
            assert restarted.fetched == [0] * len(completed)


@pytest.mark.concurrency  # SGLang's storage threads, as above
@pytest.mark.parametrize("pools", ["hicache", "sglang"])
def test_sglangs_role_switch_releases_tree_and_store_and_the_engine_serves_as_a_fresh_one(sglang, monkeypatch,
                                                                                           roomy_psutil, shm_dir,
                                                                                           pools):
    """A PD role switch of an idle engine (SGLang's own `_release_prefix_cache_for_role_switch`:
    the store cleared, the tree, its host pool and the allocators reset) over hicache's store,
    with hicache's pools and with SGLang's: the store keeps none of its pages, and the same
    requests then go exactly as on a fresh engine over an empty arena - nothing matched from
    device, host or storage that the switch should have dropped."""
    from types import SimpleNamespace

    from sglang.srt.disaggregation.role_switch import _release_prefix_cache_for_role_switch
    from sglang.srt.environ import envs

    steps = [("serve", 0, 1), ("serve", 0, 2), ("serve", 1, 4), ("serve", 0, 2), ("evict", 7, 0)]
    (shm_dir / "fresh").mkdir()
    with envs.SGLANG_HICACHE_FILE_BACKEND_STORAGE_DIR.override(str(shm_dir / "files")):
        with engine(monkeypatch, pools, *ENGINES["mha"], **_flags("hicache", shm_dir, "mha")) as switched:
            traffic(switched, steps, settle=_written)
            store = switched.cache.cache_controller.storage_backend
            assert store.store.census().pages > 0
            _release_prefix_cache_for_role_switch(SimpleNamespace(
                disable_radix_cache=False, tree_cache=switched.cache,
                req_to_token_pool=switched.cache.req_to_token_pool, token_to_kv_pool_allocator=switched.allocator))
            assert store.store.census().pages == 0
            completed = [tokens for tokens in _requests(steps, switched.unit, switched.vocab) if tokens is not None]
            after = []
            for tokens in completed:
                after.append(switched.serve(tokens))
                _written(switched)
            after_fetched = switched.fetched[-len(completed):]
        with engine(monkeypatch, pools, *ENGINES["mha"], **_flags("hicache", shm_dir / "fresh", "mha")) as fresh:
            oracle = []
            for tokens in completed:
                oracle.append(fresh.serve(tokens))
                _written(fresh)
            assert (after, after_fetched) == (oracle, fresh.fetched)
    assert tuple(after[0][2:4]) == (0, 0)  # the first request matched nothing
