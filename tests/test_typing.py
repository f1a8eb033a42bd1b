"""What a type checker sees of hicache (it ships py.typed): every public name of every public
face has a type, the value classes' fields and keyword constructors are checked, and the
README's examples check clean - judged by mypy, the checker an importing engine runs, over code
such an engine would write (its errors and ``reveal_type`` notes, not hicache's own internals)."""

from __future__ import annotations

import ast
import importlib
import os
import re
from pathlib import Path

import pytest
from test_readme_examples import _blocks as readme_blocks  # the README section's one reader

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "hicache"


def _public_faces() -> list[str]:
    """Every module with no private part in its name that says what it exports (``__all__``)."""
    faces = []
    for path in sorted(PACKAGE.rglob("*.py")):
        parts = path.relative_to(ROOT).with_suffix("").parts
        parts = parts[:-1] if parts[-1] == "__init__" else parts
        if any(part.startswith("_") for part in parts) or "__all__" not in path.read_text():
            continue
        faces.append(".".join(parts))
    return faces


def _mypy(tmp_path: Path, *sources: str) -> list[str]:
    """mypy's lines for ``sources`` as a user's modules, in one run (hicache found where it is
    installed; hicache's own modules followed silently: only the user's modules are judged)."""
    from mypy import api

    users = [tmp_path / f"user_module_{i}.py" for i in range(len(sources))]
    for user, source in zip(users, sources):
        user.write_text(source)
    out, err, _ = api.run(["--follow-imports=silent", "--no-error-summary", "--show-error-codes",
                           "--cache-dir", os.devnull, *map(str, users)])
    assert not err.strip(), err
    return out.splitlines()


def test_every_public_name_has_a_type_and_the_readmes_examples_check_clean(tmp_path):
    """``reveal_type`` of each name in each public face's ``__all__`` (the plan's lazy names, the
    bring-up behind its signal guard included) is a type, never Any - for Any a checker checks
    nothing an importer writes with it; and the README's plan and bring-up examples, as an engine
    would copy them, have no error. One mypy run for both: each run reads torch's stubs afresh,
    about 13 s of a busy CI box's 2 cores."""
    faces = _public_faces()
    assert {"hicache.plan", "hicache.effects", "hicache.pools", "hicache.store", "hicache.errors"} <= set(faces)
    names = [f"{face}.{name}" for face in faces for name in importlib.import_module(face).__all__]
    source = f"import {', '.join(faces)}\n" + "".join(f"reveal_type({name})\n" for name in names)
    blocks = readme_blocks()
    assert "plan_pool(" in blocks[0] and "bring_up(" in blocks[1]
    lines = _mypy(tmp_path, source, *blocks[:2])
    faces_lines = [line for line in lines if line.startswith(str(tmp_path / "user_module_0.py"))]
    revealed = [line for line in faces_lines if "Revealed type is" in line]
    assert len(revealed) == len(names), "\n".join(lines[:20])
    untyped = [names[int(line.split(":")[1]) - 2] for line in revealed if line.endswith('Revealed type is "Any"')]
    assert not untyped, f"Any to a type checker: {untyped}"
    readme_errors = [line for line in lines if ": error:" in line and line not in faces_lines]
    assert readme_errors == [], readme_errors


def test_a_misspelt_field_a_wrong_type_or_a_write_to_a_plan_is_caught(tmp_path):
    """On the pure core's frozen values: a misspelt keyword to `Limits`, a size read as a string, a
    write to a frozen plan and a misspelt attribute are each a checker's error on their own line,
    and the correct lines around them are not."""
    source = (
        "from hicache.plan import Limits, MHALayout, plan_pool\n"
        "layout = MHALayout('layer_first', layer_num=4, head_num=8, head_dim=128, page_size=64, page_num=256,"
        " itemsize=2)\n"
        "pool = plan_pool(layout, Limits(chunk_limit_bytes=2**30))\n"
        "Limits(chunk_limit_byte=2**30)\n"
        "unit: str = pool.buffers[0].spec.copy_unit_bytes\n"
        "pool.buffers[0].plan.ranges = ()\n"
        "pool.buffers[0].plan.total_byte\n"
        "total: int = sum(b.plan.total_bytes for b in pool.buffers)\n"
    )
    errors = {int(line.split(":")[1]): line for line in _mypy(tmp_path, source) if ": error:" in line}
    assert sorted(errors) == [4, 5, 6, 7], errors
    assert '"chunk_limit_byte"' in errors[4] and "[call-arg]" in errors[4]
    assert "[assignment]" in errors[5]
    assert "read-only" in errors[6] or "frozen" in errors[6], errors[6]
    assert '"total_byte"' in errors[7]


def test_the_value_class_factory_form_is_typed(tmp_path):
    """``@value_class(kw_only=True)`` (the form `Limits` and most plan values use) returns a
    typed class decorator, not Any: pyright applies PEP 681's transform to a factory's call only
    then (without the overloads it saw ``Limits()`` take no field at all). mypy, which the suite
    runs, reveals the type pyright reads."""
    source = "from hicache.plan._value import value_class\nreveal_type(value_class(kw_only=True))\n"
    [revealed] = [line for line in _mypy(tmp_path, source) if "Revealed type is" in line]
    # mypy 1.11 spells the type variable with its id ("_C`330"), later ones without
    assert re.search(r"\(_C[^)]*\) -> _C", revealed) and "Any" not in revealed, revealed


def test_the_plans_lazy_names_are_told_to_checkers_from_their_homes():
    """hicache.plan's ``if TYPE_CHECKING:`` imports name exactly the lazy names of ``_HOMES``,
    each from the module ``__getattr__`` loads it from, each re-exported as itself (``X as X``,
    which strict checkers require)."""
    import hicache.plan as plan

    tree = ast.parse((PACKAGE / "plan" / "__init__.py").read_text())
    [block] = [node for node in tree.body if isinstance(node, ast.If) and ast.unparse(node.test) == "TYPE_CHECKING"]
    told = {alias.name: node.module for node in block.body for alias in node.names}
    assert told == plan._HOMES
    assert all(alias.asname == alias.name for node in block.body for alias in node.names)


def test_the_face_search_sees_the_faces():
    """Not vacuous: the faces found include the effects' sub-faces and no private module."""
    faces = _public_faces()
    assert "hicache.effects.for_cli" in faces and "hicache.plan.settings" in faces
    assert not any(re.search(r"\._", face) for face in faces)
