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
    """store drop unlinks the arena; a second drop is error[no-arena], exit 1."""
    path = str(shm_dir / "kv")
    run(capsys, "store", "create", path, "--size-gb", "0.01", "--slot-bytes", "4096")
    assert run(capsys, "store", "drop", path)[0] == 0 and not os.path.exists(path)
    code, _, err = run(capsys, "store", "drop", path)
    assert code == 1 and err.startswith("error[no-arena]:")


@pytest.mark.parametrize("argv, ref, code", [
    (["--size-gb", "100000", "--slot-bytes", "4096"], "arena", 2),
    (["--size-gb", "-1", "--slot-bytes", "4096"], "bad-size", 2),
    (["--size-gb", "0.01", "--slot-bytes", "12"], "infeasible-plan", 1),
    (["--size-gb", "0.01", "--slot-bytes", "lots"], "bad-number", 2),
])
def test_bad_create_input_is_one_error_and_nothing_is_left(capsys, shm_dir, argv, ref, code):
    """A size beyond the free tmpfs, a negative size, slots not in 8-byte words, a word for a
    number: its own error ref and exit code, and the directory stays empty."""
    got, out, err = run(capsys, "store", "create", str(shm_dir / "kv"), *argv)
    assert (got, out) == (code, "") and err.startswith(f"error[{ref}]:") and "\nhint: " in err
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


def test_an_arena_beyond_the_nodes_memory_is_refused_by_the_budget(capsys, shm_dir, monkeypatch):
    """Room on tmpfs but not in memory (the machine's facts injected): the budget refuses it,
    exit 1, nothing created."""
    from machine import facts

    import hicache.effects as effects

    monkeypatch.setattr(effects, "probe_machine", lambda **_: facts(available_bytes=5_000_000))
    code, _, err = run(capsys, "store", "create", str(shm_dir / "kv"), "--size-gb", "0.01", "--slot-bytes", "4096")
    assert code == 1 and err.startswith("error[budget-refused]:") and os.listdir(shm_dir) == []
