"""Attaching the node store's arena, at its edges: a file swapped for a symlink or a socket
between the look and the open is refused naming what it is; a file whose size is not its
header's, or not the size asked for, is refused; a refused attach keeps no descriptor open;
the seconds an attach reports are its own. And the arena-wide counters: every attach's counts
reach them at once, with the C helper's atomics and with the fallback's lock, which it lets go."""

from __future__ import annotations

import os
import socket
import time

import pytest
from store_support import shm_dir  # noqa: F401 - shm_dir: a fixture
from test_store_arena import _plan
from test_store_creators import _descriptors_of
from test_store_index import NS, OPS, Pages, _open

from hicache.effects import arena
from hicache.errors import ArenaError, ArenaGeometryError
from hicache.plan.store_format import COUNTERS, COUNTERS_OFFSET

ARENA_ROOM = "hicache.effects._arena._arena"


def _made(path: str) -> None:
    arena.create_arena(path, _plan(), label="t").close()


@pytest.fixture
def swapped_after_the_look(monkeypatch):
    """The attach's looks at the path (lstat, unfinished?) report a finished regular file, as
    they would have just before another process swapped the file: what the open then finds is
    what the attach must judge."""
    monkeypatch.setattr(f"{ARENA_ROOM}._refuse_non_regular", lambda path, info=None: None)
    monkeypatch.setattr(f"{ARENA_ROOM}._incomplete", lambda path, backing: False)


def test_a_symlink_or_a_socket_swapped_in_after_the_look_is_refused_at_the_open(shm_dir, swapped_after_the_look):
    """The open itself refuses what the look missed: a symlink (O_NOFOLLOW: ELOOP) is named as
    one - its target, a real arena, is not attached - and a socket's open error is named; the
    arena behind the link keeps no descriptor of this process."""
    target = str(shm_dir / "real")
    _made(target)
    link = shm_dir / "link"
    link.symlink_to(target)
    backing = arena.backing_of(target)  # read before the swap, as the look was
    with pytest.raises(ArenaError, match=rf"store arena {link}: is a symbolic link"):
        arena.attach_arena(str(link), backing=backing)
    assert _descriptors_of(target) == 0
    listener = socket.socket(socket.AF_UNIX)
    try:
        listener.bind(str(shm_dir / "sock"))
        with pytest.raises(ArenaError, match=r"sock: cannot open \(No such device or address\)"):
            arena.attach_arena(str(shm_dir / "sock"), backing=backing)
    finally:
        listener.close()


def test_a_file_whose_size_is_not_its_headers_is_refused_and_keeps_no_descriptor(shm_dir):
    """An arena grown by a page after it was made (its header says the old size): refused
    naming both sizes, and neither that refusal nor a corrupt header's keeps the file open."""
    path = str(shm_dir / "kv")
    _made(path)
    total = os.stat(path).st_size
    os.truncate(path, total + 4096)
    with pytest.raises(ArenaError, match=rf"kv: {total + 4096} bytes on disk, its header says {total}"):
        arena.attach_arena(path)
    assert _descriptors_of(path) == 0
    with open(path, "r+b") as file:
        file.write(b"HICSTORX")
    with pytest.raises(ArenaError, match="not a hicache store arena"):
        arena.attach_arena(path)
    assert _descriptors_of(path) == 0


def test_an_attach_asking_only_for_a_size_is_held_to_it(shm_dir):
    """total_bytes alone (no page size) is still checked: another size is an ArenaGeometryError,
    the arena's own size attaches; once it is closed no descriptor of the file stays (the
    looks before the open close theirs)."""
    path = str(shm_dir / "kv")
    _made(path)
    total = os.stat(path).st_size
    with pytest.raises(ArenaGeometryError, match=rf"holds {total} bytes, size_gb asks for {total * 2} bytes"):
        arena.attach_arena(path, total_bytes=total * 2)
    before = time.perf_counter()
    attached = arena.attach_arena(path, total_bytes=total)
    elapsed = time.perf_counter() - before
    try:
        assert 0 <= attached.attach_s <= elapsed  # its own seconds, not a clock reading
    finally:
        attached.close()
    assert _descriptors_of(path) == 0


@pytest.mark.concurrency
@pytest.mark.parametrize("ops", OPS)
def test_every_attachs_counts_reach_the_arena_at_once_and_the_counters_lock_is_let_go(shm_dir, ops):
    """Two attaches of one arena (two open files: OFD locks part them) each count a write and a
    read: the arena's counters show both at once, not at close - with the fallback's lock each
    takes and lets go of (another open file takes it right after), and with the C helper's
    atomics."""
    a, b, src = _open(shm_dir, ops), _open(shm_dir, ops), Pages(2)
    try:
        assert a.put(NS, ["a"], src.segments([0])) == [True]
        assert b.put(NS, ["b"], src.segments([1])) == [True]
        assert a.get(NS, ["b", "x"], src.segments([0, 1])) == [True, False]
        assert b.get(NS, ["a"], src.segments([1])) == [True]
        counts = a.arena.counters()
        assert (counts["writes"], counts["hits"], counts["misses"]) == (2, 2, 1)
        assert b.arena.counters() == counts
        span = 8 * len(COUNTERS)
        for store in (a, b):  # nobody holds any byte of the counters' lock: each takes it whole
            assert arena.try_lock(store.arena.fd, COUNTERS_OFFSET, span + 8)
            arena.unlock(store.arena.fd, COUNTERS_OFFSET, span + 8)
    finally:
        a.close()
        b.close()
