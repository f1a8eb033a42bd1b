"""Rules of the suite itself (issue #31): a test file that starts threads or processes side by
side, forks or sends signals has tests marked `concurrency` - `make test-loaded` runs those
again beside six busy processes - unless it is named below with why load cannot change what it
sees. Read from the test files' syntax, so a new file cannot leave the loaded run unnoticed."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

TESTS = Path(__file__).parent

#: Calls that put work side by side with the test (or interrupt it).
CONCURRENT_CALLS = {("threading", "Thread"), ("subprocess", "Popen"), ("os", "fork"), ("os", "kill")}

#: Files with such calls whose tests stay out of the loaded run, and why.
NOT_LOADED = {
    "test_interrupts.py": "the trace interrupts one thread at every line; its line count is the same under load",
    "test_sglang_mooncake.py": "its instances take strict turns (stdin lines); load only slows them",
    "test_metrics_multiprocess.py": "each child writes only its own value files and is read after it ended; "
                                    "nothing is timed or ordered between them",
}


def _concurrent_calls(tree: ast.AST) -> list[str]:
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute):
            owner = node.func.value
            name = owner.id if isinstance(owner, ast.Name) else None
            if (name, node.func.attr) in CONCURRENT_CALLS:
                found.append(f"{name}.{node.func.attr} (line {node.lineno})")
    return found


def _marks_concurrency(tree: ast.AST) -> bool:
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and node.attr == "concurrency":
            value = node.value
            if isinstance(value, ast.Attribute) and value.attr == "mark":
                return True
    return False


@pytest.mark.parametrize("path", sorted(TESTS.glob("test_*.py")), ids=lambda p: p.name)
def test_a_file_that_runs_things_side_by_side_runs_loaded_too(path):
    """Threads, Popen, fork or a signal in a test file: some of its tests carry the marker."""
    tree = ast.parse(path.read_text())
    calls = _concurrent_calls(tree)
    if not calls or path.name in NOT_LOADED:
        return
    assert _marks_concurrency(tree), (f"{path.name} uses {', '.join(calls)} but marks no test "
                                      "`pytest.mark.concurrency`; mark them or name the file in NOT_LOADED with why")


def test_the_rule_sees_a_file_that_breaks_it():
    """The rule's own check: an unmarked Popen is found, a marked one passes."""
    bare = ast.parse("import subprocess\ndef test_x():\n    subprocess.Popen(['true'])\n")
    marked = ast.parse("import pytest, subprocess\n@pytest.mark.concurrency\ndef test_x():\n    subprocess.Popen(['true'])\n")
    assert _concurrent_calls(bare) and not _marks_concurrency(bare)
    assert _marks_concurrency(marked)
    assert NOT_LOADED.keys() <= {p.name for p in TESTS.glob("test_*.py")}  # no stale exemption


@pytest.mark.parametrize("path", sorted(TESTS.glob("test_*.py")), ids=lambda p: p.name)
def test_every_test_says_what_it_proves(path):
    """Every test function has a docstring (the suite's rule: one sentence saying what it proves)."""
    bare = [node.name for node in ast.walk(ast.parse(path.read_text()))
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.name.startswith("test_")
            and not (ast.get_docstring(node) or "").strip()]
    assert not bare, f"{path.name}: tests without a docstring: {', '.join(bare)}"


@pytest.mark.parametrize("mark", ["load_free", "sanitizer_free"])
def test_a_test_left_out_of_a_run_says_why(mark):
    """Every ``pytest.mark.load_free`` (left out of `make test-loaded`) and ``sanitizer_free`` (of
    `make test-sanitized`) names its reason (one non-empty string), and there are few."""
    marks = []
    for path in sorted(TESTS.glob("test_*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == mark:
                marks.append((path.name, node))
    assert marks, f"the rule sees no {mark} mark: it would pass vacuously"
    for name, node in marks:
        assert len(node.args) == 1 and isinstance(node.args[0], ast.Constant) and str(node.args[0].value).strip(), name
    assert len(marks) <= 5, [name for name, _ in marks]


def _imports_sglang_in_process(tree: ast.AST) -> bool:
    """A test or fixture taking the `sglang` fixture, or a call of load_sglang (sglang_support)."""
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            if any(arg.arg == "sglang" for arg in node.args.args):
                return True
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "load_sglang":
            return True
    return False


def test_the_one_worker_for_sglang_names_exactly_the_files_that_import_it_in_process():
    """tests/worker_groups.py's list is every test file that imports SGLang in its own process,
    and only those: a new one cannot pay SGLang's import again on another loaded worker."""
    from worker_groups import IN_PROCESS_SGLANG, SGLANG_UNIT, unit_of

    found = {p.name for p in TESTS.glob("test_*.py") if _imports_sglang_in_process(ast.parse(p.read_text()))}
    assert found, "the rule sees no file importing SGLang in-process: it would pass vacuously"
    assert set(IN_PROCESS_SGLANG) == found, (sorted(found - IN_PROCESS_SGLANG), sorted(IN_PROCESS_SGLANG - found))
    assert unit_of("tests/test_sglang_controller.py::test_x[mha]") == SGLANG_UNIT
    assert unit_of("tests/test_lock.py::test_x") == "tests/test_lock.py::test_x"


def test_torch_runs_its_kernels_on_the_threads_the_runner_chose_one_by_default():
    """The test processes run torch's kernels on OMP_NUM_THREADS threads, one unless the runner
    set it (conftest): oversubscribed OpenMP threads spin, and made the suite's SGLang worker 7x
    slower than alone; a child process inherits the same."""
    import os
    import subprocess
    import sys

    torch = pytest.importorskip("torch")
    chosen = int(os.environ["OMP_NUM_THREADS"])
    assert torch.get_num_threads() == chosen
    child = subprocess.run([sys.executable, "-c", "import torch; print(torch.get_num_threads())"],
                           capture_output=True, text=True, timeout=120)
    assert child.returncode == 0 and int(child.stdout) == chosen, child.stderr[-2000:]
