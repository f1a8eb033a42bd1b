"""What each process of the node store's multi-process tests does (run by tests/store_child.py,
one forked process per task). Each role reports events through ``say`` and returns a JSON-able
report; page contents are a function of (seed, page) so any process can check any page."""

from __future__ import annotations

import os
import time

PAGE_BYTES = 4096  # the core roles' page: 4 segments of 1 KiB
SEGMENTS = 4


def page_bytes_of(seed: int, page: int, size: int = PAGE_BYTES):
    import torch

    generator = torch.Generator().manual_seed(seed * 1_000_003 + page)
    return torch.randint(0, 256, (size,), dtype=torch.uint8, generator=generator)


def _segments(tensor) -> list:
    step = tensor.numel() // SEGMENTS
    return [(tensor.data_ptr() + i * step, step) for i in range(SEGMENTS)]


def core_namespace():
    from hicache.store import Namespace

    return Namespace(model="core", dtype="uint8", page_tokens=1, layout="flat", pool="kv", page_bytes=PAGE_BYTES)


def _wait_file(path: str) -> None:
    """Block until ``path`` exists (a barrier the test sets); a hang guard, not a timer."""
    deadline = time.monotonic() + 300
    while not os.path.exists(path):
        if time.monotonic() > deadline:
            raise TimeoutError(f"hang guard: {path} never appeared")
        time.sleep(0.002)


# -- core store ----------------------------------------------------------------------------------

def write_until(say, *, path: str, size: int, batches: int, per_batch: int, seed: int, kill_at=None) -> dict:
    """Write ``batches`` batches of ``per_batch`` pages; at the write step ``kill_at`` =
    [batch, page, stage] say "at" and wait to be killed."""
    from hicache.store import open_store

    position = {"batch": 0}

    def hook(stage: str, page: int) -> None:
        if kill_at is not None and [position["batch"], page, stage] == list(kill_at):
            say("at", stage, page)
            while True:
                time.sleep(3600)

    store = open_store(path, size_bytes=size, slot_bytes=PAGE_BYTES, fault_hook=hook)
    ns = core_namespace()
    for batch in range(batches):
        position["batch"] = batch
        pages = [page_bytes_of(seed, batch * per_batch + i) for i in range(per_batch)]
        keys = [f"p{batch * per_batch + i}" for i in range(per_batch)]
        assert store.put(ns, keys, [_segments(t) for t in pages]) == [True] * per_batch
    store.close()
    return {"written": batches * per_batch}


def pressure_writer(say, *, path: str, chains: int, length: int, seed: int, go: str) -> dict:
    """After the ``go`` file appears, write ``chains`` chains of ``length`` pages (more than the
    arena holds: eviction all along)."""
    from hicache.store import open_store

    store = open_store(path, size_bytes=None, slot_bytes=PAGE_BYTES)
    ns = core_namespace()
    _wait_file(go)
    for chain in range(chains):
        keys = [f"c{chain}-{i}" for i in range(length)]
        pages = [page_bytes_of(seed, chain * 1000 + i) for i in range(length)]
        store.put(ns, keys, [_segments(t) for t in pages], first_depth=0)
        say("chain", chain)
    counts = store.counts
    store.close()
    return {"evictions": counts.evictions, "writes": counts.writes}


def pressure_reader(say, *, path: str, chains: int, length: int, seed: int, stop: str) -> dict:
    """Until the ``stop`` file appears: look chains up (SGLang's leading-run exists), read what
    is reported and check every page read True byte for byte."""
    import torch

    from hicache.store import open_store

    store = open_store(path, size_bytes=None, slot_bytes=PAGE_BYTES)
    ns = core_namespace()
    reads = wrong = hits = rounds = 0
    say("reading")
    while not os.path.exists(stop) or rounds < 1:
        for chain in range(chains):
            keys = [f"c{chain}-{i}" for i in range(length)]
            lead = store.exists(ns, keys)
            if not lead:
                continue
            out = [torch.zeros(PAGE_BYTES, dtype=torch.uint8) for _ in range(lead)]
            ok = store.get(ns, keys[:lead], [_segments(t) for t in out])
            reads += lead
            for i, (hit, got) in enumerate(zip(ok, out)):
                if hit:
                    hits += 1
                    wrong += not torch.equal(got, page_bytes_of(seed, chain * 1000 + i))
        rounds += 1
    counts = store.counts
    store.close()
    return {"reads": reads, "hits": hits, "wrong": wrong, "torn": counts.torn, "corrupt": counts.corrupt,
            "rounds": rounds}


ROLES = {name: globals()[name] for name in ("write_until", "pressure_writer", "pressure_reader")}
