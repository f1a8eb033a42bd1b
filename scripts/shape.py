#!/usr/bin/env python3
"""The house's shape in numbers (issue #55's "Measure"): the keywords `bring_up` and a pool
constructor take, the public names of each face, the private imports across packages, the
largest modules. Reads ROOT's source (ast) and imports its faces in a child; prints one JSON line.

    python scripts/shape.py [ROOT] [--list]   # ROOT: a checkout (default: this one); --list: the crossings
"""

from __future__ import annotations

import ast
import json
import subprocess
import sys
from pathlib import Path

ARGS = [a for a in sys.argv[1:] if not a.startswith("--")]
ROOT = Path(ARGS[0] if ARGS else Path(__file__).resolve().parents[1]).resolve()
PACKAGE = ROOT / "hicache"


def _module(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _package(module: str) -> str:
    return ".".join(module.split(".")[:2])


def private_cross_package_imports() -> list[str]:
    """``from hicache.<a>._x import ...`` in a module of another package."""
    found = []
    for path in sorted(PACKAGE.rglob("*.py")):
        module = _module(path)
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and not node.level and (node.module or "").startswith("hicache."):
                parts = node.module.split(".")
                if any(part.startswith("_") for part in parts[2:]) and _package(node.module) != _package(module):
                    found.append(f"{module} -> {node.module}")
    return found


def face_names() -> dict:
    """Each face's public names (its ``__all__``, imported from ROOT in a child process)."""
    code = ("import importlib, json; print(json.dumps({f'hicache.{face}': len(importlib.import_module("
            "f'hicache.{face}').__all__) for face in ('effects', 'plan', 'pools', 'store', 'testing')}))")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=300)
    return json.loads(out.stdout) if out.returncode == 0 else {"error": out.stderr[-300:]}


def bring_up_keywords() -> list[str]:
    tree = ast.parse((PACKAGE / "effects" / "_bringup" / "_bring_up.py").read_text())
    for node in ast.walk(tree):
        if isinstance(node, ast.FunctionDef) and node.name == "bring_up":
            return [a.arg for a in node.args.kwonlyargs] + (["**" + node.args.kwarg.arg] if node.args.kwarg else [])
    return []


def pool_keywords() -> list[str]:
    """The keywords a pool constructor takes beyond its positional ones (the options table of
    `hicache.pools._options`: the sizing names, and the options' names or doors)."""
    source = (PACKAGE / "pools" / "_options.py").read_text()
    names = []
    for node in ast.parse(source).body:
        targets = [getattr(t, "id", None) for t in getattr(node, "targets", [])]
        if "SIZING_KEYWORDS" in targets or "_SGLANG_OPTIONS" in targets:
            names += list(ast.literal_eval(node.value))
        if isinstance(node, ast.ClassDef) and node.name == "PoolOptions" and "_SGLANG_OPTIONS" not in source:
            names += [n.target.id for n in node.body if isinstance(n, ast.AnnAssign)]  # before: each field one
    return names + (["options", "host"] if "_SGLANG_OPTIONS" in source else [])


def _functions(path: Path):
    return [n for n in ast.walk(ast.parse(path.read_text())) if isinstance(n, ast.FunctionDef)]


def pool_catch_alls() -> list[str]:
    """Pool constructors (``__init__`` in pools/) that take ``**keywords``."""
    return sorted(f"{_module(p)}:{f.lineno}" for p in (PACKAGE / "pools").glob("*.py") for f in _functions(p)
                  if f.name == "__init__" and f.args.kwarg is not None)


def geometry_reads_the_pool() -> bool:
    """Whether `make_geometry` takes (or reads) a pool."""
    for f in _functions(PACKAGE / "pools" / "_geometry.py"):
        if f.name == "make_geometry":
            names = {a.arg for a in f.args.args} | {n.id for n in ast.walk(f) if isinstance(n, ast.Name)}
            return "pool" in names
    return False


def writes_around_build() -> int:
    """Pool fields assigned (``self.x =``/``pool.x =``/``setattr``) in functions that call ``_build``."""
    count = 0
    for path in (PACKAGE / "pools").glob("*.py"):
        for f in _functions(path):
            if f.name in ("_build", "_adopt") or not any(isinstance(c, ast.Call) and getattr(c.func, "attr", None) == "_build"
                                                          for c in ast.walk(f)):
                continue
            for node in ast.walk(f):
                targets = node.targets if isinstance(node, ast.Assign) else []
                count += sum(1 for t in targets for e in (t.elts if isinstance(t, ast.Tuple) else [t])
                             if isinstance(e, ast.Attribute) and getattr(e.value, "id", None) in ("self", "pool"))
                count += isinstance(node, ast.Call) and getattr(node.func, "id", None) == "setattr"
    return count


def admission_doors() -> list[str]:
    """Functions outside plan/ and the lock that judge (``check_budget``) or record a claim
    (``lock.record``), or book a server's scope (``book_host_memory``) - the doors of admission."""
    doors = []
    for path in PACKAGE.rglob("*.py"):
        module = _module(path)
        if module.startswith("hicache.plan") or module.endswith("_hostwide._lock") or module.endswith("_server"):
            continue
        for f in _functions(path):
            for c in ast.walk(f):
                if not isinstance(c, ast.Call):
                    continue
                name = getattr(c.func, "id", getattr(c.func, "attr", None))
                on = ast.unparse(c.func.value) if isinstance(c.func, ast.Attribute) else ""
                if name in ("check_budget", "book_host_memory") or (name == "record" and "lock" in on):
                    doors.append(f"{module}.{f.name}")
    return sorted(set(doors))


_CALLS = r"""
import sys, json
from hicache.testing import MHADevicePool, fake_cuda
from hicache.pools import MHATokenToKVPoolHost
from hicache.effects import HostSetup
calls, distinct, done, made, plans = [0], set(), [False], set(), [0]
def profile(frame, event, arg):
    if done[0] or event != "call":
        return
    code = frame.f_code
    if code.co_name == "cudaHostRegister":
        done[0] = True
    elif "/hicache/" in code.co_filename and "/testing" not in code.co_filename:
        calls[0] += 1
        distinct.add((code.co_filename, code.co_name))
        plans[0] += code.co_name in ("plan_pool", "plan_registration")  # the size planned (again)
    if code.co_name == "__init__" and "self" in frame.f_locals:  # a value made on the way (attrs' too)
        kind = type(frame.f_locals["self"])
        if kind.__module__.startswith("hicache.") and not kind.__module__.startswith("hicache.testing"):
            made.add(f"{kind.__module__}.{kind.__qualname__}")
device = MHADevicePool(size=1024, layer_num=2, head_num=2, head_dim=64, page_size=16)
with fake_cuda():
    import hicache.pools._base  # imports outside the count
    sys.setprofile(profile)
    try:
        pool = MHATokenToKVPoolHost(device, 2.0, 0, 16, "page_first", host=HostSetup(host_memory_bytes=10**12))
    finally:
        sys.setprofile(None)
    pool.destroy()
print(json.dumps([calls[0], len(distinct), sorted(made), plans[0]]))
"""


def calls_to_register() -> list:
    """hicache's Python calls (all, and distinct functions) from a pool constructor (the older
    form over hicache's fake device pool) to its first ``cudaHostRegister`` (fake CUDA), and the
    hicache classes whose values are made on the way (the changes of form the call goes through)."""
    out = subprocess.run([sys.executable, "-c", _CALLS], cwd=ROOT, capture_output=True, text=True, timeout=300)
    return json.loads(out.stdout) if out.returncode == 0 else ["error", out.stderr[-300:]]


#: the parts a pool is made of (its mixins), and the pool facts a part may read only from ``geometry``
PARTS = {"_slots.py": "SlotsMixin", "_device_copies.py": "DeviceCopiesMixin", "_progressive.py": "ProgressiveMixin",
         "_storage.py": "StoragePagesMixin", "_hisparse.py": "HiSparseHostPoolMixin"}
FACTS = {"size", "page_num", "size_per_token", "descriptor", "dtype", "layer_num", "target_layer_num", "start_layer",
         "end_layer", "page_size", "dcp_size", "dcp_rank", "device_capacity_tokens", "device_pool", "layout",
         "logical_page_size", "logical_size", "descriptor_class"}


def parts_reads() -> dict:
    """Per part: the pool attributes it reads of ``self`` beyond its own (implicit, shared with
    the other parts), and how many of them are pool facts rather than the ``geometry``."""
    found = {}
    for name, cls in PARTS.items():
        path = PACKAGE / "pools" / name
        if not path.exists():
            continue
        node = next(n for n in ast.walk(ast.parse(path.read_text())) if isinstance(n, ast.ClassDef) and n.name == cls)
        own = {i.name for i in node.body if isinstance(i, ast.FunctionDef)}
        reads = set()
        for each in ast.walk(node):
            if isinstance(each, ast.Attribute) and getattr(each.value, "id", None) == "self":
                (own.add if isinstance(each.ctx, ast.Store) else reads.add)(each.attr)
        found[cls] = sorted(reads - own)
    return {"implicit": sum(len(r) for r in found.values()), "facts": sum(len(set(r) & FACTS) for r in found.values())}


def parts_made_with_the_geometry() -> list:
    """The classes of pools/ made with a pool's ``geometry`` given explicitly (its parts, as
    objects: issue #55 item 1)."""
    found = []
    for path in sorted((PACKAGE / "pools").glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ClassDef) and not node.name.startswith("_"):  # private: not a part
                inits = [i for i in node.body if isinstance(i, ast.FunctionDef) and i.name == "__init__"]
                if inits and "geometry" in [a.arg for a in inits[0].args.args]:
                    found.append(node.name)
    return found


def files_naming_a_family(pattern: str = r"DeepSeekV4|deepseek_v4|V4Paged|V4State") -> int:
    """Modules of hicache that name DeepSeek-V4, the newest family (what a new family touches)."""
    import re

    return sum(1 for p in PACKAGE.rglob("*.py") if re.search(pattern, p.read_text()))


#: the values that carry a pool's size from SGLang's call to ``cudaHostRegister`` (its forms)
SIZE_FORMS = ("Sizing", "Facts", "PoolSize", "PoolGeometry", "MHALayout", "BufferSpec", "PoolPlan", "BufferPlan",
              "RegistrationPlan", "BufferRequest", "HostPools")


def size_path() -> dict:
    """From `calls_to_register`'s run: the size's forms made on the way, and its plans."""
    calls = calls_to_register()
    if calls and calls[0] == "error":
        return {"error": calls[1]}
    made = {name.rsplit(".", 1)[-1] for name in calls[2]}
    return {"calls": calls[0], "distinct_functions": calls[1], "values_made": len(calls[2]),
            "size_forms": [form for form in SIZE_FORMS if form in made], "plans": calls[3]}


def largest_modules(count: int = 3) -> list:
    sizes = [(_module(p), len(p.read_text().splitlines())) for p in PACKAGE.rglob("*.py")]
    return sorted(sizes, key=lambda item: -item[1])[:count]


def main() -> int:
    crossing = private_cross_package_imports()
    report = {"bring_up_keywords": len(bring_up_keywords()), "pool_keywords": len(pool_keywords()),
              "faces": face_names(), "private_cross_package_imports": len(crossing),
              "largest_modules": largest_modules(), "pool_constructors_with_catch_all": len(pool_catch_alls()),
              "make_geometry_reads_the_pool": geometry_reads_the_pool(),
              "pool_fields_written_around_build": writes_around_build(), "admission_doors": admission_doors(),
              "to_first_register": size_path(), "parts_reads": parts_reads(),
              "parts_made_with_the_geometry": parts_made_with_the_geometry(),
              "modules_naming_deepseek_v4": files_naming_a_family()}
    if "--list" in sys.argv:
        report.update(bring_up=bring_up_keywords(), pool=pool_keywords(), crossings=crossing)
    print(json.dumps(report))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
