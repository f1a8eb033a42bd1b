"""The bring-up trace (`hicache apply --trace FILE`, HICACHE_TRACE=FILE): valid Chrome
trace-event JSON whose register-call spans are the fake driver's calls one for one (pointer and
size, in order), with phase, pre-fault and lock-wait spans, each on the thread that ran it, and
no two spans of one thread overlapping unless one holds the other."""

from __future__ import annotations

import json
import sys

import pytest
from machine import ROOMY

from hicache.effects import _trace

pytestmark = pytest.mark.concurrency  # processes, threads, signals or waits: `make test-loaded`

torch = pytest.importorskip("torch")


def _check_spans(events) -> None:
    by_thread: dict = {}
    for event in events:
        if event["ph"] == "X":
            assert event["dur"] >= 0 and isinstance(event["args"], dict)
            by_thread.setdefault(event["tid"], []).append((event["ts"], event["ts"] + event["dur"], event["name"]))
    for spans in by_thread.values():
        spans.sort(key=lambda s: (s[0], -s[1]))
        open_ends: list = []
        for start, end, name in spans:
            while open_ends and open_ends[-1][0] <= start + 0.002:
                open_ends.pop()
            if open_ends:  # inside the enclosing span, never across its end
                assert end <= open_ends[-1][0] + 0.002, (name, "crosses", open_ends[-1][1])
            open_ends.append((end, name))


@pytest.mark.parametrize("mode", ["blocking-pipelined", "progressive"])
def test_apply_trace_is_valid_and_its_register_spans_are_the_drivers_calls(tmp_path, capsys, mode):
    """apply --trace writes valid trace events whose register spans are the fake driver's calls, in
    order, with their rates."""
    from hicache.cli import _apply, make_parser
    from hicache.effects import HostLedger
    from hicache.testing import FakeCudaBinding, FakeRuntime

    path = tmp_path / "bring-up.json"
    argv = ["apply", "--model", "llama-3.1-8b", "--tp", "8", "--host-gb", "0.05", "--chunk-limit", "4MiB",
            "--threads", "2", "--trace", str(path)] + (["--progressive"] if mode == "progressive" else [])
    runtime = FakeRuntime()
    assert _apply.run(make_parser().parse_args(argv), runtime=runtime, machine=ROOMY, cuda_binding=FakeCudaBinding(),
                      ledger=HostLedger()) == 0
    _trace.stop()
    data = json.loads(path.read_text())
    events = data["traceEvents"]
    calls = [e for e in events if e["name"] == "cudaHostRegister"]
    logged = [(ptr, size) for op, ptr, size, *_ in (e for e in runtime.cudart.log if e[0] == "register")]
    assert [(e["args"]["ptr"], e["args"]["size"]) for e in sorted(calls, key=lambda e: e["ts"])] == logged
    assert all(e["args"]["GB/s"] > 0 for e in calls)
    names = {e["name"] for e in events}
    assert {"pre-fault", "budget lock wait", "release"} <= names
    assert any(e.get("cat") == "phase" for e in events if e["name"] != "release")
    threads = {e["tid"]: e["args"]["name"] for e in events if e["ph"] == "M"}
    assert any(name.startswith("hicache-prefault") or "ThreadPool" in name or name.startswith("hicache")
               for tid, name in threads.items() for e in events if e["name"] == "pre-fault" and e["tid"] == tid)
    _check_spans(events)


def test_hicache_trace_records_a_librarys_bring_ups(tmp_path, fork_server):
    """HICACHE_TRACE=FILE, a process that only calls the library: the file is there after the
    release, with the register calls."""
    path = tmp_path / "lib.json"
    code = (
        "from hicache.effects import BufferRequest, bring_up\n"
        "from hicache.plan import Limits, plan_registration\n"
        "from hicache.testing import fake_cuda\n"
        "plan = plan_registration(8 << 20, granularity_bytes=1 << 20, limits=Limits(chunk_limit_bytes=2 << 20))\n"
        "with fake_cuda():\n"
        "    bring_up([BufferRequest('kv', (8 << 20,), None, plan)], budget=False).release()\n"
    )
    result = fork_server.run([sys.executable, "-c", code], env={**__import__("os").environ, "HICACHE_TRACE": str(path)},
                             timeout=120)  # forked from a process that imported hicache without it: tests/forked.py
    assert result.returncode == 0, result.stderr
    events = json.loads(path.read_text())["traceEvents"]
    assert len([e for e in events if e["name"] == "cudaHostRegister"]) == 4
    _check_spans(events)


def test_a_span_whose_block_raised_is_in_the_trace_with_its_error(tmp_path):
    """A failed step is what a trace is read for: its span is kept, named by the error, and
    the error goes on to the caller unchanged (a diagnostic never fails the work it observes)."""
    from hicache.effects import _trace

    path = tmp_path / "trace.json"
    with _trace.tracing(str(path)):
        with pytest.raises(ValueError, match="the step failed"):
            with _trace.span("a step", "phase", size=4096):
                raise ValueError("the step failed")
        with _trace.span("the next step", "phase"):
            pass
    events = [e for e in json.loads(path.read_text())["traceEvents"] if e.get("cat") == "phase"]
    assert [e["name"] for e in events] == ["a step", "the next step"]
    assert events[0]["args"]["error"] == "ValueError" and "error" not in events[1].get("args", {})
