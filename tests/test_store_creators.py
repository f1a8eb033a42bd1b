"""An arena attached while its creator is still at work, or after it died: an engine given no
size (attach only) waits for a creator holding the arena's creators' lock - a node agent's
`hicache store create` pre-faulting beside the engines' start - and attaches what it made;
`hicache store status` and doctor (no wait) name the creator's pid at once, and `hicache store
drop` leaves such an arena alone; an arena whose creator died is refused as such, never waited
for. Order is proved by events, never seconds."""

from __future__ import annotations

import functools
import logging
import os
import sys
import threading

import pytest
from store_support import ARENA_BYTES, shm_dir, wait_until  # noqa: F401 - shm_dir: a fixture

from hicache.effects import arena
from hicache.errors import ArenaBeingCreatedError, ArenaError
from hicache.plan import plan_store
from hicache.store import open_store

pytestmark = pytest.mark.concurrency  # a creator and its waiters on threads: run again under load
SLOT = 8192
#: the creators' lock and its probe (no face names them: the arena room's own)
CREATORS = sys.modules["hicache.effects._arena._creators"]
ARENA_ROOM = "hicache.effects._arena._arena"


class HeldCreator:
    """A `create_arena` on a thread, stopped in its pre-fault (its creators' lock held, the file
    still marked as being created) until `finish`."""

    def __init__(self, path: str) -> None:
        self.started, self.go = threading.Event(), threading.Event()
        self.made: list = []
        self.thread = threading.Thread(target=self._create, args=(path,), name="held-creator", daemon=True)
        self.thread.start()
        assert self.started.wait(60), "the creator never began its pre-fault"  # a hang guard

    def _create(self, path: str) -> None:
        def progress(done, total):
            self.started.set()
            assert self.go.wait(120), "never told to finish"

        self.made.append(arena.create_arena(path, plan_store(ARENA_BYTES, slot_bytes=SLOT), label="agent",
                                            progress=progress, threads=1))

    def finish(self):
        """Let the pre-fault end; the arena it made."""
        self.go.set()
        self.thread.join(120)
        assert not self.thread.is_alive() and self.made, "the creator did not finish"
        return self.made[0]


def test_an_attach_only_engine_waits_for_the_creator_at_work_and_attaches_what_it_made(shm_dir, monkeypatch,
                                                                                         caplog):
    """open_store with no size, beside a creator still pre-faulting: it waits on the creators'
    lock (seen: the lock's wait sleeps) with a warning naming the creator, and once the creator
    ends it attaches the finished arena - not an error, not a second arena."""
    path = str(shm_dir / "kv")
    creator = HeldCreator(path)
    waiting = threading.Event()

    def noted_sleep(seconds):
        waiting.set()
        creator.go.wait(120)  # the lock is free only once the creator finishes

    monkeypatch.setattr(f"{ARENA_ROOM}.CreatorsLock", functools.partial(CREATORS.CreatorsLock, sleep=noted_sleep))
    opened: list = []
    engine = threading.Thread(target=lambda: opened.append(open_store(path, size_bytes=None, slot_bytes=SLOT)),
                              name="engine", daemon=True)
    made = None
    try:
        with caplog.at_level(logging.WARNING, logger=ARENA_ROOM):
            engine.start()
            assert waiting.wait(60), "the engine did not wait for the creator"  # a hang guard
            assert not opened
            made = creator.finish()
            engine.join(120)
        assert opened, "the engine's attach failed"
        store = opened[0]
        assert not store.arena.created and store.arena.label == "agent" and store.arena.plan == made.plan
        assert f"being created by pid {os.getpid()}" in caplog.text
    finally:
        made = made or creator.finish()  # a failed assertion above leaves no creator holding the lock
        for held in opened + [made]:
            held.close()


def test_status_beside_a_creator_at_work_names_its_pid_at_once(shm_dir):
    """attach_arena without waiting (status, doctor) refuses an arena still being made, naming
    the creator's pid; once made, the same call attaches it."""
    path = str(shm_dir / "kv")
    creator = HeldCreator(path)
    try:
        pid = os.getpid()
        with pytest.raises(ArenaBeingCreatedError, match=f"not finished: pid {pid} is still creating it") as caught:
            arena.attach_arena(path)
        assert caught.value.creator == str(os.getpid())
    finally:
        made = creator.finish()
    attached = arena.attach_arena(path)
    try:
        assert attached.label == "agent"
    finally:
        attached.close()
        made.close()


def test_the_cli_beside_a_creator_at_work_says_so_and_what_to_wait_for(shm_dir, capsys):
    """`hicache store status` is error[arena-being-created] with a hint naming the creator's pid;
    `doctor --store` warns (the arena is not broken, only not made yet) with the same pid."""
    import json

    from hicache.cli import main

    path = str(shm_dir / "kv")
    creator = HeldCreator(path)
    try:
        code = main(["store", "status", path])
        err = capsys.readouterr().err
        assert code == 2 and err.startswith("error[arena-being-created]:"), err
        assert f"hint: wait for pid {os.getpid()}'s create to end" in err
        code = main(["doctor", "--store", path, "--format", "json"])
        check = {c["name"]: c for c in json.loads(capsys.readouterr().out)["checks"]}["store"]
        assert check["status"] == "warn" and f"pid {os.getpid()} is still creating it" in check["finding"]
        assert f"once pid {os.getpid()}'s create has ended" in check["hint"]
    finally:
        creator.finish().close()


def test_drop_refuses_an_arena_its_creator_is_still_making_and_drops_it_once_made(shm_dir, capsys):
    """`hicache store drop` beside a creator at work is error[arena-being-created] and leaves the
    file (unlinked, the creator would finish an arena no engine finds and the next engine would
    make a second one); once the create has ended the drop removes it. A dead creator's unfinished
    file is dropped at once."""
    from hicache.cli import main

    path = str(shm_dir / "kv")
    creator = HeldCreator(path)
    try:
        code = main(["store", "drop", path])
        err = capsys.readouterr().err
        assert code == 2 and err.startswith("error[arena-being-created]:") and "not removed" in err, err
        assert os.path.exists(path)
    finally:
        creator.finish().close()
    assert arena.drop_arena(path) and not os.path.exists(path)
    dead = shm_dir / "dead"
    dead.write_bytes(b"HICINIT\0" + bytes(64))
    os.chmod(dead, 0o600)
    assert arena.drop_arena(str(dead)) and not dead.exists()


def test_an_engine_that_would_create_waits_for_a_creator_without_holding_the_budget_lock(shm_dir, monkeypatch):
    """open_store with a size, beside a creator at work: it waits on the arena's creators' lock
    with the host-wide budget lock free (holding it, it would stall every pool bring-up of the
    host for the create's length), then attaches - claiming nothing, as an attach needs no room."""
    from machine import facts
    from test_store_arena import RecordingLock

    path = str(shm_dir / "kv")
    creator = HeldCreator(path)
    budget = RecordingLock()
    held_while_waiting: list = []

    def noted_sleep(seconds):
        held_while_waiting.append(budget.held)
        creator.go.wait(120)

    monkeypatch.setattr(f"{ARENA_ROOM}.CreatorsLock", functools.partial(CREATORS.CreatorsLock, sleep=noted_sleep))
    opened: list = []
    engine = threading.Thread(target=lambda: opened.append(open_store(
        path, size_bytes=ARENA_BYTES, slot_bytes=SLOT, lock=budget, machine=facts(available_bytes=ARENA_BYTES + 1))),
        name="engine", daemon=True)
    made = None
    try:
        engine.start()
        wait_until(lambda: held_while_waiting)  # the engine waits on the creators' lock (a hang guard inside)
        made = creator.finish()
        engine.join(120)
        assert opened and opened[0].arena.label == "agent" and not opened[0].arena.created
        # every turn of the wait (one, or many once the creator is told to finish) with the budget lock free
        assert held_while_waiting and not any(held_while_waiting) and budget.events == []  # nothing claimed
    finally:
        made = made or creator.finish()
        for held in opened + [made]:
            held.close()


def test_a_creator_that_gives_up_before_its_file_leaves_the_engine_to_create_with_a_claim(shm_dir, monkeypatch):
    """A creator holds the arena's lock but has made no file yet (the moment between the two):
    an engine given a size waits for it with the budget lock free - it took the budget lock
    first, and waited under it - and once that creator gives up, creates the arena itself under
    the budget lock with a node claim."""
    from machine import facts
    from test_store_arena import RecordingLock

    path = str(shm_dir / "kv")
    other = CREATORS.CreatorsLock(path, timeout_s=60)  # another creator, before its file
    released = threading.Event()
    budget = RecordingLock()
    held_while_waiting: list = []

    def noted_sleep(seconds):
        held_while_waiting.append(budget.held)
        released.wait(120)

    monkeypatch.setattr(f"{ARENA_ROOM}.CreatorsLock", functools.partial(CREATORS.CreatorsLock, sleep=noted_sleep))
    opened: list = []
    engine = threading.Thread(target=lambda: opened.append(open_store(
        path, size_bytes=ARENA_BYTES, slot_bytes=SLOT, lock=budget, machine=facts(available_bytes=ARENA_BYTES + 1))),
        name="engine", daemon=True)
    try:
        engine.start()
        wait_until(lambda: held_while_waiting)  # the engine waits on the creators' lock (a hang guard inside)
    finally:
        other.close()  # that creator gives up
        released.set()
        engine.join(120)
    try:
        assert opened and opened[0].arena.created and held_while_waiting and not any(held_while_waiting)
        assert [e for e in budget.events if e not in ("enter", "exit")] == ["record", "forget"]
    finally:
        for held in opened:
            held.close()


def test_a_dead_creators_file_replaced_by_an_engine_is_claimed_like_any_new_arena(shm_dir):
    """An unfinished file whose creator died, found by an engine given a size: the engine
    replaces it under the budget lock with a node claim, recorded and given back as for any new
    arena (it was replaced without one: the leftover read as an arena to attach)."""
    from machine import facts
    from test_store_arena import RecordingLock

    path = shm_dir / "kv"
    path.write_bytes(b"HICINIT\0" + bytes(64))
    os.chmod(path, 0o600)
    budget = RecordingLock()
    store = open_store(str(path), size_bytes=ARENA_BYTES, slot_bytes=SLOT, lock=budget,
                       machine=facts(available_bytes=ARENA_BYTES + 1))
    try:
        assert store.arena.created
        assert [e for e in budget.events if e not in ("enter", "exit")] == ["record", "forget"]
    finally:
        store.close()


def test_a_creator_that_finishes_between_the_two_looks_is_attached_not_called_dead(shm_dir, monkeypatch):
    """The attach saw the arena unfinished, then the creator finished and let its lock go before
    the probe: the lock is free but the arena is whole - attached, not refused as a dead
    creator's (the probe is made to finish the creator first)."""
    path = str(shm_dir / "kv")
    creator = HeldCreator(path)
    finished: list = []

    def finishing_probe(arena_path, *, directory=None):
        finished.append(creator.finish())
        return CREATORS.creator_at_work(arena_path, directory=directory)

    monkeypatch.setattr(f"{ARENA_ROOM}.creator_at_work", finishing_probe)
    attached = arena.attach_arena(path)
    try:
        assert attached.label == "agent" and finished
    finally:
        attached.close()
        finished[0].close()


@pytest.mark.parametrize("mark", [b"HICINIT\0", b""], ids=["marked", "empty"])
def test_an_arena_whose_creator_died_is_refused_at_once_even_by_a_waiting_engine(shm_dir, mark):
    """A file left marked (or empty) with its creators' lock free - its creator died - is refused
    at once by an engine that would wait, saying what makes it afresh; create then replaces it."""
    path = shm_dir / "kv"
    path.write_bytes(mark + bytes(64 if mark else 0))
    os.chmod(path, 0o600)
    with pytest.raises(ArenaError, match="its creator died before writing it; `hicache store create"):
        open_store(str(path), size_bytes=None, slot_bytes=SLOT)
    with pytest.raises(ArenaError, match="its creator died"):
        arena.attach_arena(str(path))
    fresh = arena.create_arena(str(path), plan_store(ARENA_BYTES, slot_bytes=SLOT), label="again")
    try:
        assert fresh.created
    finally:
        fresh.close()


def test_the_creator_probe_takes_no_lock_it_finds_free_and_names_a_holder(shm_dir, tmp_path):
    """creator_at_work: None with no lock file or a free one (and leaves it free: a creator then
    takes it without waiting), the holder's pid while a creator holds it."""
    CreatorsLock, creator_at_work = CREATORS.CreatorsLock, CREATORS.creator_at_work
    path = str(shm_dir / "kv")
    assert creator_at_work(path, directory=tmp_path) is None
    lock = CreatorsLock(path, timeout_s=60, directory=tmp_path)
    try:
        assert creator_at_work(path, directory=tmp_path) == str(os.getpid())
    finally:
        lock.close()
    assert creator_at_work(path, directory=tmp_path) is None
    CreatorsLock(path, timeout_s=0, directory=tmp_path).close()  # free after the probe: taken at once


def _descriptors_of(path: str) -> int:
    """How many of this process's open files are ``path``, unlinked since or not."""
    count = 0
    for name in os.listdir("/proc/self/fd"):
        try:
            count += os.readlink(f"/proc/self/fd/{name}") in (path, f"{path} (deleted)")
        except OSError:  # closed meanwhile (the listing's own descriptor among them)
            pass
    return count


def test_the_creators_lock_is_a_0600_file_and_a_symlink_or_an_open_directory_is_refused(shm_dir, tmp_path):
    """The lock file is made 0600; a symlink at its path is never followed, by the lock or the
    probe (an ArenaError naming the lock; the link's target untouched); a lock directory open to
    others is refused by both, naming it."""
    CreatorsLock, creator_at_work = CREATORS.CreatorsLock, CREATORS.creator_at_work
    path = str(shm_dir / "kv")
    lock = CreatorsLock(path, timeout_s=0, directory=tmp_path)
    try:
        assert os.stat(lock.path).st_mode & 0o777 == 0o600
    finally:
        lock.close()
    target = tmp_path / "elsewhere"
    target.write_text("untouched")
    linked = str(shm_dir / "linked")
    os.symlink(target, CREATORS._lock_path(linked, tmp_path))
    with pytest.raises(ArenaError, match=r"linked: cannot open its creators' lock .*arena-"):
        CreatorsLock(linked, timeout_s=0, directory=tmp_path)
    with pytest.raises(ArenaError, match=r"linked: cannot open its creators' lock"):
        creator_at_work(linked, directory=tmp_path)
    assert target.read_text() == "untouched"
    exposed = tmp_path / "exposed"
    exposed.mkdir()
    exposed.chmod(0o755)
    for call in (lambda: CreatorsLock(path, timeout_s=0, directory=exposed),
                 lambda: creator_at_work(path, directory=exposed)):
        with pytest.raises(ArenaError, match=rf"kv: no private directory for the creators' lock .*{exposed}"):
            call()


def test_a_waiter_gives_up_only_past_its_deadline_and_neither_it_nor_a_probe_keeps_a_descriptor(shm_dir, tmp_path):
    """The deadline is inclusive (an injected clock: still trying when it reads exactly the
    deadline, gone the tick after); a waiter that gives up and a probe that finds the lock held
    each close their own open file of the lock, leaving only the holder's."""
    CreatorsLock, creator_at_work = CREATORS.CreatorsLock, CREATORS.creator_at_work
    path = str(shm_dir / "kv")
    held = CreatorsLock(path, timeout_s=0, directory=tmp_path)
    try:
        assert _descriptors_of(held.path) == 1
        ticks, slept = iter([0.0, 5.0, 6.0]), []
        with pytest.raises(ArenaBeingCreatedError):
            CreatorsLock(path, timeout_s=5, directory=tmp_path, clock=lambda: next(ticks), sleep=slept.append)
        assert slept == [0.01]  # one more try at the deadline itself, none past it
        assert _descriptors_of(held.path) == 1
        assert creator_at_work(path, directory=tmp_path) == str(os.getpid())
        assert _descriptors_of(held.path) == 1
    finally:
        held.close()
    assert _descriptors_of(held.path) == 0


def test_a_new_holder_names_only_itself_after_a_holder_with_a_longer_pid(shm_dir, tmp_path):
    """The holder's pid replaces what the lock file held: after a holder whose pid had more
    digits (the highest Linux gives, 4194304), a probe names exactly this one, no tail of the
    last."""
    CreatorsLock, creator_at_work = CREATORS.CreatorsLock, CREATORS.creator_at_work
    path = str(shm_dir / "kv")
    lock_path = CREATORS._lock_path(path, tmp_path)
    with open(lock_path, "w") as earlier:
        earlier.write("4194304\n")
    os.chmod(lock_path, 0o600)
    lock = CreatorsLock(path, timeout_s=0, directory=tmp_path)
    try:
        assert creator_at_work(path, directory=tmp_path) == str(os.getpid())
        with open(lock_path) as file:
            assert file.read() == f"{os.getpid()}\n"
    finally:
        lock.close()


def test_the_creators_lock_of_a_path_has_one_name_across_versions(tmp_path, monkeypatch):
    """Every hicache on a node must take the same lock for one arena path (else two versions'
    creators would not exclude each other): its file is named from the first 24 hex digits of
    the SHA-256 of the absolute path, so a relative path and its absolute one share it."""
    import hashlib

    expected = f"arena-{hashlib.sha256(b'/dev/shm/hicache-kv').hexdigest()[:24]}.lock"
    assert CREATORS._lock_path("/dev/shm/hicache-kv", tmp_path) == str(tmp_path / expected)
    monkeypatch.chdir("/dev/shm")
    assert CREATORS._lock_path("hicache-kv", tmp_path) == str(tmp_path / expected)
