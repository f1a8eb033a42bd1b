"""The `hicache` CLI: plan output, golden files, errors and exit codes, no heavy imports."""

from __future__ import annotations

import json
import os
import pathlib
import subprocess
import sys

import pytest

from hicache.cli import main
from hicache.plan import CapacityPlan, from_jsonable

GOLDEN = pathlib.Path(__file__).parent / "golden"
from machine import ROOMY  # noqa: E402


def run(capsys, *argv):
    code = main(list(argv))
    out = capsys.readouterr()
    return code, out.out, out.err


def test_no_arguments_plans_the_default_preset_and_says_so(capsys):
    """`hicache plan` alone plans llama-3.1-70b on defaults (TP 1, as SGLang's --tp-size and
    plan_capacity) and lists the defaults it used."""
    code, out, err = run(capsys, "plan")
    assert code == 0
    assert "default preset" in err
    assert "defaults used: --model llama-3.1-70b --tp 1" in out
    assert "305,216 tokens in 4,769 pages of 64" in out
    assert "budget: not checked" in out and "doctor --plan" in out


def test_list_models_shows_every_required_preset(capsys):
    """--list-models lists at least one model of each family."""
    code, out, _ = run(capsys, "plan", "--list-models")
    assert code == 0
    for name in ("llama-3.1-8b", "llama-3.1-70b", "qwen3-32b", "qwen3-235b-a22b", "deepseek-v3",
                 "deepseek-v3.2", "kimi-k2", "qwen3-next-80b-a3b", "mimo-v2-flash"):
        assert name in out


GOLDEN_CASES = {
    "llama-3.1-70b-tp8.txt": ["--model", "llama-3.1-70b", "--tp", "8", "--host-gb", "200", "--chunk-limit", "64GiB"],
    "deepseek-v3.2-layer-first.json": ["--model", "deepseek-v3.2", "--tp", "8", "--layout", "layer_first", "--host-gb", "300",
                                       "--format", "json", "--host-memory", "3TB", "--ranks-per-host", "8"],
    "qwen3-next-kernel-6.12.md": ["--model", "qwen3-next-80b-a3b", "--tp", "4", "--host-gb", "50",
                                  "--kernel-release", "6.12.3", "--format", "markdown"],
}


@pytest.mark.parametrize("name", sorted(GOLDEN_CASES))
def test_golden_outputs(capsys, name):
    """Table, JSON and markdown of a few presets match the reviewed golden files."""
    code, out, _ = run(capsys, "plan", *GOLDEN_CASES[name])
    assert code == 0
    path = GOLDEN / name
    if os.environ.get("HICACHE_UPDATE_GOLDEN"):
        path.write_text(out)
    assert out == path.read_text()


def test_json_is_deterministic_and_reads_back(capsys):
    """JSON output: sorted keys, integer bytes, documented buffer keys; from_jsonable loads it."""
    args = GOLDEN_CASES["deepseek-v3.2-layer-first.json"]
    _, first, _ = run(capsys, "plan", *args)
    _, second, _ = run(capsys, "plan", *args)
    assert first == second
    data = json.loads(first)
    assert data["schema_version"] == 1 and list(data) == sorted(data)
    buffer = data["pools"][0]["plan"]["buffers"][0]
    for key in ("name", "layout", "shape", "itemsize", "nbytes", "copy_unit_bytes", "ranges"):
        assert key in buffer
    assert isinstance(data["totals"]["total_bytes"], int)
    plan = from_jsonable(data)
    assert isinstance(plan, CapacityPlan) and plan.call_count == data["totals"]["call_count"]


def test_out_writes_a_file(capsys, tmp_path):
    """--out writes the output to a file and says so on stderr."""
    target = tmp_path / "plan.json"
    code, out, err = run(capsys, "plan", "--format", "json", "--out", str(target))
    assert code == 0 and out == "" and "wrote" in err
    assert from_jsonable(json.loads(target.read_text()))


def test_refused_budget_exits_1(capsys):
    """A budget the host cannot hold prints the verdict and exits 1."""
    code, out, err = run(capsys, "plan", "--host-gb", "300", "--host-memory", "1TB", "--ranks-per-host", "8")
    assert code == 1
    assert "REFUSED" in out
    assert "\nerror[budget-refused]: " in err and "\nhint: " in err


def test_kernel_cap_applies_and_is_explained(capsys):
    """--kernel-release 6.12 caps every call under ~2 GB and the table says why."""
    code, out, _ = run(capsys, "plan", "--kernel-release", "6.12.1")
    assert code == 0
    assert "kernel cap (Linux 6.11-6.13: ~2 GB a call); from --kernel-release 6.12.1  <- decides" in out


@pytest.mark.parametrize(
    "argv, ref, code",
    [
        (["plan", "--bogus"], "usage", 2),
        (["plan", "--model", "gpt-5"], "unknown-model", 2),
        (["plan", "--chunk-limit", "12XB"], "bad-size", 2),
        (["plan", "--chunk-limit", "0"], "bad-size", 2),
        (["plan", "--host-gb", "-5"], "bad-size", 2),
        (["plan", "--host-gb", "0"], "bad-size", 2),
        (["plan", "--tp", "0"], "bad-number", 2),
        (["plan", "--tp", "3"], "bad-config", 2),
        (["plan", "--host-gb", "10", "--ratio", "2", "--device-tokens", "100"], "conflicting-flags", 2),
        (["plan", "--ratio", "2"], "missing-flag", 2),
        (["plan", "--model", "llama-3.1-8b", "--config", "x.json"], "conflicting-flags", 2),
        (["plan", "--config", "/nonexistent/config.json"], "bad-config", 2),
        (["plan", "--kv-dtype", "int3"], "bad-dtype", 2),
        (["plan", "--model", "mimo-v2-flash", "--layout", "layer_first"], "unsupported-layout", 2),
        (["plan", "--chunk-limit", "1MiB"], "infeasible-plan", 1),
        (["doctor", "--plan", "/nonexistent.json"], "bad-plan", 2),
    ],
)
def test_user_mistakes_print_one_error_line_and_a_hint(capsys, argv, ref, code):
    """Each mistake: `error[ref]: ...` and `hint: ...` on stderr, no traceback, its exit code."""
    got, out, err = run(capsys, *argv)
    assert got == code
    lines = err.strip().splitlines()
    assert lines[-2].startswith(f"error[{ref}]: "), err
    assert lines[-1].startswith("hint: ")
    assert "Traceback" not in err


@pytest.mark.parametrize(
    "argv, ref, code, hint",
    [
        (["--chunk-limit", "1MiB"], "infeasible-plan", 1,
         "a page copy is 10 MiB: raise --chunk-limit to that or more (now 1 MiB, from --chunk-limit), "
         "or use fewer tokens a page (--page-size)"),
        (["--call-cap", "3MiB"], "infeasible-plan", 1,
         "a page copy is 10 MiB: raise --call-cap to that or more (now 3 MiB, from --call-cap), "
         "or use fewer tokens a page (--page-size)"),
        (["--page-size", "100000", "--host-gb", "1"], "infeasible-plan", 1,
         "a page copy is 15.26 GiB: raise --call-cap to that or more (now 4 GiB, from default), "
         "or use fewer tokens a page (--page-size)"),
        (["--chunk-limit", "8MiB", "--call-cap", "8MiB"], "infeasible-plan", 1,
         "a page copy is 10 MiB: raise --chunk-limit and --call-cap to that or more (now 8 MiB, from "
         "--chunk-limit and --call-cap), or use fewer tokens a page (--page-size)"),
        (["--store-gb", "0.0001"], "bad-store-plan", 2,
         "--store-gb: room for at least 16 slots (the message says how much); --store-slot-bytes: this "
         "plan's largest page or more, a multiple of 8"),
    ],
    ids=["chunk-limit", "call-cap", "page-size-by-default-cap", "two-caps", "store-gb"],
)
def test_an_infeasible_plan_hints_at_the_flag_that_decides(capsys, argv, ref, code, hint):
    """A page copy over the per-call cap names the flag of the cap that decides (all of them, where
    two are equal) and its source - it said "raise --chunk-limit" whichever cap it was - and an
    arena too small for `--store-gb` names the store's flags, not the registration caps."""
    got, out, err = run(capsys, "plan", *argv)
    lines = err.strip().splitlines()
    assert got == code and lines[-2].startswith(f"error[{ref}]: "), err
    assert lines[-1] == f"hint: {hint}"


@pytest.mark.parametrize(
    "content, ref",
    [
        ("{not json", "bad-config"),
        (json.dumps({"num_attention_heads": 8}), "bad-config"),
    ],
)
def test_malformed_config_json_is_a_usage_error(capsys, tmp_path, content, ref):
    """Malformed JSON or a config without a needed key exits 2 naming the problem."""
    path = tmp_path / "config.json"
    path.write_text(content)
    code, _, err = run(capsys, "plan", "--config", str(path))
    assert code == 2 and f"error[{ref}]" in err
    if "num_attention_heads" in content:
        assert "'num_hidden_layers' not found" in err


@pytest.mark.parametrize(
    "config, family, buffer_count",
    [
        ({"num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 8, "hidden_size": 4096}, "mha", 1),
        ({"num_hidden_layers": 61, "kv_lora_rank": 512, "qk_rope_head_dim": 64}, "mla", 1),
        ({"num_hidden_layers": 61, "kv_lora_rank": 512, "qk_rope_head_dim": 64, "index_head_dim": 128}, "dsa_indexer", 2),
    ],
)
def test_config_json_picks_the_family(capsys, tmp_path, config, family, buffer_count):
    """head_dim is derived when absent; MLA and index keys select MLA and the DSA indexer."""
    path = tmp_path / "config.json"
    path.write_text(json.dumps(config))
    code, out, _ = run(capsys, "plan", "--config", str(path), "--tp", "1", "--format", "json")
    assert code == 0
    data = json.loads(out)
    assert len(data["pools"]) == buffer_count
    assert data["pools"][-1]["plan"]["family"] == family
    if family == "mha":
        assert data["model"]["facts"]["head_dim"] == 128


def test_apply_without_cuda_stops_before_allocating(capsys):
    """`hicache apply` on a machine without CUDA exits 3 with the clear error, nothing done."""
    from hicache.effects._cuda._ledger import PROCESS_LEDGER
    from hicache.effects import probe_cuda

    if probe_cuda().available:
        pytest.skip("CUDA is available here")
    before = PROCESS_LEDGER.held()
    code, out, err = run(capsys, "apply", "--host-gb", "1")
    assert code == 3 and out == ""
    assert err.startswith("error[cuda-unavailable]: CUDA unavailable")
    assert PROCESS_LEDGER.held() == before


def test_doctor_json(capsys, tmp_path):
    """doctor --format json lists every check with a status."""
    plan = tmp_path / "plan.json"
    run(capsys, "plan", "--host-gb", "1", "--format", "json", "--out", str(plan))
    code, out, _ = run(capsys, "doctor", "--plan", str(plan), "--format", "json")
    checks = {c["name"]: c["status"] for c in json.loads(out)["checks"]}
    documented = (pathlib.Path(__file__).parents[1] / "docs/json.md").read_text()
    assert all(f"`{name}`" in documented for name in checks), [n for n in checks if f"`{n}`" not in documented]
    assert set(checks) == {"versions", "environment", "host_scope", "kernel", "limits", "thp", "hugepages", "pools", "buddyinfo", "memlock", "max_map_count", "memory", "numa", "host_copy", "page_allocator", "transfer", "cuda", "binding", "gpus", "sglang", "store_room", "store"}
    assert code == (1 if "fail" in checks.values() else 0)


def test_doctor_warns_when_a_saved_plan_was_made_for_smaller_pages_than_this_machines(capsys, tmp_path):
    """A plan saved where pages are 4 KiB, checked on a 64 KiB-page host (arm64 Grace kernels):
    the limits check warns that its boundaries are not aligned to this machine's pages and says
    to re-plan here; on a 4 KiB host the same plan passes."""
    import attrs

    from hicache.cli._doctor import doctor_checks
    from hicache.cli._saved import load_plan

    plan = tmp_path / "plan.json"
    run(capsys, "plan", "--host-gb", "1", "--format", "json", "--out", str(plan))
    saved = load_plan(str(plan))
    arm = {c.name: c for c in doctor_checks(saved, facts=attrs.evolve(ROOMY, os_page_bytes=65536), env={})}["limits"]
    assert arm.status == "warn" and "made for 4 KiB pages, this machine's are 64 KiB" in arm.finding
    assert "re-plan on this machine" in arm.hint
    assert {c.name: c for c in doctor_checks(saved, facts=ROOMY, env={})}["limits"].status == "pass"


def test_doctor_reports_how_host_pages_are_copied(monkeypatch):
    """The doctor's host_copy rule fails a bad HICACHE_HOST_COPY, says when python is asked for, and
    warns when the native helper is not built."""
    from hicache.cli._doctor import host_copy_check as _host_copy_check
    from hicache.effects._copy import _host_copy
    bad = _host_copy_check({"HICACHE_HOST_COPY": "turbo"})
    assert (bad.status, bad.name) == ("fail", "host_copy") and "'turbo' must be one of" in bad.finding
    assert "as HICACHE_HOST_COPY asks" in _host_copy_check({"HICACHE_HOST_COPY": "python"}).finding
    monkeypatch.setattr(_host_copy, "_native", None)
    missing = _host_copy_check({})
    assert missing.status == "warn" and "C compiler" in missing.hint


@pytest.mark.parametrize("built", [True, False], ids=["helper", "fallback"])
def test_doctor_says_what_the_pools_page_allocator_runs_on(monkeypatch, built):
    """The doctor's page_allocator rule passes on the C helper and warns, naming the reinstall,
    where the pools' page allocator falls back to torch operations (no C compiler at install)."""
    from hicache.cli._doctor import doctor_checks
    from hicache.pools import _page_allocator

    if built and _page_allocator._native is None:
        pytest.skip("the C helper is not built here (no compiler): the fallback case runs")
    if not built:
        monkeypatch.setattr(_page_allocator, "_native", None)
    check = {c.name: c for c in doctor_checks(facts=ROOMY, env={})}["page_allocator"]
    if built:
        assert (check.status, check.hint) == ("pass", "") and "the C helper" in check.finding
    else:
        assert check.status == "warn" and "torch fallback" in check.finding and "C compiler" in check.hint


def test_doctor_without_torch_says_the_pools_need_it_and_imports_no_pool():
    """Without torch (the light install) the page_allocator rule says the pools need it instead of
    importing them (which raises there); test_packaging runs the doctor in such an environment."""
    from hicache.cli._doctor_host import _page_allocator

    check = _page_allocator(None, installed=lambda name: name != "torch")
    assert check.status == "pass" and "torch, which is not installed" in check.finding and "hicache[cuda]" in check.finding


def test_plan_path_imports_no_torch_cuda_or_psutil():
    """`hicache plan` runs with torch, cuda and psutil blocked from import."""
    code = (
        "import sys\n"
        "for name in ('torch', 'cuda', 'cuda.bindings', 'psutil'):\n"
        "    sys.modules[name] = None\n"
        "from hicache.cli import main\n"
        "raise SystemExit(main(['plan', '--model', 'deepseek-v3.2', '--format', 'json']))\n"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
    assert json.loads(result.stdout)["kind"] == "capacity"


def test_python_dash_m_runs_the_cli():
    """`python -m hicache plan --list-models` works like the console script."""
    result = subprocess.run([sys.executable, "-m", "hicache", "plan", "--list-models"], capture_output=True, text=True)
    assert result.returncode == 0 and "deepseek-v3" in result.stdout


def _apply_args(*extra):
    from hicache.cli import make_parser

    return make_parser().parse_args(["apply", "--model", "llama-3.1-8b", "--tp", "8", "--host-gb", "0.02",
                                     "--chunk-limit", "4MiB", *extra])


def test_apply_brings_a_plan_up_and_down(capsys):
    """apply on a (fake) CUDA machine: allocate, pre-fault, register, release, print timings."""
    from hicache.cli import _apply
    from hicache.effects import HostLedger
    from hicache.testing import FakeCudaBinding, FakeRuntime

    runtime, ledger = FakeRuntime(), HostLedger()
    code = _apply.run(_apply_args("--format", "json"), runtime=runtime, machine=ROOMY,
                      cuda_binding=FakeCudaBinding(), ledger=ledger)
    out = json.loads(capsys.readouterr().out)
    assert code == 0 and out["calls"] > 1 and out["bytes"] > 0
    assert set(out) >= {"allocate_s", "prefault_s", "register_s", "release_s"}
    assert runtime.held() == set() and ledger.held() == ()
    assert runtime.cudart.register_calls == out["calls"]


def test_apply_interrupted_leaves_nothing_registered(capsys):
    """Ctrl-C in the middle of registering: everything rolled back, memory freed."""
    from hicache.cli import _apply
    from hicache.effects import HostLedger
    from hicache.errors import ApplyError
    from hicache.testing import FakeCudaBinding, FakeRuntime

    runtime, ledger = FakeRuntime(interrupt_register={2: "after"}), HostLedger()
    with pytest.raises(ApplyError) as info:
        _apply.run(_apply_args(), runtime=runtime, machine=ROOMY, cuda_binding=FakeCudaBinding(), ledger=ledger)
    assert isinstance(info.value.__cause__, KeyboardInterrupt)
    assert runtime.held() == set() and ledger.held() == ()


@pytest.mark.parametrize("hold", ["-1", "soon", "nan"])
def test_apply_refuses_a_bad_hold(capsys, hold):
    """--hold must be seconds >= 0 or inf: a usage error before anything is allocated."""
    code, out, err = run(capsys, "apply", "--host-gb", "1", "--hold", hold)
    assert code == 2 and "error[bad-number]: --hold" in err


def test_apply_refuses_a_saved_plan_whose_calls_exceed_this_machines_cap(capsys, tmp_path, monkeypatch):
    """A plan saved elsewhere (4 MiB calls) on a machine whose kernel pins at most 1 MiB per call:
    `apply --plan` refuses it before anything is allocated or CUDA is asked, naming the call, the
    cap and its source - it never hands the driver a call above the ceiling. Within the cap the
    same plan passes that check (and goes on to the CUDA check, absent here)."""
    saved = tmp_path / "plan.json"
    code, _, _ = run(capsys, "plan", "--model", "llama-3.1-8b", "--tp", "8", "--host-gb", "0.02",
                     "--chunk-limit", "4MiB", "--format", "json", "--out", str(saved))
    assert code == 0
    monkeypatch.setenv("HICACHE_KERNEL_PIN_CAP", "1MiB")
    code, _, err = run(capsys, "apply", "--plan", str(saved))
    assert "error[plan-exceeds-machine]" in err and "4 MiB, over this machine's 1 MiB cap" in err
    assert "kernel cap: HICACHE_KERNEL_PIN_CAP" in err and code != 0
    monkeypatch.setenv("HICACHE_KERNEL_PIN_CAP", "4MiB")
    code, _, err = run(capsys, "apply", "--plan", str(saved))
    assert "plan-exceeds-machine" not in err and code != 0  # on to the CUDA check: none here


def test_apply_honours_host_memory_and_ranks_per_host_in_its_budget(capsys):
    """--host-memory and --ranks-per-host take the place of this machine's free memory and rank
    count in apply's budget check (they were ignored): a 20 MB pool fits a roomy machine, but not
    100 MB shared by 8 ranks with no reserve - refused before anything is registered."""
    from hicache.cli import _apply
    from hicache.effects import HostLedger
    from hicache.errors import CapacityError
    from hicache.testing import FakeCudaBinding, FakeRuntime

    runtime = FakeRuntime()
    assert _apply.run(_apply_args("--format", "json"), runtime=runtime, machine=ROOMY,
                      cuda_binding=FakeCudaBinding(), ledger=HostLedger()) == 0
    capsys.readouterr()
    runtime = FakeRuntime()
    tight = _apply_args("--host-memory", "100MB", "--ranks-per-host", "8", "--reserve", "1")
    with pytest.raises(CapacityError, match="per rank|budget|exceeds|Not enough|available"):
        _apply.run(tight, runtime=runtime, machine=ROOMY, cuda_binding=FakeCudaBinding(), ledger=HostLedger())
    assert runtime.cudart.register_calls == 0


def test_apply_refuses_plan_arguments_next_to_a_saved_plan(capsys, tmp_path):
    """apply --plan FILE with any plan argument beside it is conflicting-flags naming that
    argument."""
    saved = tmp_path / "plan.json"
    assert run(capsys, "plan", "--model", "llama-3.1-8b", "--tp", "8", "--host-gb", "0.02", "--chunk-limit", "4MiB",
               "--format", "json", "--out", str(saved))[0] == 0
    for extra in (["--host-gb", "3"], ["--model", "llama-3.1-8b"], ["--chunk-limit", "1GiB"], ["--mamba-slots", "9"]):
        code, _, err = run(capsys, "apply", "--plan", str(saved), *extra)
        assert code == 2 and f"error[conflicting-flags]: --plan and {extra[0]} both given" in err, err


@pytest.mark.parametrize("fmt", ["table", "json"])
def test_apply_fake_cuda_is_a_dry_run_end_to_end_on_a_machine_without_a_gpu(fmt, fork_server):
    """`hicache apply --fake-cuda`, as a user runs it (a process, no Python): the whole bring-up
    against hicache.testing's fake driver - planned, mapped, pre-faulted, budgeted, registered in
    its calls, released - with the same output as a real run, and said to be a dry run."""
    result = fork_server.run(  # `python -m hicache` in a process of its own, forked: tests/forked.py
        [sys.executable, "-m", "hicache", "apply", "--model", "llama-3.1-8b", "--tp", "8", "--host-gb", "0.05",
         "--chunk-limit", "16MiB", "--fake-cuda", "--format", fmt,
         "--host-memory", "1TB", "--ranks-per-host", "1"],  # the budget injected: not this machine's free memory
        timeout=120,
    )
    assert result.returncode == 0, result.stderr
    assert "--fake-cuda: a dry run" in result.stderr and "Traceback" not in result.stderr
    if fmt == "json":
        out = json.loads(result.stdout)
        assert out["calls"] == 3 and out["bytes"] == 48 * 2**20 and out["largest_call"] == 16 * 2**20
    else:
        assert "bytes          48 MiB (50,331,648 B)" in result.stdout and "calls          3" in result.stdout
        assert "numa_node      None" not in result.stdout
