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
