"""The benchmarks and scripts call hicache as it is now: every keyword they pass to a name they
import from hicache (``**`` of a module-level dict included) is one that name takes. They run
outside the suite, so a keyword a redesign removed would otherwise break them silently
(bench_sglang_pools passed ``host_memory_bytes=`` to the pools for two stops after it went)."""

from __future__ import annotations

import ast
import importlib
import inspect
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
CALLERS = sorted([*ROOT.glob("benchmarks/*.py"), *ROOT.glob("scripts/*.py")])


def _module_dicts(tree: ast.Module) -> dict[str, set[str]]:
    """Module-level ``NAME = dict(a=..., ...)`` or ``{"a": ...}``: the keys each spreads."""
    found = {}
    for node in tree.body:
        if isinstance(node, ast.Assign) and len(node.targets) == 1 and isinstance(node.targets[0], ast.Name):
            value = node.value
            if isinstance(value, ast.Call) and getattr(value.func, "id", None) == "dict" and not value.args:
                found[node.targets[0].id] = {k.arg for k in value.keywords if k.arg}
            elif isinstance(value, ast.Dict) and all(isinstance(k, ast.Constant) for k in value.keys):
                found[node.targets[0].id] = {k.value for k in value.keys}
    return found


def _imported(tree: ast.Module) -> dict[str, str]:
    """``local name -> dotted path`` of every hicache name or module imported, at any depth
    (``from hicache.x import name``, ``from hicache import pools as p``, ``import hicache.x as m``)."""
    found = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("hicache"):
            found.update({alias.asname or alias.name: f"{node.module}.{alias.name}" for alias in node.names})
        elif isinstance(node, ast.Import):
            found.update({alias.asname: alias.name for alias in node.names
                          if alias.asname and alias.name.startswith("hicache")})
    return found


def _resolve(path: str):
    """The object at dotted ``path`` (a module, or a name in one), or None - also where a module
    it needs is not installed here (SGLang, for compat's: CI installs it and judges them)."""
    try:
        return importlib.import_module(path)
    except ModuleNotFoundError as error:
        if error.name != path:
            return None
    module, _, name = path.rpartition(".")
    try:
        return getattr(importlib.import_module(module), name, None)
    except ModuleNotFoundError:
        return None


def _callee(func, names: dict[str, str]) -> str | None:
    """The dotted path a call's ``name(...)`` or ``alias.name(...)`` reaches, where it is hicache's."""
    if isinstance(func, ast.Name):
        return names.get(func.id)
    if isinstance(func, ast.Attribute) and isinstance(func.value, ast.Name) and func.value.id in names:
        return f"{names[func.value.id]}.{func.attr}"
    return None


def unbound_keywords(source: str) -> list[str]:
    """``line: name(keyword)`` for each keyword a call passes that the hicache name it calls
    does not take (names whose signature takes ``**keywords`` are not judged)."""
    tree = ast.parse(source)
    dicts, names, bad = _module_dicts(tree), _imported(tree), []
    for call in ast.walk(tree):
        path = _callee(call.func, names) if isinstance(call, ast.Call) else None
        target = _resolve(path) if path else None
        if target is None or inspect.ismodule(target):
            continue
        name = path.rpartition(".")[2]
        try:
            parameters = inspect.signature(target).parameters
        except (TypeError, ValueError):
            continue
        if any(p.kind is p.VAR_KEYWORD for p in parameters.values()):
            continue
        passed = {k.arg for k in call.keywords if k.arg}
        passed |= {key for k in call.keywords if k.arg is None and isinstance(k.value, ast.Name)
                   for key in dicts.get(k.value.id, ())}
        bad += [f"{call.lineno}: {name}({word}=)" for word in sorted(passed - set(parameters))]
    return bad


@pytest.mark.parametrize("path", CALLERS, ids=lambda p: f"{p.parent.name}/{p.name}")
def test_a_benchmark_or_script_passes_only_keywords_hicache_takes(path):
    """Each keyword a benchmark or script passes to a hicache name is one that name takes."""
    pytest.importorskip("torch")
    assert not unbound_keywords(path.read_text()), unbound_keywords(path.read_text())


def test_the_caller_rule_sees_a_removed_keyword():
    """Not vacuous: a keyword `bring_up` no longer takes is found, given directly or spread
    from a module-level dict, and one a pool reached through its package's alias does not take
    (as bench_sglang_pools once passed to the pools)."""
    source = ("from hicache.effects import HostSetup, bring_up\n"
              "from hicache import pools as ours\n"
              "ROOM = dict(host_memory_bytes=1)\n"
              "bring_up(plan, allocator=None)\n"
              "bring_up(plan, host=HostSetup(), **ROOM)\n"
              "ours.MambaPoolHost(info, 2.0, 0, **ROOM)\n")
    assert unbound_keywords(source) == ["4: bring_up(allocator=)", "5: bring_up(host_memory_bytes=)",
                                        "6: MambaPoolHost(host_memory_bytes=)"]
