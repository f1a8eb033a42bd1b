"""`hicache store create|status|drop`, `hicache plan --store-gb` and `hicache doctor --store`
over real tmpfs arenas: create pre-faults with progress on stderr and the table on stdout;
status reports what engines stored (pages, namespaces, counters) and changes no byte; drop
unlinks; every mistake is one error line with its ref and exit code, nothing left behind."""

from __future__ import annotations

import hashlib
import json
import os

import pytest
from store_support import shm_dir  # noqa: F401 - a fixture

from hicache.cli import main
from hicache.plan import plan_store
from hicache.store import Namespace, open_store

torch = pytest.importorskip("torch")


def run(capsys, *argv):
    code = main(list(argv))
    out = capsys.readouterr()
    return code, out.out, out.err


def _digest(path) -> str:
    with open(path, "rb") as handle:
        return hashlib.sha256(handle.read()).hexdigest()


def test_create_prefaults_with_progress_and_prints_the_geometry(capsys, shm_dir):
    """store create pre-faults with a progress line to 100 % and prints the arena's geometry, label
    and backing."""
    path = str(shm_dir / "kv")
    code, out, err = run(capsys, "store", "create", path, "--size-gb", "0.02", "--slot-bytes", "8192",
                         "--label", "node-a")
    plan = plan_store(20_000_000, slot_bytes=8192)
    assert code == 0
    assert "pre-faulted" in err and "(100 %)" in err and f"created {path}" in err
    assert f"{plan.slots:,} slots of 8,192 bytes" in out and "(node-a)" in out and "tmpfs" in out
    assert os.stat(path).st_mode & 0o777 == 0o600


def test_status_shows_what_engines_stored_and_changes_no_byte(capsys, shm_dir):
    """Pages, bytes, the namespace's description with its page count, the counters - and the
    arena's bytes are the same before and after."""
    path = str(shm_dir / "kv")
    ns = Namespace(model="org/model", dtype="torch.bfloat16", page_tokens=64, layout="page_first/segments",
                   pool="kv", page_bytes=8192, shard=(("tp", 1, 8),))
    store = open_store(path, size_bytes=20_000_000, slot_bytes=8192)
    data = torch.arange(3 * 8192, dtype=torch.int32).to(torch.uint8)
    store.put(ns, ["a", "b", "c"], [[(data.data_ptr() + i * 8192, 8192)] for i in range(3)])
    store.get(ns, ["a", "zz"], [[(data.data_ptr(), 8192)], [(data.data_ptr() + 8192, 8192)]])
    store.close()
    before = _digest(path)
    code, out, _ = run(capsys, "store", "status", path, "--format", "json")
    status = json.loads(out)
    assert code == 0 and _digest(path) == before
    assert (status["pages"], status["bytes"], status["slots_used"]) == (3, 3 * 8192, 3)
    assert {k: status["counters"][k] for k in ("hits", "misses", "writes")} == {"hits": 1, "misses": 1, "writes": 3}
    assert status["namespaces"] == [{"entry": 0, "pages": 3, "description": ns.description}]
    assert "tp 1/8" in ns.description
    code, out, _ = run(capsys, "store", "status", path)
    assert code == 0 and "3 pages" in out and "50.0 % hit" in out and ns.description in out


def test_drop_unlinks_and_a_second_drop_says_there_is_none(capsys, shm_dir):
    """store drop unlinks the arena; a second drop is error[arena], exit 2 - as status says of a
    missing arena."""
    path = str(shm_dir / "kv")
    run(capsys, "store", "create", path, "--size-gb", "0.01", "--slot-bytes", "4096")
    assert run(capsys, "store", "drop", path)[0] == 0 and not os.path.exists(path)
    code, _, err = run(capsys, "store", "drop", path)
    assert code == 2 and err.startswith(f"error[arena]: store arena {path}: does not exist")


@pytest.mark.parametrize("argv, ref, code", [
    (["--size-gb", "100000", "--slot-bytes", "4096"], "arena", 2),
    (["--size-gb", "-1", "--slot-bytes", "4096"], "bad-size", 2),
    (["--size-gb", "0.01", "--slot-bytes", "12"], "bad-store-plan", 2),
    (["--size-gb", "0.000001", "--slot-bytes", "4096"], "bad-store-plan", 2),
    (["--size-gb", "0.01", "--slot-bytes", "lots"], "bad-number", 2),
    (["--size-gb", "0.01", "--slot-bytes", "4096", "--label", "x" * 65], "bad-value", 2),
    (["--size-gb", "0.01", "--slot-bytes", "4096", "--label", "a\tb"], "bad-value", 2),
])
def test_bad_create_input_is_one_error_and_nothing_is_left(capsys, shm_dir, argv, ref, code):
    """A size beyond the free tmpfs, a negative size, slots not in 8-byte words, an arena too
    small for its slots, a word for a number, a label the header cannot hold (too long, or not one
    printable line): its own error ref and exit code, a hint about the flag at fault (a
    registration plan's --chunk-limit once, the slot's for a label), and the directory stays empty."""
    got, out, err = run(capsys, "store", "create", str(shm_dir / "kv"), *argv)
    assert (got, out) == (code, "") and err.startswith(f"error[{ref}]:") and "\nhint: " in err
    assert "--chunk-limit" not in err and ("--slot-bytes" in err.split("hint: ", 1)[1] or ref != "bad-store-plan")
    assert ("--label" in err) == ("--label" in argv)
    assert os.listdir(shm_dir) == []


def test_create_over_an_arena_of_another_geometry_is_refused(capsys, shm_dir):
    """store create over an arena of another slot size is error[arena-geometry] naming the slot
    bytes."""
    path = str(shm_dir / "kv")
    run(capsys, "store", "create", path, "--size-gb", "0.01", "--slot-bytes", "4096")
    code, _, err = run(capsys, "store", "create", path, "--size-gb", "0.01", "--slot-bytes", "8192")
    assert code == 1 and err.startswith("error[arena-geometry]:") and "slots hold 4096 bytes" in err


def test_status_of_a_file_open_to_others_is_refused(capsys, shm_dir):
    """store status of an arena file open to group/others is refused naming its mode."""
    path = str(shm_dir / "kv")
    run(capsys, "store", "create", path, "--size-gb", "0.01", "--slot-bytes", "4096")
    os.chmod(path, 0o644)
    code, _, err = run(capsys, "store", "status", path)
    assert code == 2 and "mode 0644 is open to group/others" in err


def test_plan_sizes_a_store_for_the_plans_kv_page(capsys):
    """`hicache plan --store-gb`: the JSON's ``store`` is plan_store of the KV page on one rank;
    the table names the create command; --store-slot-bytes alone is a usage error."""
    code, out, _ = run(capsys, "plan", "--model", "llama-3.1-70b", "--tp", "8", "--format", "json", "--store-gb", "10")
    data = json.loads(out)
    page = data["size"]["size_per_token_bytes"] * data["size"]["page_size"]  # 40 KiB a token x 64 at TP 8
    assert code == 0 and data["store"] == plan_store(10 * 10**9, slot_bytes=page).to_jsonable()
    code, out, _ = run(capsys, "plan", "--model", "llama-3.1-70b", "--tp", "8", "--store-gb", "10")
    assert code == 0 and "hicache store create PATH --size-gb 10 --slot-bytes" in out
    code, _, err = run(capsys, "plan", "--store-slot-bytes", "4096")
    assert code == 2 and err.startswith("error[missing-flag]:")


@pytest.mark.parametrize("model, token_pools, state_pools", [
    ("deepseek-v3.2", ["kv", "indexer"], []),  # DSA: the KV and index keys, a slot each a page
    ("mimo-v2-flash", ["full", "swa"], []),  # a sliding-window hybrid: full and window KV
    ("qwen3-next-80b-a3b", ["kv"], ["mamba"]),  # Mamba2 states: one request's a page, the largest
])
def test_plan_sizes_a_multi_pool_store_by_its_largest_page_and_counts_a_page_of_tokens_in_each_pool(
        capsys, model, token_pools, state_pools):
    """A slot holds one pool's page, as the engine stores them: `hicache plan --store-gb` makes the
    slot the largest page (the sum of the pools' pages was too big for each, and short of a Mamba
    state's page, which the engine's attach then refused), counts a page of tokens as a slot in
    each token pool, and refuses a given slot below the largest page, naming it. Each pool's page
    is read here from its buffers: their bytes over their pages (a state pool's slots)."""
    code, out, _ = run(capsys, "plan", "--model", model, "--format", "json", "--store-gb", "64")
    data = json.loads(out)
    pages = {}
    for pool in data["pools"]:
        params = pool["plan"]["params"]
        pages[pool["name"]] = sum(b["nbytes"] for b in pool["plan"]["buffers"]) // params.get("page_num", params.get("slots"))
    largest = max(pages.values())
    assert code == 0 and data["store"] == plan_store(64 * 10**9, slot_bytes=-(-largest // 8) * 8).to_jsonable()
    stored = data["store_pages"]
    assert {p["pool"]: (p["page_bytes"], p["per_request"]) for p in stored["pools"]} == {
        name: (size, name in state_pools) for name, size in pages.items()}
    assert set(pages) == {*token_pools, *state_pools}
    assert stored["slots_per_token_page"] == len(token_pools)
    assert stored["token_pages"] == data["store"]["slots"] // len(token_pools)
    assert stored["tokens"] == stored["token_pages"] * data["size"]["page_size"]
    code, out, _ = run(capsys, "plan", "--model", model, "--store-gb", "64")
    assert code == 0 and f"a page of 64 tokens in {len(token_pools)} ({', '.join(token_pools)})" in out
    code, _, err = run(capsys, "plan", "--model", model, "--store-gb", "64", "--store-slot-bytes", str(largest - 8))
    name = max(pages, key=pages.get)
    assert code == 2 and f"below this plan's largest page: {name}'s {largest:,} bytes" in err


def test_doctor_checks_an_arena_and_warns_on_torn_slots(capsys, shm_dir):
    """doctor --store warns on torn slots, reports the room on /dev/shm, and fails a missing
    arena."""
    path = str(shm_dir / "kv")
    store = open_store(path, size_bytes=10_000_000, slot_bytes=4096)
    addr = store.arena.record_addr(0)
    store.arena.ops.store(addr, 1)  # a writer that died after claiming slot 0
    store.close()
    code, out, _ = run(capsys, "doctor", "--store", path, "--format", "json")
    checks = {c["name"]: c for c in json.loads(out)["checks"]}
    assert checks["store"]["status"] == "warn" and "1 torn" in checks["store"]["finding"]
    assert checks["store_room"]["status"] in ("pass", "warn") and "/dev/shm (tmpfs)" in checks["store_room"]["finding"]
    code, out, _ = run(capsys, "doctor", "--store", str(shm_dir / "missing"), "--format", "json")
    checks = {c["name"]: c for c in json.loads(out)["checks"]}
    assert code == 1 and checks["store"]["status"] == "fail" and "does not exist" in checks["store"]["finding"]


@pytest.mark.parametrize("built", [True, False], ids=["helper", "fallback"])
def test_doctor_says_what_the_stores_slot_operations_run_through(capsys, shm_dir, monkeypatch, built):
    """doctor's `store` check names the node store's slot operations: the C helper (pass), or -
    where it was not built - the slower Python fallback (warn, naming the reinstall), with and
    without an arena given; a torn arena's hint keeps its own advice beside it."""
    from hicache.effects import arena

    if built:
        try:
            arena.slot_ops("native")
        except ImportError:
            pytest.skip("the C helper is not built here (no compiler): the fallback case runs")
    else:
        monkeypatch.setattr("hicache.effects._arena._slots._native", None)
    path = str(shm_dir / "kv")
    store = open_store(path, size_bytes=10_000_000, slot_bytes=4096)
    store.close()
    for argv in ((), ("--store", path)):
        code, out, _ = run(capsys, "doctor", *argv, "--format", "json")
        check = {c["name"]: c for c in json.loads(out)["checks"]}["store"]
        if built:
            assert check["status"] == "pass" and "slot operations: the C helper" in check["finding"], argv
            assert check["hint"] == "", argv
        else:
            assert check["status"] == "warn" and "slot operations: the Python fallback" in check["finding"], argv
            assert "C compiler (gcc/cc)" in check["hint"], argv
    held = open_store(path, size_bytes=None, slot_bytes=4096)
    held.arena.ops.store(held.arena.record_addr(0), 1)  # a writer that died after claiming slot 0
    held.close()
    code, out, _ = run(capsys, "doctor", "--store", path, "--format", "json")
    check = {c["name"]: c for c in json.loads(out)["checks"]}["store"]
    assert check["status"] == "warn" and "1 torn" in check["finding"] and "attach reclaims them" in check["hint"]
    assert ("C compiler" in check["hint"]) is not built


def test_an_arena_beyond_the_nodes_memory_is_refused_by_the_budget(capsys, shm_dir, monkeypatch):
    """Room on tmpfs but not in memory (the machine's facts injected): the budget refuses it,
    exit 1, nothing created."""
    from machine import facts

    import hicache.effects as effects

    monkeypatch.setattr(effects, "probe_machine", lambda **_: facts(available_bytes=5_000_000))
    code, _, err = run(capsys, "store", "create", str(shm_dir / "kv"), "--size-gb", "0.01", "--slot-bytes", "4096")
    assert code == 1 and err.startswith("error[budget-refused]:") and os.listdir(shm_dir) == []


def _not_a_file(kind: str, path):
    """Make ``kind`` at ``path``: a FIFO, a listening Unix socket, a symlink to an arena or a
    directory. Returns what must stay open until the test ends (the socket), else None."""
    import socket

    if kind == "fifo":
        os.mkfifo(path, 0o600)
    elif kind == "socket":
        listener = socket.socket(socket.AF_UNIX)
        listener.bind(str(path))
        return listener
    elif kind == "symlink":
        open_store(str(path) + ".real", size_bytes=8 << 20, slot_bytes=8192).close()
        os.symlink(str(path) + ".real", path)
    elif kind == "directory":
        os.mkdir(path, 0o700)
    return None


@pytest.mark.parametrize("kind, said", [("fifo", "a FIFO"), ("socket", "a socket"), ("symlink", "a symbolic link"),
                                        ("directory", "a directory")])
@pytest.mark.parametrize("action", ["create", "status", "drop"])
def test_anything_but_a_regular_file_at_the_path_is_one_error_line_before_any_wait(capsys, shm_dir, kind, said,
                                                                                    action):
    """A FIFO (whose open would block for ever), a socket, a symlink or a directory at the arena
    path: create, status and drop each print one error[arena] line naming what is there, exit
    2, leave it as it was, and never open it (a FIFO's open would hang the test: pytest's hang
    guard and the child's timeout below would say so)."""
    import subprocess
    import sys

    path = shm_dir / "arena"
    keep = _not_a_file(kind, path)
    argv = ["store", action, str(path)] + (["--size-gb", "0.01", "--slot-bytes", "8192"] if action == "create" else [])
    try:
        done = subprocess.run([sys.executable, "-m", "hicache", *argv], capture_output=True, text=True, timeout=120)
    finally:
        if keep is not None:
            keep.close()
    lines = done.stderr.strip().split("\n")
    assert done.returncode == 2, done.stderr
    assert lines[0].startswith(f"error[arena]: store arena {path}: is {said}") and "Traceback" not in done.stderr
    assert len([line for line in lines if line.startswith("error")]) == 1
    assert os.path.lexists(path)


@pytest.mark.concurrency
def test_a_flock_on_the_shared_directory_does_not_stall_creation(capsys, shm_dir):
    """Another process holding `flock -x` on the arena's directory (what any user could do to
    /dev/shm): create is unaffected - the creators' lock is a file of this user's own."""
    import fcntl
    import subprocess
    import sys

    holder = subprocess.Popen([sys.executable, "-c", _holder_script(str(shm_dir))], stdout=subprocess.PIPE,
                              stdin=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "held"  # an event, not a sleep
        fd = os.open(shm_dir, os.O_RDONLY)
        try:
            with pytest.raises(BlockingIOError):  # the directory really is locked
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        finally:
            os.close(fd)
        code, out, err = run(capsys, "store", "create", str(shm_dir / "arena"), "--size-gb", "0.01", "--slot-bytes",
                             "8192")
        assert code == 0, err
        assert "created" in err
    finally:
        holder.stdin.close()
        holder.wait(60)
        holder.stdout.close()


def _holder_script(directory: str) -> str:
    """A child that flocks ``directory`` exclusively, says "held", and keeps it until stdin closes."""
    return ("import fcntl, os, sys\n"
            f"fd = os.open({directory!r}, os.O_RDONLY)\n"
            "fcntl.flock(fd, fcntl.LOCK_EX)\n"
            "print('held', flush=True)\n"
            "sys.stdin.read()\n")


def test_a_creator_that_holds_the_lock_too_long_is_named_and_the_wait_ends(shm_dir, tmp_path):
    """A waiter whose deadline passes (an injected clock) gives up with an ArenaBeingCreatedError
    naming the holder's pid and the lock file - it never waits for ever."""
    import fcntl

    from hicache.effects._arena._creators import CreatorsLock as _CreatorsLock
    from hicache.errors import ArenaBeingCreatedError

    lock_dir = tmp_path / "run"
    held = _CreatorsLock(str(shm_dir / "arena"), timeout_s=1, directory=lock_dir)
    ticks = iter(range(0, 1000))
    try:
        with pytest.raises(ArenaBeingCreatedError, match=rf"another creator \(pid {os.getpid()}\) held its lock .*arena-") \
                as caught:
            _CreatorsLock(str(shm_dir / "arena"), timeout_s=5, directory=lock_dir, clock=lambda: next(ticks),
                          sleep=lambda _: None)
        assert caught.value.creator == str(os.getpid())
    finally:
        held.close()
    again = _CreatorsLock(str(shm_dir / "arena"), timeout_s=5, directory=lock_dir)  # released: taken at once
    fcntl.flock(again.fd, fcntl.LOCK_UN)
    again.close()


def test_drop_removes_ones_own_arena_of_any_mode_as_status_says(capsys, shm_dir):
    """An arena of mode 0644: status refuses it (exit 2) with a hint that says to drop it, and
    drop does (exit 0); then drop and status both say there is none, in one error[arena] line,
    exit 2."""
    path = str(shm_dir / "arena")
    open_store(path, size_bytes=8 << 20, slot_bytes=8192).close()
    os.chmod(path, 0o644)
    code, _, err = run(capsys, "store", "status", path)
    assert code == 2 and "mode 0644" in err and "drop" in err
    code, _, err = run(capsys, "store", "drop", path)
    assert code == 0 and not os.path.lexists(path)
    for action in ("drop", "status"):
        code, _, err = run(capsys, "store", action, path)
        assert code == 2 and err.startswith(f"error[arena]: store arena {path}: does not exist"), action


def test_an_interrupted_create_says_no_arena_is_left_and_leaves_none(capsys, shm_dir, monkeypatch):
    """Ctrl-C while `store create` pre-faults: error[interrupted], exit 130, a hint about the
    arena (a store registers nothing: not apply's "nothing is left registered"), and no file."""
    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr("hicache.effects._arena._arena._prefault", interrupted)
    path = shm_dir / "kv"
    code, _, err = run(capsys, "store", "create", str(path), "--size-gb", "0.01", "--slot-bytes", "4096")
    assert code == 130 and err.startswith("error[interrupted]:"), err
    assert "hint: no unfinished arena is left behind" in err and "registered" not in err
    assert not path.exists()
