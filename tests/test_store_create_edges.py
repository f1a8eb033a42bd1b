"""Creating and dropping the node store's arena, at its edges: the room's exact boundary; a FIFO
refused before any wait on another creator; ``exist_ok=False``; a umask that would strip the
owner's bits; a reservation or a pre-fault that fails leaving nothing (no file, no descriptor);
the seconds a creation reports; and a drop that leaves another user's arena alone."""

from __future__ import annotations

import errno
import os
import sys
import time

import pytest
from store_support import shm_dir  # noqa: F401 - shm_dir: a fixture
from test_store_arena import _plan
from test_store_creators import _descriptors_of

from hicache.effects import arena
from hicache.errors import ArenaError, HostOutOfMemoryError

ARENA_ROOM = "hicache.effects._arena._arena"


def test_an_arena_exactly_as_large_as_the_free_room_fits(shm_dir):
    """The room check admits an arena of exactly the backing's free bytes and refuses one page more."""
    room = sys.modules[ARENA_ROOM]
    plan = _plan()
    backing = arena.backing_of(str(shm_dir / "kv"))
    exact = type(backing)(backing.directory, backing.mount, plan.total_bytes)
    room.check_room(str(shm_dir / "kv"), plan, exact)
    short = type(backing)(backing.directory, backing.mount, plan.total_bytes - 4096)
    with pytest.raises(ArenaError, match=rf"has {plan.total_bytes - 4096} bytes free, the arena needs {plan.total_bytes}"):
        room.check_room(str(shm_dir / "kv"), plan, short)


def test_a_fifo_is_refused_at_once_even_while_another_creator_holds_the_lock(shm_dir, tmp_path):
    """A FIFO at the path, its backing given (so the backing's own look is skipped) and another
    creator holding the path's lock: one ArenaError naming the FIFO at once - no wait for the
    creator, and the FIFO never opened (an open would block)."""
    creators = sys.modules["hicache.effects._arena._creators"]
    path = shm_dir / "kv"
    backing = arena.backing_of(str(path))
    os.mkfifo(path)
    held = creators.CreatorsLock(str(path), timeout_s=0, directory=tmp_path)
    try:
        with pytest.raises(ArenaError, match=rf"{path}: is a FIFO, not an arena file") as caught:
            arena.create_arena(str(path), _plan(), label="t", backing=backing, lock_dir=tmp_path, wait_s=0)
        assert type(caught.value) is ArenaError  # not "being created": it never waited
    finally:
        held.close()


def test_exist_ok_false_refuses_an_existing_arena_and_keeps_it(shm_dir):
    """create_arena(exist_ok=False) over an arena: an ArenaError saying it exists and how to drop
    it; the arena is left as it was, attachable."""
    path = str(shm_dir / "kv")
    arena.create_arena(path, _plan(), label="first").close()
    with pytest.raises(ArenaError, match=rf"{path}: exists already \(hicache store drop {path} removes it\)"):
        arena.create_arena(path, _plan(), label="second", exist_ok=False)
    again = arena.attach_arena(path)
    try:
        assert again.label == "first"
    finally:
        again.close()


def test_a_umask_stripping_the_owners_bits_still_makes_a_0600_arena(shm_dir):
    """Under a umask of 0o277 (owner read-only) the arena is still made 0600: the creator sets its
    mode, it does not leave it to the umask."""
    old = os.umask(0o277)
    try:
        made = arena.create_arena(str(shm_dir / "kv"), _plan(), label="t")
    finally:
        os.umask(old)
    try:
        assert os.stat(shm_dir / "kv").st_mode & 0o777 == 0o600
    finally:
        made.close()


def test_a_reservation_that_fails_leaves_no_file_and_no_descriptor(shm_dir, monkeypatch):
    """posix_fallocate failing (ENOSPC: tmpfs full since the room was checked): an ArenaError
    naming the bytes and the mount, the file removed, no descriptor of it left."""
    def full(fd, offset, length):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(os, "posix_fallocate", full)
    path = str(shm_dir / "kv")
    with pytest.raises(ArenaError, match=rf"kv: cannot reserve {_plan().total_bytes} bytes on .*No space left"):
        arena.create_arena(path, _plan(), label="t")
    assert not os.path.lexists(path) and _descriptors_of(path) == 0


def test_a_pre_fault_out_of_memory_leaves_no_file_no_mapping_and_no_descriptor(shm_dir, monkeypatch):
    """MADV_POPULATE_WRITE failing with ENOMEM: a HostOutOfMemoryError naming the offset, the
    file removed, its mapping and descriptor closed (no line of /proc/self/maps names it)."""
    import ctypes

    def madvise(addr, length, advice):
        ctypes.set_errno(errno.ENOMEM)
        return -1

    monkeypatch.setattr("hicache.effects._host._memory._madvise", lambda: madvise)
    path = str(shm_dir / "kv")
    with pytest.raises(HostOutOfMemoryError, match="pre-faulting the store arena at offset 0: out of memory") as caught:
        arena.create_arena(path, _plan(), label="t", threads=1)
    # closed by the creation itself, not by the collector: its frames are still alive here (the traceback)
    assert caught.tb is not None and not os.path.lexists(path) and _descriptors_of(path) == 0
    with open("/proc/self/maps") as maps:
        assert path not in maps.read()


def test_a_creations_seconds_are_its_own(shm_dir):
    """attach_s of a created arena counts the creation's seconds: within the call's wall time."""
    before = time.perf_counter()
    made = arena.create_arena(str(shm_dir / "kv"), _plan(), label="t")
    elapsed = time.perf_counter() - before
    try:
        assert made.created and 0 <= made.attach_s <= elapsed
    finally:
        made.close()


def test_drop_leaves_another_users_arena_alone_and_no_descriptor_behind(shm_dir, monkeypatch):
    """An arena owned by another uid (this process seen as uid+1): drop refuses it naming both
    uids and removes nothing. A drop of one's own keeps no descriptor of the unlinked file (its
    pages would stay held)."""
    own = str(shm_dir / "own")
    arena.create_arena(own, _plan(), label="t").close()
    assert arena.drop_arena(own) and not os.path.lexists(own) and _descriptors_of(own) == 0
    path = str(shm_dir / "kv")
    arena.create_arena(path, _plan(), label="t").close()
    owner = os.stat(path).st_uid
    monkeypatch.setattr(os, "getuid", lambda: owner + 1)
    with pytest.raises(ArenaError, match=rf"owned by uid {owner}, not this user \(uid {owner + 1}\)"):
        arena.drop_arena(path)
    assert os.path.exists(path)
