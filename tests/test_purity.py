"""hicache/plan stays pure: no machine, clock, randomness, torch or CUDA (ARCHITECTURE.md)."""

from __future__ import annotations

import ast
import pathlib
import subprocess
import sys

import pytest

PLAN = pathlib.Path(__file__).resolve().parents[1] / "hicache" / "plan"
FORBIDDEN = {
    "torch", "cuda", "psutil", "os", "time", "random", "logging", "mmap", "ctypes",
    "subprocess", "threading", "socket",
}
FORBIDDEN_HICACHE = {"effects", "pools", "cli", "compat", "testing"}


def _imports(path: pathlib.Path):
    tree = ast.parse(path.read_text(), str(path))
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield node.lineno, alias.name
        elif isinstance(node, ast.ImportFrom):
            if node.level:  # relative: resolve against hicache.plan
                base = "hicache" if node.level >= 2 else "hicache.plan"
                yield node.lineno, f"{base}.{node.module or ''}".rstrip(".")
            else:
                yield node.lineno, node.module or ""


@pytest.mark.parametrize("path", sorted(PLAN.glob("*.py")), ids=lambda p: p.name)
def test_plan_modules_import_nothing_impure(path):
    """No module under hicache/plan imports torch, cuda, psutil, os, time, ... or outer layers."""
    for line, name in _imports(path):
        top = name.split(".")[0]
        assert top not in FORBIDDEN, f"{path.name}:{line} imports {name}"
        if top == "hicache":
            parts = name.split(".")
            assert len(parts) > 1 and parts[1] not in FORBIDDEN_HICACHE, (
                f"{path.name}:{line} imports {name}"
            )
            assert parts[1] in ("plan", "errors"), f"{path.name}:{line} imports {name}"


def test_the_scan_sees_imports():
    """The AST scan is not vacuous: it finds the attrs import the planner has."""
    assert ("attrs" in {n for _, n in _imports(PLAN / "_planner.py")})


def test_plan_imports_with_torch_cuda_psutil_blocked():
    """hicache.plan imports and plans in a process where torch, cuda and psutil cannot load."""
    code = (
        "import sys\n"
        "for name in ('torch', 'cuda', 'cuda.bindings', 'psutil'):\n"
        "    sys.modules[name] = None\n"
        "import hicache.plan as p\n"
        "plan = p.plan_registration(10, granularity_bytes=2, limits=p.Limits(chunk_limit_bytes=4))\n"
        "assert plan.call_count == 3\n"
        "heavy = [m for m in ('torch', 'cuda', 'psutil') if sys.modules.get(m) is not None]\n"
        "assert not heavy, heavy\n"
        "print('ok')\n"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "ok"


ROOT = PLAN.parent
#: What only hicache/effects may touch (ARCHITECTURE.md: "CUDA only in effects", one bring-up).
SHELL_ONLY_CALLS = {
    "apply_plan", "apply_pool_plan", "allocate_host", "prefault", "memcpy_batch",
    "memcpy", "cuda_copy", "copy_host_blocks", "budget_lock", "probe_machine", "cudaHostRegister",
    "cudaHostUnregister", "cudaMemcpyBatchAsync", "cudaMemcpyAsync",
}
CUDA_ATTRS = {"synchronize", "current_stream", "Stream", "device", "is_initialized"}
ENV_ATTRS = {"environ", "getenv"}


def _shell_uses(path: pathlib.Path):
    tree = ast.parse(path.read_text(), str(path))
    for node in ast.walk(tree):
        if isinstance(node, ast.Call):
            func = node.func
            name = func.id if isinstance(func, ast.Name) else func.attr if isinstance(func, ast.Attribute) else None
            if name in SHELL_ONLY_CALLS:
                yield node.lineno, name
        if isinstance(node, ast.Attribute):
            if node.attr in ENV_ATTRS:
                yield node.lineno, node.attr
            elif node.attr in CUDA_ATTRS and "cuda" in ast.unparse(node.value):
                yield node.lineno, f"{ast.unparse(node.value)}.{node.attr}"
        elif isinstance(node, ast.ImportFrom) and (node.module or "").startswith("cuda"):
            yield node.lineno, node.module


OUTER = sorted([*(ROOT / "pools").glob("*.py"), *(ROOT / "compat").glob("*.py"), *(ROOT / "cli").glob("*.py")])


@pytest.mark.parametrize("path", OUTER, ids=lambda p: f"{p.parent.name}/{p.name}")
def test_only_effects_touches_cuda_the_environment_or_the_bring_up_steps(path):
    """pools, compat and the CLI make no CUDA call, read no environment variable (the CLI's
    plan path reads HICACHE_* through hicache.plan.resolve_limits, given os.environ) and never
    allocate-and-register themselves: they go through effects.bring_up and the CopyEngine."""
    allowed = {("cli", "_plan_args.py", "environ"), ("cli", "_common.py", "environ"),  # settings, not the machine
               ("cli", "_doctor.py", "environ"), ("cli", "_doctor.py", "probe_machine"),  # doctor reads the machine
               ("compat", "sglang.py", "apply_plan")}  # _cuda_host_register: SGLang's register-only helper
    found = [(line, name) for line, name in _shell_uses(path) if (path.parent.name, path.name, name) not in allowed]
    assert not found, f"{path.parent.name}/{path.name}: {found}"


def test_the_shell_scan_sees_the_shell():
    """Not vacuous: it finds what effects itself uses."""
    found = {name for p in (ROOT / "effects").rglob("*.py") for _, name in _shell_uses(p)}
    assert {"environ", "cudaMemcpyBatchAsync", "allocate_host", "cuda.synchronize"} <= found


def test_the_cli_has_no_import_cycle():
    """hicache/cli modules import each other one way: the graph has no cycle."""
    graph = {}
    for path in (ROOT / "cli").glob("*.py"):
        mine = "hicache.cli" if path.stem == "__init__" else f"hicache.cli.{path.stem}"
        graph[mine] = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("hicache.cli"):
                targets = [node.module] if node.module != "hicache.cli" else [f"hicache.cli.{a.name}" for a in node.names]
                graph[mine] |= {t for t in targets if t != mine}
    seen, stack = set(), []

    def visit(node):
        assert node not in stack, f"import cycle: {' -> '.join(stack + [node])}"
        if node in seen:
            return
        stack.append(node)
        for target in graph.get(node, ()):
            if target != "hicache.cli":  # the package re-exports; it is imported last
                visit(target)
        stack.pop()
        seen.add(node)

    for node in graph:
        visit(node)
