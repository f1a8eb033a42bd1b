"""The trace file is as safe as `--out` (issue #33 item 1): `hicache apply --trace` refuses a
device, a FIFO, a symlink, a directory or a path in a missing or read-only directory - one
`error[bad-output]` line, exit 2, before any memory is taken - and the thing at the path stays
as it was; in the library (`bring_up(trace=)`, HICACHE_TRACE) the same paths are a warning and
the bring-up goes on; a write that fails (a full tmpfs) or whose target turned into a symlink
meanwhile leaves no temp file and replaces nothing; traces of two processes merge into one
timeline in the order of the fake driver's shared call log."""

from __future__ import annotations

import json
import logging
import os
import stat
import subprocess
import sys

import pytest
from machine import ROOMY

from hicache.cli import main
from hicache.effects import trace
from hicache.errors import TraceOutputError
from hicache.effects import HostSetup

torch = pytest.importorskip("torch")

APPLY = ["apply", "--fake-cuda", "--model", "llama-3.1-8b", "--tp", "8", "--host-gb", "0.02", "--chunk-limit", "4MiB",
         "--threads", "1"]


def _char_device(directory):
    """A character device node (1, 7: what /dev/full is) in a temp dir - never the host's own."""
    path = directory / "full"
    try:
        os.mknod(path, 0o600 | stat.S_IFCHR, os.makedev(1, 7))
    except PermissionError:
        pytest.skip("making a device node needs CAP_MKNOD (root); the FIFO case covers the same refusal")
    return path


def _targets(tmp_path):
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    real = tmp_path / "real.json"
    real.write_text("{}")
    link = tmp_path / "link.json"
    link.symlink_to(real)
    directory = tmp_path / "dir"
    directory.mkdir()
    return {"fifo": (fifo, "a FIFO"), "symlink": (link, "symbolic link"), "directory": (directory, "a directory"),
            "missing dir": (tmp_path / "no" / "t.json", "does not exist"), "proc": ("/proc/hicache-x", "not writable")}


@pytest.mark.parametrize("case", ["device", "fifo", "symlink", "directory", "missing dir", "proc"])
def test_apply_refuses_a_trace_path_that_is_no_regular_file_before_any_memory(capsys, tmp_path, case):
    """One error line naming the path and why, exit 2, no bring-up started (no progress, no
    registration), and the node at the path is what it was."""
    if case == "device":
        path, why = _char_device(tmp_path), "a character device"
    else:
        path, why = _targets(tmp_path)[case]
    before = os.lstat(path) if os.path.lexists(path) else None
    code = main([*APPLY, "--trace", str(path)])
    err = capsys.readouterr().err
    assert code == 2 and err.startswith("error[bad-output]:") and why in err and "pre-faulted" not in err
    if before is not None:
        after = os.lstat(path)
        assert (stat.S_IFMT(after.st_mode), after.st_ino) == (stat.S_IFMT(before.st_mode), before.st_ino)
    assert not [p for p in tmp_path.rglob("*.tmp")]


def test_a_librarys_bring_up_with_a_bad_trace_path_warns_and_goes_on(tmp_path, caplog):
    """bring_up(trace=FIFO): a warning naming it, the pool comes up and is released, the FIFO
    is still a FIFO."""
    from hicache.effects import BufferRequest, bring_up
    from hicache.effects import Report
    from hicache.plan import Limits, plan_registration
    from hicache.testing import fake_cuda

    fifo = _targets(tmp_path)["fifo"][0]
    plan = plan_registration(4 << 20, granularity_bytes=1 << 20, limits=Limits(chunk_limit_bytes=2 << 20))
    with caplog.at_level(logging.WARNING, logger="hicache.trace"), fake_cuda() as fake:
        handle = bring_up([BufferRequest("kv", (4 << 20,), None, plan)], budget=False, report=Report(trace=str(fifo)))
        assert fake.held()
        handle.release()
    assert any("not tracing" in r.getMessage() and "a FIFO" in r.getMessage() for r in caplog.records)
    assert stat.S_ISFIFO(os.lstat(fifo).st_mode)


def test_a_bad_hicache_trace_never_fails_a_pool_constructor(tmp_path, fork_server):
    """HICACHE_TRACE naming a directory: hicache's pool still builds and round-trips in a process
    of its own (it failed every constructor before), with the warning on stderr."""
    code = (
        "from hicache.effects import HostSetup\n"
        "from hicache.pools import MHATokenToKVPoolHost\n"
        "from hicache.testing import MHADevicePool, fake_cuda\n"
        "with fake_cuda():\n"
        "    device = MHADevicePool(size=64, layer_num=2, head_num=2, head_dim=64, page_size=16)\n"
        "    pool = MHATokenToKVPoolHost(device, 2.0, 0, 16, 'page_first_direct', True, 'cpu',\n"
        "                                host=HostSetup(host_memory_bytes=10**12))\n"
        "    pool.destroy()\n"
        "print('built')\n"
    )
    env = {**os.environ, "HICACHE_TRACE": str(tmp_path)}
    result = fork_server.run([sys.executable, "-c", code], env=env, timeout=300)  # tests/forked.py
    assert result.returncode == 0 and result.stdout.strip() == "built", result.stderr[-2000:]
    assert "not tracing" in result.stderr and "a directory" in result.stderr


def test_a_target_turned_into_a_symlink_before_the_write_is_not_replaced(tmp_path, caplog):
    """Checked at the start, then the path became a symlink: the write refuses it at the rename
    (a warning), the link and what it points to are intact, no temp file is left."""
    path = tmp_path / "t.json"
    with caplog.at_level(logging.WARNING, logger="hicache.trace"):
        with trace.tracing(str(path)):
            with trace.span("work", "phase"):
                pass
            victim = tmp_path / "victim"
            victim.write_text("keep")
            path.symlink_to(victim)
    assert path.is_symlink() and victim.read_text() == "keep"
    assert any("was not written" in r.getMessage() for r in caplog.records)
    assert not list(tmp_path.glob(".*.tmp"))


def test_a_full_filesystem_leaves_no_temp_file_and_the_bring_up_intact(tmp_path, caplog):
    """A tmpfs of 64 KiB (mounted for the test; root only): a trace bigger than it fails to
    write - a warning, no temp file, the work inside the block unaffected."""
    mount = tmp_path / "small"
    mount.mkdir()
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=64k", "tmpfs", str(mount)], capture_output=True)
    if done.returncode != 0:
        pytest.skip("mounting a small tmpfs needs root; the symlink case covers a failed write's clean-up")
    try:
        with caplog.at_level(logging.WARNING, logger="hicache.trace"):
            with trace.tracing(str(mount / "t.json")):
                for i in range(3000):
                    with trace.span(f"piece {i}", "pre-fault", size=4096):
                        pass
        assert any("was not written" in r.getMessage() for r in caplog.records)
        assert os.listdir(mount) == []
    finally:
        subprocess.run(["umount", str(mount)], check=True)


def test_check_path_accepts_a_regular_file_or_a_new_one():
    """The other side of the rule: what may be written passes, as an absolute path."""
    import tempfile

    with tempfile.TemporaryDirectory() as directory:
        new = os.path.join(directory, "new.json")
        assert trace.check_path(new) == new
        open(new, "w").close()
        assert trace.check_path(new) == new
        with pytest.raises(TraceOutputError, match="an empty path"):
            trace.check_path(" ")


@pytest.mark.concurrency
def test_two_processes_traces_merge_in_the_drivers_order(tmp_path, capsys, fork_server):
    """Two processes bring pools up through one fake driver lock (its shared log records every
    call's start on the host clock); `hicache trace merge` of their traces lists their register
    calls in the log's order, each under its process."""
    log = tmp_path / "calls.jsonl"
    code = (
        "import sys\n"
        "from hicache.effects import BufferRequest, HostSetup, Report, bring_up\n"
        "from hicache.plan import Limits, plan_registration\n"
        "from hicache.testing import FakeRuntime, FakeCudart\n"
        f"runtime = FakeRuntime(FakeCudart(register_bytes_per_s=2e9, driver_lock={str(tmp_path / 'driver')!r},"
        f" shared_log={str(log)!r}))\n"
        "plan = plan_registration(16 << 20, granularity_bytes=1 << 20, limits=Limits(chunk_limit_bytes=2 << 20))\n"
        "bring_up([BufferRequest('kv', (16 << 20,), None, plan)], budget=False, host=HostSetup(runtime=runtime),\n"
        "         report=Report(trace=sys.argv[1])).release()\n"
    )
    paths = [tmp_path / f"rank{i}.json" for i in range(2)]
    children = [fork_server.spawn([sys.executable, "-c", code, str(p)]) for p in paths]  # tests/forked.py
    assert [c.wait(timeout=300) for c in children] == [0, 0], [c.communicate() for c in children]
    out = tmp_path / "node.json"
    assert main(["trace", "merge", "--out", str(out), *map(str, paths)]) == 0
    merged = json.loads(out.read_text())
    calls = [e for e in merged["traceEvents"] if e["name"] == "cudaHostRegister"]
    logged = [json.loads(line) for line in log.read_text().splitlines()]
    logged = sorted((e for e in logged if "op" not in e), key=lambda e: e["start"])
    assert len(calls) == len(logged) == 16
    assert [(e["pid"], e["args"]["ptr"]) for e in calls] == [(e["pid"], e["ptr"]) for e in logged]
    assert {e["pid"] for e in calls} == {c.pid for c in children}
    assert "2 process(es)" in capsys.readouterr().err


def test_merge_refuses_what_is_no_hicache_trace(tmp_path, capsys):
    """trace merge refuses a file that is no hicache trace (exit 2) and writes no output."""
    other = tmp_path / "other.json"
    other.write_text(json.dumps({"traceEvents": []}))
    code = main(["trace", "merge", "--out", str(tmp_path / "m.json"), str(other)])
    assert code == 2 and "not a hicache trace" in capsys.readouterr().err
    assert not (tmp_path / "m.json").exists()


@pytest.mark.concurrency
def test_merge_refuses_a_fifo_or_a_device_input_at_once(tmp_path, capsys):
    """A FIFO with no writer (it hung `trace merge` for ever, issue #54) or /dev/zero as an
    input: one error line naming it, exit 2, no output written - well inside a hang guard (the
    merge runs on a thread that must finish in 30 s)."""
    import threading

    fifo = tmp_path / "rank0.json"
    os.mkfifo(fifo)
    for source in (str(fifo), "/dev/zero"):
        result = {}
        worker = threading.Thread(target=lambda: result.update(code=main(
            ["trace", "merge", "--out", str(tmp_path / "m.json"), source])), daemon=True)
        worker.start()
        worker.join(30)
        if worker.is_alive():  # the hang itself: free the thread (a writer end opens the FIFO) and fail
            with open(fifo, "w"):
                pass
            pytest.fail(f"trace merge of {source} still running after 30 s")
        assert result["code"] == 2, source
        assert f"trace {source} is not a regular file" in capsys.readouterr().err
        assert not (tmp_path / "m.json").exists()


def test_a_trace_records_its_clock_and_origin(tmp_path):
    """The metadata a merge relies on: the host's monotonic clock, the wall-clock time of its
    origin, host and pid."""
    path = tmp_path / "t.json"
    with trace.tracing(str(path)):
        with trace.span("x", "phase"):
            pass
    other = json.loads(path.read_text())["otherData"]
    assert other["clock"] == "CLOCK_MONOTONIC" and other["pid"] == os.getpid() and other["origin_wall_s"] > 1e9


def test_roomy_machine_fixture_is_the_one_tests_inject():
    """(The apply cases above never reach the machine: they fail on the path first.)"""
    assert ROOMY.available_bytes > 0
