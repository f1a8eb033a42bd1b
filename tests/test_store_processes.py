"""The node store across processes (one zygote forks them: tests/store_child.py): a writer
kill -9ed at 50 points of its writes leaves every page `exists` reports byte-exact, its torn slots
invisible and reclaimed - exactly as many as it had claimed and not published - on the next
attach; a clearer kill -9ed at any slot leaves that one slot torn and every other page whole; and a writer evicting all along while another process reads never makes that reader see
a wrong byte or wait. Order comes from the processes' own messages, never from time."""

from __future__ import annotations

import pytest
import torch
from store_roles import PAGE_BYTES, _segments, core_namespace, page_bytes_of
from store_support import Zygote, arena_of, build_slotops, shm_dir  # noqa: F401 - shm_dir: a fixture

from hicache.store import open_store

pytestmark = pytest.mark.concurrency  # processes: `make test-loaded` runs these again under load

BATCHES, PER_BATCH = 2, 5
STAGES = ("claimed", "half", "copied", "summed", "published")
POINTS = [(b, p, s) for b in range(BATCHES) for p in range(PER_BATCH) for s in STAGES]  # 50 points


def _torn_at(page: int, stage: str) -> int:
    """Slots of the killed batch claimed but not published at that point of `SlotIndex.write`:
    a batch claims every page first, copies each, then publishes each in turn."""
    return {"claimed": page + 1, "half": PER_BATCH, "copied": PER_BATCH, "summed": PER_BATCH - page,
            "published": PER_BATCH - page - 1}[stage]


def _published_before(batch: int, page: int, stage: str) -> int:
    done = page + (stage == "published") if stage in ("summed", "published") else 0
    return batch * PER_BATCH + done


@pytest.fixture(scope="module")
def zygote():
    with Zygote() as z:
        yield z


@pytest.fixture(scope="module")
def hooked_build(tmp_path_factory):
    """The path of the C helper built with its step hook (test_store_c_steps has its charter)."""
    module = build_slotops(tmp_path_factory.mktemp("step-hook"), "HICACHE_STEP_HOOK")
    return module.__file__


@pytest.mark.parametrize("path", ["python", "c"])
def test_a_writer_killed_at_any_of_50_points_leaves_only_whole_pages(request, zygote, shm_dir, path):
    """For each point (batch, page, stage of the write) a fresh writer is killed there; the
    next attach reclaims exactly the slots it had claimed and not published, and every page
    `exists`/`present` reports reads back byte for byte. The Python write, and the C write a
    user's build runs (its test build's step hook at the same steps)."""
    assert len(POINTS) == 50
    build = request.getfixturevalue("hooked_build") if path == "c" else None
    ns = core_namespace()
    keys = [f"p{i}" for i in range(BATCHES * PER_BATCH)]
    for n, (batch, page, stage) in enumerate(POINTS):
        arena_file = str(shm_dir / f"arena{n}")
        task = f"w{n}"
        zygote.start(task, "write_until", path=arena_file, size=4 << 20, batches=BATCHES, per_batch=PER_BATCH, seed=n,
                     kill_at=[batch, page, stage], hooked_build=build)
        assert zygote.wait_for(task, "at")[1:] == [stage, str(page)]
        zygote.kill(task)
        store = open_store(arena_file, size_bytes=None, slot_bytes=PAGE_BYTES)
        try:
            assert store.reclaimed == _torn_at(page, stage), (batch, page, stage)
            present = store.present(ns, keys)
            assert sum(present) == _published_before(batch, page, stage), (batch, page, stage)
            held = [k for k, p in zip(keys, present) if p]
            out = [torch.zeros(PAGE_BYTES, dtype=torch.uint8) for _ in held]
            assert store.get(ns, held, [_segments(t) for t in out]) == [True] * len(held)
            for key, got in zip(held, out):
                assert torch.equal(got, page_bytes_of(n, int(key[1:]))), (batch, page, stage, key)
            assert store.census().torn == 0
        finally:
            store.close()


def test_a_clearer_killed_at_any_slot_leaves_one_torn_slot_and_the_rest_whole(request, zygote, shm_dir):
    """A clear (the C helper a user's build runs, its test build's step hook) killed at each of 10
    slots, between the slot's odd generation and its empty record: the next attach reclaims that
    one slot; the slots cleared before it are empty, every page after it reads back byte-exact."""
    from hicache.store._keys import slot_keys

    build = request.getfixturevalue("hooked_build")
    ns = core_namespace()
    keys = [f"p{i}" for i in range(10)]
    for n in range(10):
        arena_file = str(shm_dir / f"arena{n}")
        store = open_store(arena_file, size_bytes=4 << 20, slot_bytes=PAGE_BYTES)
        pages = [page_bytes_of(n, i) for i in range(10)]  # held while the store copies them
        assert store.put(ns, keys, [_segments(page) for page in pages]) == [True] * 10
        slot_of = dict(zip(keys, store.index.find(slot_keys(ns.digest, keys))[0]))
        store.close()
        task = f"c{n}"
        zygote.start(task, "clear_until", path=arena_file, hooked_build=build, kill_at=n)
        killed_at = int(zygote.wait_for(task, "at")[1])
        zygote.kill(task)
        assert killed_at == sorted(slot_of.values())[n]  # a clear goes up the index
        store = open_store(arena_file, size_bytes=None, slot_bytes=PAGE_BYTES)
        try:
            assert store.reclaimed == 1, n
            left = [key for key in keys if slot_of[key] > killed_at]
            assert store.present(ns, keys) == [key in left for key in keys], n
            out = [torch.zeros(PAGE_BYTES, dtype=torch.uint8) for _ in left]
            assert store.get(ns, left, [_segments(t) for t in out]) == [True] * len(left)
            assert all(torch.equal(got, page_bytes_of(n, int(key[1:]))) for key, got in zip(left, out)), n
            assert store.census().torn == 0
        finally:
            store.close()


def test_eviction_under_pressure_while_another_process_reads_never_gives_a_wrong_byte(zygote, shm_dir):
    """A writer puts 40 chains of 12 pages into 64 slots (evicting all along) while a reader,
    started first and stopped after the writer is done, looks every chain up and reads its
    leading run: every page read True is byte-exact, and the reader really read during the
    writes (its first "reading" came before the writer's go)."""
    path = str(shm_dir / "arena")
    from hicache.plan import plan_store

    open_store(path, size_bytes=arena_of(64, PAGE_BYTES), slot_bytes=PAGE_BYTES).close()
    assert plan_store(arena_of(64, PAGE_BYTES), slot_bytes=PAGE_BYTES).slots < 40 * 12
    go, stop = str(shm_dir / "go"), str(shm_dir / "stop")
    zygote.start("reader", "pressure_reader", path=path, chains=40, length=12, seed=5, stop=stop)
    zygote.start("writer", "pressure_writer", path=path, chains=40, length=12, seed=5, go=go)
    zygote.wait_for("reader", "reading")
    open(go, "w").close()
    written = zygote.result("writer")
    open(stop, "w").close()
    read = zygote.result("reader")
    assert written["evictions"] > 0 and written["writes"] == 40 * 12
    assert read["wrong"] == 0 and read["rounds"] >= 1
    assert read["hits"] > 0  # its last round came after the writer's last chain: those pages are held


def test_the_kill_points_cover_every_stage_of_a_write():
    """Not vacuous: the points name every stage the Python write's fault hook and the C write's
    step hook report."""
    import inspect
    from pathlib import Path

    import hicache
    from hicache.store import _index

    source = inspect.getsource(_index.SlotIndex._write)
    assert all(f'self._hook("{stage}"' in source for stage in STAGES)
    c_source = (Path(hicache.__file__).parent / "effects" / "_arena" / "_slotops.c").read_text()
    assert all(f'STEP("{stage}"' in c_source for stage in STAGES)


def test_a_reused_task_name_never_takes_an_earlier_tasks_events(zygote, shm_dir):
    """The harness itself: a task name started again (each test names its engines "a", "b")
    waits for the new task's event, never for one an earlier task of that name left unread -
    the stale "stored" that once let an engine read before its writer had written."""
    def writer(n: int, stage: str, page: int) -> None:
        zygote.start("same", "write_until", path=str(shm_dir / f"arena{n}"), size=4 << 20, batches=1, per_batch=2,
                     seed=n, kill_at=[0, page, stage])

    writer(0, "copied", 0)  # its "at copied 0" is never read
    writer(1, "published", 1)
    assert zygote.wait_for("same", "at")[1:] == ["published", "1"]
    zygote.kill("same")
