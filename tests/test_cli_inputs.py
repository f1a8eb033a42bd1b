"""Bad input to the CLI: each case is one `error[ref]:` line and a hint, its exit code, no
traceback, and bounded work (no hang on a FIFO, no reading /dev/zero, no absurd plan)."""

from __future__ import annotations

import json
import os
import stat
import subprocess
import sys

import pytest

from hicache.cli import main



def _config(tmp_path, **fields):
    base = {"hidden_size": 4096, "num_attention_heads": 32, "num_hidden_layers": 2, "num_key_value_heads": 8,
            "torch_dtype": "bfloat16"}
    base.update(fields)
    path = tmp_path / "config.json"
    path.write_text(json.dumps(base))
    return str(path)


CASES = {
    "config /dev/zero": (lambda tmp: ["plan", "--config", "/dev/zero"], "bad-config", 2),
    "config a directory": (lambda tmp: ["plan", "--config", str(tmp)], "bad-config", 2),
    "config too large": (lambda tmp: ["plan", "--config", _big(tmp)], "bad-config", 2),
    "config deeply nested": (lambda tmp: ["plan", "--config", _deep(tmp)], "bad-config", 2),
    "torch_dtype a list": (lambda tmp: ["plan", "--config", _config(tmp, torch_dtype=["bf16"])], "bad-config", 2),
    "hidden_size a string": (lambda tmp: ["plan", "--config", _config(tmp, hidden_size="4096")], "bad-config", 2),
    "zero attention heads": (lambda tmp: ["plan", "--config", _config(tmp, num_attention_heads=0)], "bad-config", 2),
    "layer_types a string": (lambda tmp: ["plan", "--config", _config(tmp, layer_types="sliding_attention")],
                             "bad-config", 2),
    "absurd layer count": (lambda tmp: ["plan", "--config", _config(tmp, num_hidden_layers=10**7)], "bad-config", 2),
    "model-path not a dir": (lambda tmp: ["plan", "--model-path", str(tmp / "nope")], "bad-config", 2),
    "host-gb absurd": (lambda tmp: ["plan", "--host-gb", "1e9"], "bad-size", 2),
    "millions of calls": (lambda tmp: ["plan", "--host-gb", "20000", "--chunk-limit", "2MiB"], "too-many-calls", 2),
    "device tokens absurd": (lambda tmp: ["plan", "--ratio", "2", "--device-tokens", str(10**13)], "bad-number", 2),
    "plan file is a fifo": (lambda tmp: ["doctor", "--plan", _fifo(tmp)], "bad-plan", 2),
    "plan file of one buffer": (lambda tmp: ["doctor", "--plan", _saved(tmp, "buffer")], "bad-plan", 2),
    "plan file tampered": (lambda tmp: ["apply", "--plan", _saved(tmp, "tampered")], "bad-plan", 2),
    "bad HICACHE_REGISTER_CHUNK": (lambda tmp: ["plan", "--chunk-limit", "lots"], "bad-size", 2),
    # sized by ratio: the same bounds as --host-gb (it once planned 9.5 M calls in 24 GB of RSS)
    "ratio x device tokens past 1 PB": (lambda tmp: ["plan", "--ratio", "2", "--device-tokens", str(10**12),
                                                     "--format", "json"], "bad-size", 2),
    "ratio path millions of calls": (lambda tmp: ["plan", "--ratio", "2", "--device-tokens", str(3 * 10**8),
                                                  "--chunk-limit", "16MiB", "--format", "json"], "too-many-calls", 2),
    "forced past the hard call bound": (lambda tmp: ["plan", "--ratio", "2", "--device-tokens", str(3 * 10**8),
                                                     "--chunk-limit", "16MiB", "--force"], "too-many-calls", 2),
    "apply sized past 1 PB": (lambda tmp: ["apply", "--ratio", "2", "--device-tokens", str(10**12)], "bad-size", 2),
    # a release the planner cannot read is refused, never a silent "no kernel cap"
    "kernel release garbage": (lambda tmp: ["plan", "--kernel-release", "garbage"], "bad-kernel-release", 2),
    "kernel release major only": (lambda tmp: ["plan", "--kernel-release", "6"], "bad-kernel-release", 2),
    "kernel release empty": (lambda tmp: ["plan", "--kernel-release="], "empty-value", 2),
    # an empty value is a mistake, never the default
    "empty --tp": (lambda tmp: ["plan", "--tp="], "empty-value", 2),
    "empty --host-gb": (lambda tmp: ["plan", "--host-gb="], "empty-value", 2),
    "empty --chunk-limit": (lambda tmp: ["plan", "--chunk-limit="], "empty-value", 2),
    "empty --model": (lambda tmp: ["plan", "--model", ""], "empty-value", 2),
    "blank --model": (lambda tmp: ["plan", "--model", "  "], "empty-value", 2),
    "empty --out": (lambda tmp: ["plan", "--out", ""], "empty-value", 2),
    "empty apply --hold": (lambda tmp: ["apply", "--hold="], "empty-value", 2),
    # counts past what any deployment has: a typo, named as one (not "check --tp against the model")
    "tp absurd": (lambda tmp: ["plan", "--tp", str(10**30)], "bad-number", 2),
    "mamba slots absurd": (lambda tmp: ["plan", "--mamba-slots", str(10**12)], "bad-number", 2),
    "apply threads absurd": (lambda tmp: ["apply", "--host-gb", "0.01", "--threads", "100000"], "bad-number", 2),
    # flags that would be ignored are refused
    "device tokens without ratio": (lambda tmp: ["plan", "--host-gb", "4", "--device-tokens", "1000"], "missing-flag", 2),
    "reserve without host memory": (lambda tmp: ["plan", "--reserve", "20GiB"], "missing-flag", 2),
    "ranks per host without host memory": (lambda tmp: ["plan", "--ranks-per-host", "8"], "missing-flag", 2),
    "model path and config both": (lambda tmp: ["plan", "--model-path", str(tmp), "--config", _config(tmp)],
                                   "conflicting-flags", 2),
}


def _big(tmp):
    path = tmp / "big.json"
    path.write_text("[" + "0," * (2**20) + "0]")
    return str(path)


def _deep(tmp):
    path = tmp / "deep.json"
    path.write_text("[" * 100_000 + "]" * 100_000)
    return str(path)


def _saved(tmp, kind):
    """A saved plan: a single buffer's (not what doctor and apply take), or a pool's with a range moved."""
    from hicache.plan import Limits, MHALayout, plan_pool, plan_registration, to_jsonable

    if kind == "buffer":
        data = to_jsonable(plan_registration(2**30, granularity_bytes=2**20, limits=Limits(chunk_limit_bytes=2**28)))
    else:
        layout = MHALayout("layer_first", layer_num=2, head_num=2, head_dim=64, page_size=16, page_num=64, itemsize=2)
        data = to_jsonable(plan_pool(layout, Limits(chunk_limit_bytes=2**16)))
        data["buffers"][0]["ranges"][1]["offset"] += 4096
    path = tmp / f"{kind}.json"
    path.write_text(json.dumps(data))
    return str(path)


def _fifo(tmp):
    path = tmp / "plan.fifo"
    os.mkfifo(path)
    return str(path)


@pytest.mark.parametrize("case", sorted(CASES))
def test_bad_input_is_one_error_line_with_its_exit_code(case, tmp_path, capsys):
    """Each bad input case gives its exit code, one error[ref] line, a hint line last, and no
    traceback."""
    argv, ref, code = CASES[case]
    got = main(argv(tmp_path))
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if line]
    assert got == code, err
    assert lines[0].startswith(f"error[{ref}]:") and lines[-1].startswith("hint:"), err
    assert "Traceback" not in err


@pytest.mark.parametrize("release", ["6.12", "v6.12", "6,12", "Linux 6.12", " 6.12", "6.12.0-31-generic", "6.11", "6.13.2"])
def test_kernel_releases_as_people_write_them_apply_the_pin_cap(release, capsys):
    """Kernel releases in 6.11-6.13 as uname prints them (distro suffixes included) apply the per-
    pin cap."""
    code = main(["plan", "--kernel-release", release, "--format", "json"])
    data = json.loads(capsys.readouterr().out)
    assert code == 0 and data["limits"]["kernel_cap_bytes"] is not None, release


@pytest.mark.parametrize("release", ["6.10", "6.14", "5.15.0-91-generic"])
def test_kernel_releases_outside_6_11_to_6_13_have_no_pin_cap(release, capsys):
    """Releases outside 6.11-6.13 plan without a per-pin cap."""
    code = main(["plan", "--kernel-release", release, "--format", "json"])
    assert code == 0 and json.loads(capsys.readouterr().out)["limits"]["kernel_cap_bytes"] is None


def _bounded_child(argv, *, memory_bytes=2 * 2**30, timeout=60, stdout=subprocess.PIPE):
    """`hicache ARGV` in a child process limited to ``memory_bytes`` of address space."""
    code = ("import resource, sys\n"
            f"resource.setrlimit(resource.RLIMIT_AS, ({memory_bytes}, {memory_bytes}))\n"
            "from hicache.cli import main\nsys.exit(main(sys.argv[1:]))\n")
    return subprocess.run([sys.executable, "-c", code, *argv], stdout=stdout, stderr=subprocess.PIPE,
                          text=True, timeout=timeout)


@pytest.mark.parametrize("argv", [
    ["plan", "--ratio", "2", "--device-tokens", str(10**12), "--format", "json"],
    ["plan", "--ratio", "2", "--device-tokens", str(10**12), "--chunk-limit", "1GiB", "--format", "json"],
    ["plan", "--ratio", "2", "--device-tokens", str(3 * 10**8), "--chunk-limit", "16MiB", "--force", "--format", "json"],
])
@pytest.mark.sanitizer_free("RLIMIT_AS: AddressSanitizer reserves terabytes of shadow address space, so the child dies at start")
def test_absurd_sizes_by_ratio_end_quickly_in_little_memory(argv):
    """Under a 2 GiB address-space limit and a 60 s timeout: one error line, no MemoryError."""
    result = _bounded_child(argv)
    assert result.returncode == 2 and result.stderr.splitlines()[-2].startswith("error["), result.stderr
    assert "Traceback" not in result.stderr and result.stdout == ""


@pytest.mark.skipif(not os.path.exists("/dev/full"), reason="needs /dev/full (Linux)")
@pytest.mark.parametrize("fmt", ["table", "json"])
@pytest.mark.sanitizer_free("RLIMIT_AS: AddressSanitizer reserves terabytes of shadow address space, so the child dies at start")
def test_a_full_standard_output_is_an_error_line_not_a_traceback(fmt):
    """plan writing to /dev/full exits 2 with error[bad-output], no traceback and no 'Exception
    ignored'."""
    with open("/dev/full", "w") as full:
        result = _bounded_child(["plan", "--format", fmt], stdout=full)
    assert result.returncode == 2 and "error[bad-output]: cannot write to standard output" in result.stderr
    assert "Traceback" not in result.stderr and "Exception ignored" not in result.stderr


def _out_targets(tmp_path) -> dict:
    """What may sit at a --out path but a regular file: each with why it is refused."""
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    kept = tmp_path / "kept.json"
    kept.write_text("theirs")
    link = tmp_path / "link.json"
    link.symlink_to(kept)
    (tmp_path / "dir").mkdir()
    return {"fifo": (fifo, "is a FIFO"), "symlink": (link, "is a symbolic link"),
            "directory": (tmp_path / "dir", "is a directory"),
            "missing dir": (tmp_path / "no" / "p.json", "does not exist")}


@pytest.mark.parametrize("case", ["fifo", "symlink", "directory", "missing dir"])
def test_plan_out_refuses_what_is_no_regular_file_and_writes_nothing_through_it(tmp_path, capsys, case):
    """`plan --out` at a FIFO (which blocked the write until someone read it), a symlink (whose
    target was overwritten), a directory or a missing directory: one error[bad-output] line
    naming the path and why, exit 2; the node and what a link points at are as they were."""
    path, why = _out_targets(tmp_path)[case]
    reader = os.open(path, os.O_RDONLY | os.O_NONBLOCK) if case == "fifo" else None  # the old write then ends
    try:
        before = os.lstat(path) if os.path.lexists(path) else None
        code = main(["plan", "--host-gb", "1", "--format", "json", "--out", str(path)])
        err = capsys.readouterr().err
        assert code == 2 and f"error[bad-output]: output file {path}" in err and why in err, err
        if reader is not None:
            assert os.read(reader, 1) == b""  # nothing was written into the FIFO (no writer: end of file)
    finally:
        if reader is not None:
            os.close(reader)
    if before is not None:
        assert os.lstat(path).st_mode == before.st_mode
    assert (tmp_path / "kept.json").read_text() == "theirs"
    assert not list(tmp_path.rglob("*.tmp"))


def test_plan_out_replaces_a_file_whole_keeping_its_mode_and_a_new_one_is_private(tmp_path, capsys):
    """An existing plan file is replaced by a rename (a new inode: a reader never sees half a
    plan) and keeps its permissions; a new file is 0600; no temp file is left."""
    old = tmp_path / "plan.json"
    old.write_text("old plan")
    os.chmod(old, 0o640)
    inode = os.stat(old).st_ino
    assert main(["plan", "--host-gb", "1", "--format", "json", "--out", str(old)]) == 0
    assert json.loads(old.read_text())["kind"] == "capacity" and os.stat(old).st_ino != inode
    assert stat.S_IMODE(os.stat(old).st_mode) == 0o640
    new = tmp_path / "new.json"
    assert main(["plan", "--host-gb", "1", "--format", "json", "--out", str(new)]) == 0
    assert stat.S_IMODE(os.stat(new).st_mode) == 0o600 and json.loads(new.read_text())["kind"] == "capacity"
    assert not list(tmp_path.rglob("*.tmp"))
    capsys.readouterr()


def test_an_interrupted_write_leaves_the_old_file_and_no_temp_file(tmp_path):
    """replace_file whose writer is interrupted half-way: the interrupt propagates, the old file
    is whole, and the temp file is gone."""
    from hicache._output_file import replace_file

    old = tmp_path / "plan.json"
    old.write_text("old plan")

    def half_then_interrupt(handle):
        handle.write("new pl")
        raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        replace_file(str(old), half_then_interrupt, what="output file", error=ValueError)
    assert old.read_text() == "old plan" and not list(tmp_path.rglob("*.tmp"))


def test_sglangs_size_0_means_size_by_ratio(capsys):
    """SGLang's defaults --hicache-size 0 --hicache-ratio 2: size 0 means "by the ratio" (it
    was refused as conflicting flags); the pool is what --ratio alone gives."""
    by_ratio = ["plan", "--ratio", "2", "--device-tokens", "100000", "--format", "json"]
    assert main(by_ratio) == 0
    alone = json.loads(capsys.readouterr().out)
    assert main(["plan", "--hicache-size", "0", "--hicache-ratio", "2", "--device-tokens", "100000", "--format", "json"]) == 0
    assert json.loads(capsys.readouterr().out)["size"] == alone["size"]
    assert main(["plan", "--host-gb", "4", "--ratio", "2", "--device-tokens", "100000"]) == 2
    assert "error[conflicting-flags]" in capsys.readouterr().err


def test_threads_columns_and_an_unusable_runtime_dir_are_error_lines(tmp_path):
    """Run as a user would (a process), with the environment they might have."""
    bad_dir = tmp_path / "not-mine"
    bad_dir.write_text("a file, not a directory")
    runs = [
        (["apply", "--model", "llama-3.1-8b", "--host-gb", "0.01", "--threads", "abc"], {}, "bad-number", 2),
        (["plan", "--help"], {"COLUMNS": "²"}, None, 0),
    ]
    code = ("import sys; from hicache.testing import fake_cuda; from hicache.cli import main\n"
            "with fake_cuda():\n    sys.exit(main(sys.argv[1:]))\n")
    for argv, env, ref, status in runs:
        result = subprocess.run([sys.executable, "-c", code, *argv], capture_output=True, text=True,
                                env={**os.environ, **env})
        assert result.returncode == status, result.stderr
        assert "Traceback" not in result.stderr
        if ref:
            assert result.stderr.startswith(f"error[{ref}]"), result.stderr
    result = subprocess.run([sys.executable, "-c", code, "apply", "--model", "llama-3.1-8b", "--host-gb", "0.01"],
                            capture_output=True, text=True, env={**os.environ, "HICACHE_RUNTIME_DIR": str(bad_dir)})
    assert result.returncode == 2 and "Traceback" not in result.stderr, result.stderr
    assert result.stderr.startswith("error[lock-directory]") and str(bad_dir) in result.stderr
    assert "HICACHE_RUNTIME_DIR" in result.stderr.splitlines()[-1]


def test_version_and_sglang_flag_names(capsys):
    """--version prints hicache's version, and SGLang's flag names (--tp-size, --hicache-size,
    --hicache-mem-layout, --kv-cache-dtype auto) plan as hicache's own."""
    with pytest.raises(SystemExit) as info:
        main(["--version"])
    assert info.value.code == 0 and capsys.readouterr().out.startswith("hicache ")
    assert main(["plan", "--tp-size", "8", "--hicache-size", "200", "--hicache-mem-layout", "page_first",
                 "--kv-cache-dtype", "auto", "--format", "json"]) == 0
    printed = json.loads(capsys.readouterr().out)
    inputs = printed["inputs"]
    assert inputs["tp"] == 8 and inputs["host_bytes"] == 200 * 10**9 and inputs["layout"] == "page_first"


def test_every_preset_table_fits_100_columns_unless_wide(capsys):
    """Every preset's plan table fits 100 columns (with and without a kernel cap) unless --wide asks
    otherwise."""
    from hicache.plan import PRESETS

    for name in PRESETS:
        for extra in ([], ["--kernel-release", "6.12"]):
            assert main(["plan", "--model", name, *extra]) == 0
            out = capsys.readouterr().out
            assert max(len(line) for line in out.splitlines()) <= 100, (name, extra)
    assert main(["plan", "--model", "deepseek-v3.2", "--wide"]) == 0
    wide = capsys.readouterr().out
    assert "family" in wide and "shape" in wide and max(len(line) for line in wide.splitlines()) > 100


def test_doctor_maps_gpus_to_numa_nodes_and_matches_the_binding_to_the_driver(tmp_path):
    """With a (fake) GPU: its PCI bus id and NUMA node from sysfs; a 13.x binding on a CUDA 12
    driver is a failing check that says which line to install."""
    from hicache.cli._doctor import doctor_checks
    from hicache.effects import for_cli
    from hicache.testing import FakeCudaBinding

    node = tmp_path / "sys/bus/pci/devices/0000:3b:00.0"
    node.mkdir(parents=True)
    (node / "numa_node").write_text("1\n")
    (gpu,) = for_cli.probe_gpus(FakeCudaBinding(), root=str(tmp_path))
    assert (gpu.index, gpu.pci_bus_id, gpu.numa_node) == (0, "0000:3b:00.0", 1)

    class OldDriver(FakeCudaBinding):
        def cudaDriverGetVersion(self):
            return (self._status(0)[0], 12040)

    from machine import ROOMY

    checks = {c.name: c for c in doctor_checks(root=str(tmp_path), env={}, cuda_binding=OldDriver(), facts=ROOMY)}
    assert "GPU 0 (0000:3b:00.0) -> NUMA node 1" in checks["gpus"].finding
    from hicache.effects import package_version

    if (package_version("cuda-bindings") or "0").split(".")[0] == "13":
        assert checks["binding"].status == "fail" and 'cuda-bindings>=12.0,<13' in checks["binding"].hint
    assert "CUDA driver 12.4" in checks["versions"].finding
    out = __import__("hicache.cli._doctor", fromlist=["render_checks"]).render_checks(list(checks.values()), "table")
    assert max(len(line) for line in out.splitlines()) <= 100


def test_doctor_says_where_each_ranks_pre_fault_runs(tmp_path):
    """The numa check names each rank's pre-fault share (issue #35 item 2, the bring-up's own
    fault_share): on two nodes of 8 CPUs with 4 ranks per host, 4 threads per rank on each
    node's CPUs, 2 ranks per node; on one node, an unpinned share of the process's CPUs."""
    from hicache.cli._doctor import doctor_checks
    from machine import facts

    two = facts(numa_nodes=2, numa_node_cpus=((0, tuple(range(8))), (1, tuple(range(8, 16)))), cpus=tuple(range(16)),
                ranks_per_host=4)
    finding = {c.name: c for c in doctor_checks(root=str(tmp_path), env={"HICACHE_RANKS_PER_HOST": "4"},
                                                facts=two)}["numa"].finding
    assert "pre-fault: node 0 4 thread(s) per rank on its CPUs, node 1 4 thread(s) per rank on its CPUs" in finding
    assert "(2 of the 4 rank(s) per node)" in finding
    one = facts(numa_node_cpus=((0, (0, 1, 2, 3)),), cpus=(0, 1, 2, 3), ranks_per_host=2)
    finding = {c.name: c for c in doctor_checks(root=str(tmp_path), env={"HICACHE_RANKS_PER_HOST": "2"},
                                                facts=one)}["numa"].finding
    assert "pre-fault: 2 thread(s) per rank, 2 rank(s) sharing 4 CPU(s)" in finding


def test_an_unknown_preset_suggests_the_close_ones(capsys):
    """A misspelt --model is error[unknown-model] suggesting the close preset names."""
    assert main(["plan", "--model", "deepseek-v32"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error[unknown-model]") and "did you mean deepseek-v3.2" in err


def test_doctor_reports_the_pool_settings_of_the_environment(tmp_path):
    """HICACHE_PROGRESSIVE / HICACHE_HUGEPAGES as the pools will read them: a bad value fails
    naming it; `required` without enough reserved pages fails, `prefer` warns that it falls back."""
    from hicache.cli._doctor import doctor_checks
    from hicache.effects._host._probes import HugepagePool
    from hicache.testing import FakeCudaBinding
    from machine import facts

    from hicache.plan import Limits, MHALayout, plan_pool

    plan = plan_pool(MHALayout("page_first_direct", layer_num=4, head_num=8, head_dim=128, page_size=64,
                               page_num=2048, itemsize=2), Limits(chunk_limit_bytes=2**30))  # 1 GiB

    def check(env, **machine):
        checks = doctor_checks(plan, root=str(tmp_path), env=env, cuda_binding=FakeCudaBinding(), facts=facts(**machine))
        return {c.name: c for c in checks}["pools"]

    assert check({}).status == "pass" and "all at construction" in check({}).finding
    on = check({"HICACHE_PROGRESSIVE": "1"})
    assert on.status == "pass" and "progressive" in on.finding and "HICACHE_PROGRESSIVE" in on.finding
    bad = check({"HICACHE_PROGRESSIVE": "maybe"})
    assert bad.status == "fail" and "HICACHE_PROGRESSIVE='maybe'" in bad.finding
    few = (HugepagePool(2 * 2**20, 8, 8),)
    assert check({"HICACHE_HUGEPAGES": "required"}, hugepages=few).status == "fail"
    prefer = check({"HICACHE_HUGEPAGES": "prefer"}, hugepages=few)
    assert prefer.status == "warn" and "4 KiB" in prefer.finding
    plenty = (HugepagePool(2 * 2**20, 10**6, 10**6),)
    assert check({"HICACHE_HUGEPAGES": "required"}, hugepages=plenty).status == "pass"


@pytest.mark.concurrency  # threads: `make test-loaded` runs it again under load
def test_a_config_swapped_for_a_fifo_while_being_read_never_hangs(tmp_path, capsys):
    """A symlink flipped between a real config.json and a FIFO as fast as possible while `plan
    --config LINK` runs 150 times: each run ends (the file is opened once, without blocking, and
    checked on the descriptor) with the plan or a bad-config line - never a hang on the FIFO."""
    import threading

    real = _config(tmp_path)
    fifo = tmp_path / "swap.fifo"
    os.mkfifo(fifo)
    link, spare = tmp_path / "config-link.json", tmp_path / "spare-link"
    os.symlink(real, link)
    stop = threading.Event()

    def flip():
        targets = (str(fifo), real)
        i = 0
        while not stop.is_set():
            if os.path.lexists(spare):
                os.unlink(spare)
            os.symlink(targets[i % 2], spare)
            os.replace(spare, link)  # atomic: the path is always one or the other
            i += 1

    flipper = threading.Thread(target=flip, daemon=True)
    flipper.start()
    outcomes = []
    try:
        for _ in range(150):
            result = []
            runner = threading.Thread(target=lambda: result.append(main(["plan", "--config", str(link), "--tp", "1"])),
                                      daemon=True)
            runner.start()
            runner.join(10)
            assert not runner.is_alive(), "plan --config hung on a FIFO"
            outcomes.append(result[0])
            capsys.readouterr()
    finally:
        stop.set()
        flipper.join()
    assert set(outcomes) <= {0, 2}, outcomes


@pytest.mark.parametrize("env, argv, ref, says", [
    ({"HICACHE_RANKS_PER_HOST": "junk"}, ["apply", "--fake-cuda", "--host-gb", "0.01"], "bad-environment",
     "fix or unset the environment variable"),
    ({"HICACHE_RANKS_PER_HOST": "0"}, ["apply", "--fake-cuda", "--host-gb", "0.01"], "bad-environment",
     "fix or unset the environment variable"),
    ({}, ["plan", "--host-gb", "1e-9"], "pool-too-small", "raise --host-gb"),
    ({"HICACHE_KERNEL_PIN_CAP": "4KiB"}, ["plan"], "too-many-calls", "HICACHE_KERNEL_PIN_CAP"),
    ({"HICACHE_KERNEL_PIN_CAP": "1"}, ["plan"], "bad-limits", "the HICACHE_* variables"),
])
def test_each_error_names_the_real_cause_and_its_fix(env, argv, ref, says, monkeypatch, capsys):
    """The hint fixes what is wrong: a bad variable is the variable (not "raise --chunk-limit"),
    a pool too small to hold a page needs a larger size (not "lower the pool size"), and too
    many calls names the cap that decides the call size, with its source."""
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    code = main(argv)
    err = capsys.readouterr().err
    assert code in (1, 2) and err.startswith(f"error[{ref}]") and says in err.splitlines()[-1], err


def test_doctor_fails_a_saved_plan_that_apply_would_refuse(tmp_path, monkeypatch, capsys):
    """A saved plan whose largest call is over this machine's hard cap: `apply --plan` refuses
    it, so doctor fails it too (it only warned)."""
    saved = tmp_path / "plan.json"
    assert main(["plan", "--model", "llama-3.1-8b", "--tp", "8", "--host-gb", "0.02", "--chunk-limit", "4MiB",
                 "--format", "json", "--out", str(saved)]) == 0
    monkeypatch.setenv("HICACHE_KERNEL_PIN_CAP", "1MiB")
    capsys.readouterr()
    main(["doctor", "--plan", str(saved), "--format", "json"])
    checks = {c["name"]: c for c in json.loads(capsys.readouterr().out)["checks"]}
    assert checks["limits"]["status"] == "fail" and "apply --plan refuses it" in checks["limits"]["finding"]


def test_too_few_free_hugepages_is_its_own_error_with_its_fix(monkeypatch, capsys):
    """`--hugepages required` where the hugetlbfs pool is dry: error[hugepages-exhausted] with the
    pages needed, free and reserved, and how to get them (it was a generic error[error]). The
    pool's state is injected: 4 reserved, none free."""
    from hicache.effects._host import _memory

    monkeypatch.setattr(_memory, "free_hugepages", lambda size, root="/": (4, 0))
    monkeypatch.setattr(_memory, "offered_hugepage_sizes", lambda root="/": (2 * 2**20,))  # whatever this box offers
    code = main(["apply", "--model", "llama-3.1-8b", "--tp", "8", "--host-gb", "0.05", "--chunk-limit", "16MiB",
                 "--hugepages", "required", "--hugepage-size", "2MiB", "--fake-cuda",
                 "--host-memory", "1TB", "--ranks-per-host", "1"])  # the budget: not this machine's free memory
    err = capsys.readouterr().err
    assert code == 1 and "error[hugepages-exhausted]" in err and "0 free of 4 reserved" in err, err
    assert "vm.nr_hugepages" in err.splitlines()[-1]


def test_doctor_without_the_cuda_binding_says_to_install_hicaches_cuda_extra(monkeypatch, capsys):
    """No cuda-bindings (nor cuda-python): the fix is `pip install "hicache[cuda]"`, not a driver."""
    import hicache.effects as effects

    real = effects.package_version
    monkeypatch.setattr(effects, "package_version",
                        lambda name: None if name in ("cuda-bindings", "cuda-python") else real(name))
    main(["doctor", "--format", "json"])
    checks = {c["name"]: c for c in json.loads(capsys.readouterr().out)["checks"]}
    assert checks["binding"]["status"] == "fail" and checks["binding"]["hint"] == 'pip install "hicache[cuda]"'
    assert checks["cuda"]["hint"] == 'pip install "hicache[cuda]"'


def test_a_numa_node_that_is_not_online_is_an_error_line(capsys):
    """`apply --numa 99999` (no machine has it online): error[bad-numa] naming the node and the
    online ones, after only --fake-cuda's note, exit 2, no traceback."""
    got = main(["apply", "--host-gb", "0.01", "--fake-cuda", "--numa", "99999"])
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if line and not line.startswith("note: --fake-cuda")]
    assert got == 2 and lines[0].startswith("error[bad-numa]: numa_node 99999 is not online; online nodes:"), err
    assert lines[-1].startswith("hint:") and "Traceback" not in err


@pytest.mark.parametrize("layer_types, window, note", [
    (["sliding_attention", "full_attention"] * 2, 64, "2 sliding-window layers (window 64) counted at full length"),
    (["full_attention"] * 4, None, None),
    (None, None, None),
])
def test_sliding_window_layers_are_named_as_an_upper_bound(tmp_path, capsys, layer_types, window, note):
    """HF's ``layer_types``: an MHA model's sliding-window layers (gpt-oss, Gemma) are planned at
    full length in the one KV pool - SGLang keeps them in a window pool of its own, sized by its
    device pool - and the plan says so and counts them, instead of planning them silently."""
    fields = {"num_hidden_layers": 4, **({"layer_types": layer_types} if layer_types else {}),
              **({"sliding_window": window} if window else {})}
    assert main(["plan", "--config", _config(tmp_path, **fields), "--format", "json"]) == 0
    plan = json.loads(capsys.readouterr().out)
    notes = [n for n in plan["notes"] if "sliding-window" in n]
    assert notes == ([] if note is None else [note + " in one pool: an upper bound (SGLang keeps them in a window "
                                              "pool of their own)"])
    assert plan["model"]["facts"].get("sliding_layers") == (2 if note else None)
    assert plan["pools"][0]["plan"]["params"]["layer_num"] == 4  # every layer at full length


def test_gpt_oss_preset_says_its_sliding_window_layers_are_an_upper_bound(capsys):
    """The gpt-oss-120b preset: 18 of its 36 layers slide over 128 tokens (its config.json's
    layer_types), and the plan says they are counted at full length."""
    assert main(["plan", "--model", "gpt-oss-120b", "--format", "json"]) == 0
    plan = json.loads(capsys.readouterr().out)
    assert any(n.startswith("18 sliding-window layers (window 128) counted at full length") for n in plan["notes"])
