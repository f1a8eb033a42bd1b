"""The import rules of hicache/, read from the source (AST, no import): effects' four rooms
import downward only, nothing outside effects reaches into a room, no module imports its own
package's face from inside effects, the face stays small, and the package has no import
cycle - imports inside functions included (they were what hid the last one)."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1] / "hicache"
FACE = "hicache.effects"
FACE_LIMIT = 35  # what callers outside effects reach (issue #34 item 6: 43 before the CLI-only and SGLang-only
# helpers moved into the `for_cli` and `for_sglang` modules); a new name must be used outside effects

#: Which rooms a room of hicache.effects may import (itself always): downward only.
LEAVES = {"_interrupts", "_trace"}  # every room may use them (Ctrl-C, the trace)
ALLOWED = {
    "_interrupts": set(),
    "_trace": set(),
    "_hostwide": LEAVES,  # runtime dir, budget lock, turnstile: what processes of a host agree through (#34)
    "_cuda": LEAVES | {"_hostwide"},
    "_host": LEAVES | {"_hostwide", "_cuda"},
    "_copy": LEAVES | {"_cuda"},
    "_bringup": LEAVES | {"_hostwide", "_cuda", "_host", "_copy"},
    "_arena": LEAVES | {"_hostwide", "_host", "_copy"},  # the node store's file: _host's pre-fault workers, _copy's thread rule
}


def _module_name(path: Path) -> str:
    parts = path.relative_to(ROOT.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES = {_module_name(p): p for p in ROOT.rglob("*.py")}
NATIVE = {_module_name(p) for p in ROOT.rglob("*.c")}  # the optional C helpers: leaves


def _imports(path: Path):
    """``(line, imported module, how)`` for every import of a hicache module in ``path``, at
    any depth; ``from package import name`` counts as importing ``package.name`` when that is
    a module. ``how`` is ``"from-face"`` for ``from hicache.effects import <not a module>``."""
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.startswith("hicache"):
                    yield node.lineno, alias.name, "import"
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and (node.module or "").startswith("hicache"):
            for alias in node.names:
                target = f"{node.module}.{alias.name}"
                if target in MODULES or target in NATIVE:
                    yield node.lineno, target, "from"
                else:
                    yield node.lineno, node.module, "from-face" if node.module == FACE else "from"


def _room(module: str) -> str | None:
    """The room of a module of hicache.effects (None: the face or one of its sub-faces - a module
    directly under effects without a leading underscore - or outside effects)."""
    if not module.startswith(FACE + "."):
        return None
    room = module.split(".")[2]
    return room if room.startswith("_") else None


#: the face's sub-faces, one per audience (issue #55 item 5): real modules with their own __all__
SUB_FACES = {"admission", "arena", "cuda_codes", "for_cli", "for_sglang", "trace"}


def test_the_rooms_are_what_the_table_names():
    """Not vacuous: every room exists and holds modules, and every module of effects is in one
    or is the face or one of its sub-faces."""
    rooms = {_room(m) for m in MODULES if m.startswith(FACE + ".")} - {None}
    assert rooms == set(ALLOWED)
    assert all(any(_room(m) == room for m in MODULES) for room in ALLOWED)
    faces = {m.split(".")[2] for m in MODULES if m.startswith(FACE + ".") and _room(m) is None}
    assert faces == SUB_FACES


@pytest.mark.parametrize("module", sorted(m for m in MODULES if _room(m)), ids=str)
def test_a_room_imports_only_the_rooms_below_it_and_never_the_face(module):
    """Each module of an effects room imports only the rooms below it (ALLOWED) and never the
    face."""
    room = _room(module)
    bad = []
    for line, target, how in _imports(MODULES[module]):
        if target == FACE or how == "from-face":
            bad.append((line, "imports the face hicache.effects"))
        elif target.startswith(FACE + "."):
            other = _room(target)
            if other != room and other not in ALLOWED[room]:
                bad.append((line, f"imports {target} (room {other}; {room} may import {sorted(ALLOWED[room]) or 'none'})"))
    assert not bad, f"{module}: {bad}"


@pytest.mark.parametrize("module", sorted(m for m in MODULES if not m.startswith(FACE + ".") and m != FACE), ids=str)
def test_nothing_outside_effects_imports_a_room(module):
    """Code outside hicache.effects reaches effects only through its face."""
    bad = [(line, target) for line, target, _ in _imports(MODULES[module]) if target.startswith(FACE + "._")]
    assert not bad, f"{module} reaches into hicache.effects' rooms: {bad} - use the face"


REACH_LIMIT = 85  # the face's names and its sub-faces': 35 + 49 (six modules exported as names reached 110)


def _public(module) -> set[str]:
    """What a caller can reach through ``module``: its attributes without a leading underscore
    (submodules included), ``__future__``'s `annotations` aside."""
    return {name for name in vars(module) if not name.startswith("_") and name != "annotations"}


def test_each_sub_face_reaches_exactly_its_all_and_the_face_counts_what_is_reached():
    """A sub-face (`hicache.effects.arena`, ...) is a real module whose public attributes are
    exactly its ``__all__``, each used outside effects; a caller reaches at most REACH_LIMIT
    names through the face and its sub-faces together (a room exported as a name reached every
    module-level name it had)."""
    import importlib

    import hicache.effects as face

    reach = set(face.__all__)
    outside = "\n".join(p.read_text() for m, p in MODULES.items() if not m.startswith(FACE))
    tests = "\n".join(p.read_text() for p in (ROOT.parent / "tests").glob("*.py"))
    for name in sorted(SUB_FACES):
        sub = importlib.import_module(f"{FACE}.{name}")
        assert getattr(face, name) is sub and name in face.__all__
        assert _public(sub) == set(sub.__all__), (name, _public(sub) ^ set(sub.__all__))
        unused = [n for n in sub.__all__ if f".{n}" not in outside and f".{n}" not in tests and f" {n}" not in tests]
        assert not unused, f"{name} exports what nothing outside effects uses: {unused}"
        reach |= {f"{name}.{n}" for n in sub.__all__}
    assert len(reach) <= REACH_LIMIT, len(reach)


def test_the_reach_rule_sees_a_room_exported_as_a_name():
    """Not vacuous: the admission room's module, which the face once exported as a name, reaches
    more than the sub-face that replaced it (its own helpers and imports)."""
    from hicache.effects import admission
    from hicache.effects._bringup import _admission

    assert _public(_admission) - _public(admission) and len(_public(_admission)) > len(admission.__all__)


def test_the_face_is_small_and_exports_what_it_imports():
    """At most FACE_LIMIT names: ARCHITECTURE's stable API plus what pools, the CLI, compat and
    hicache.testing use; every one of them is used by something outside effects."""
    tree = ast.parse(MODULES[FACE].read_text())
    exported = next(node.value for node in tree.body if isinstance(node, ast.Assign)
                    and getattr(node.targets[0], "id", "") == "__all__")
    names = [element.value for element in exported.elts]
    assert len(names) == len(set(names)) <= FACE_LIMIT, (len(names), names)
    import hicache.effects as face

    assert all(hasattr(face, name) for name in names)
    outside = "\n".join(p.read_text() for m, p in MODULES.items() if not m.startswith(FACE))
    for name in ("CudaPythonRuntime", "apply_plan", "apply_pool_plan", "Registration"):  # ARCHITECTURE's
        assert name in names
    unused = [n for n in names if n not in outside and n not in ("CudaPythonRuntime", "apply_pool_plan")]
    assert not unused, f"exported but used by nothing outside effects: {unused}"


def _graph() -> dict[str, set[str]]:
    graph = {}
    for module, path in MODULES.items():
        graph[module] = {target for _, target, _ in _imports(path) if target in MODULES and target != module}
    return graph


def _cycle(graph) -> list[str] | None:
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(node: str):
        state[node] = 1
        stack.append(node)
        for nxt in sorted(graph[node]):
            if state.get(nxt) == 1:
                return stack[stack.index(nxt):] + [nxt]
            if nxt not in state:
                found = visit(nxt)
                if found:
                    return found
        stack.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state:
            found = visit(node)
            if found:
                return found
    return None


def test_the_package_has_no_import_cycle():
    """Imports inside functions count: a cycle they hold together is still a cycle. A package's
    face importing its own modules is not one (a module never imports its own face here)."""
    cycle = _cycle(_graph())
    assert cycle is None, " -> ".join(cycle)


def test_the_cycle_search_finds_a_cycle():
    """Not vacuous: a planted loop (the one effects had) is found."""
    graph = {"a._memory": {"a._numa"}, "a._numa": {"a._probes"}, "a._probes": {"a._memory"}, "b": set()}
    assert _cycle(graph) == ["a._memory", "a._numa", "a._probes", "a._memory"]


def _bool_checks(path: Path) -> list[int]:
    """Lines of ``isinstance(x, bool)`` (alone or in a tuple): a hand-written integer or number check."""
    lines = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "isinstance" \
                and len(node.args) == 2:
            kinds = node.args[1].elts if isinstance(node.args[1], ast.Tuple) else [node.args[1]]
            if any(isinstance(k, ast.Name) and k.id == "bool" for k in kinds):
                lines.append(node.lineno)
    return lines


@pytest.mark.parametrize("module", sorted(m for m in MODULES if not m.startswith("hicache.plan")), ids=str)
def test_value_checks_live_in_plan_checks_only(module):
    """Outside hicache/plan/ no module writes its own integer or number check (a bool that is not
    a number): they call hicache.plan.checks (check_int, check_real, is_integer, is_real)."""
    assert not _bool_checks(MODULES[module]), f"{module}: isinstance(..., bool) at lines {_bool_checks(MODULES[module])}"


def test_the_value_check_rule_sees_a_check():
    """Not vacuous: the checker module itself is found to hold such checks."""
    assert _bool_checks(MODULES["hicache.plan.checks"])


def _reads_sys_modules(path: Path) -> list[int]:
    return [node.lineno for node in ast.walk(ast.parse(path.read_text()))
            if isinstance(node, ast.Attribute) and node.attr == "modules"
            and isinstance(node.value, ast.Name) and node.value.id == "sys"]


@pytest.mark.parametrize("module", sorted(m for m in MODULES if m.startswith("hicache.pools")), ids=str)
def test_the_pools_see_the_server_only_through_what_compat_hands_them(module):
    """pools/ reads no ``sys.modules`` (the live SGLang process is compat's: `hicache.pools.server()`
    answers what the pools ask) and imports nothing of hicache.compat."""
    assert not _reads_sys_modules(MODULES[module]), f"{module} reads sys.modules at {_reads_sys_modules(MODULES[module])}"
    compat = [(line, target) for line, target, _ in _imports(MODULES[module]) if target.startswith("hicache.compat")]
    assert not compat, f"{module} imports {compat}"


def test_the_sys_modules_rule_sees_a_read():
    """Not vacuous: compat's SGLang process is found to read sys.modules."""
    assert _reads_sys_modules(MODULES["hicache.compat.sglang_process"])


def _server_reads(source: str) -> list[str]:
    """The functions of ``source`` that call the process-wide ``server()`` (under any name it is
    imported as)."""
    tree = ast.parse(source)
    names = {"server"} | {alias.asname for node in ast.walk(tree) if isinstance(node, ast.ImportFrom)
                          for alias in node.names if alias.name == "server" and alias.asname}
    return sorted({function.name for function in ast.walk(tree) if isinstance(function, ast.FunctionDef)
                   for call in ast.walk(function) if isinstance(call, ast.Call)
                   and isinstance(call.func, ast.Name) and call.func.id in names})


#: where the pools read the server handed in: a pool's setup resolves it once when it is built,
#: and SGLang's public `get_allocator_from_storage` asks it when a caller outside a pool gives none
SERVER_READERS = {("hicache.pools._options", "host_setup"), ("hicache.pools._allocator", "get_allocator_from_storage")}


def test_a_pool_asks_the_server_of_its_own_setup():
    """The server's scope comes with `HostSetup` (issue #55 item 3): inside pools/ only the setup's
    resolution (and the public allocator lookup's default) read the process-wide ``server()``;
    the geometry, the chunk setting, the size sync and the budget scope ask the pool's own."""
    readers = {(module, function) for module, path in MODULES.items() if module.startswith("hicache.pools")
               and module != "hicache.pools._server" for function in _server_reads(path.read_text())}
    assert readers == SERVER_READERS, readers


def test_nothing_in_hicache_sets_a_process_wide_server():
    """No process-wide server (issue #55 item 3): no module of hicache calls the deprecated
    `serve_in` - the plug-in scopes the classes it gives SGLang instead (`with_host`)."""
    setters = {(module, function) for module, path in MODULES.items() if module != "hicache.pools._server"
               for function in _calls_of(path, "serve_in")}
    assert not setters, setters


def test_the_process_wide_server_rule_sees_a_call(tmp_path):
    """Not vacuous: ``serve_in(...)`` and ``pools.serve_in(...)`` are found, a mention is not."""
    path = tmp_path / "plugin.py"
    for source, found in (("def load():\n    serve_in(p)\n", ["load"]), ("def load():\n    pools.serve_in(p)\n", ["load"]),
                          ("def load():\n    return serve_in\n", [])):
        path.write_text(source)
        assert _calls_of(path, "serve_in") == found


def test_the_server_rule_sees_a_read():
    """Not vacuous: a call of ``server()``, also under another name, is found."""
    assert _server_reads("from x import server\ndef f():\n    return server().io_backend()\n") == ["f"]
    assert _server_reads("from x import server as s\ndef g():\n    return s()\n") == ["g"]


#: the one place a host pool's constructor form is told apart (and the field tests it uses)
FORM_TABLE = {"hicache.pools._forms", "hicache.pools._sglang_inputs"}
_DETECTORS = {"is_mha_info", "is_mla_info", "is_mamba_info", "is_mla_allocation"}
_FIRST_ARGUMENTS = {"first", "buffer_info", "device_pool", "decl", "anchor", "anchor_host", "pool_name", "args"}


def _form_tests(path: Path) -> list[int]:
    """Lines that test what a constructor's first argument is: a detector call, isinstance or
    hasattr of a first argument (``args[0]`` included), isinstance of `BufferDevice`, or a
    comparison of ``sglang_form``."""
    lines = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Name):
            name = node.func.id
            target = node.args[0] if node.args else None
            target = target.value if isinstance(target, ast.Subscript) else target
            kinds = node.args[1:2]
            if name in _DETECTORS or (name in ("isinstance", "hasattr") and isinstance(target, ast.Name)
                                      and target.id in _FIRST_ARGUMENTS) \
                    or (name == "isinstance" and any("BufferDevice" in ast.dump(k) for k in kinds)):
                lines.append(node.lineno)
        elif isinstance(node, ast.Compare) and "sglang_form" in ast.dump(node):
            lines.append(node.lineno)
    return lines


@pytest.mark.parametrize("module", sorted(m for m in MODULES if m.startswith("hicache.pools") and m not in FORM_TABLE),
                         ids=str)
def test_a_pools_form_is_told_apart_only_in_the_form_table(module):
    """Outside `_forms` (and the description readers it uses) no pools module tests what a
    constructor's first argument is: families ask `form_of`, the base reads the `Form`."""
    assert not _form_tests(MODULES[module]), f"{module}: a form test at lines {_form_tests(MODULES[module])}"


def test_the_form_rule_sees_a_form_test():
    """Not vacuous: the form table itself is found to test first arguments."""
    assert _form_tests(MODULES["hicache.pools._forms"])


#: the register loops: they ask their `_gate.Gate` for pace, readiness and turns (#34 item 6)
GATED = ("hicache.effects._cuda._executor", "hicache.effects._cuda._progressive")


def _turnstile_calls(path: Path) -> list[int]:
    """Lines that call a turnstile themselves: ``.acquire(``, ``.paces(``, ``.budget_bytes(``, a
    turnstile ``.join()``/``.leave()`` or ``_turnstile.resolve(``."""
    names = {"acquire", "paces", "budget_bytes", "resolve"}
    lines = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute):
            owner = ast.dump(node.func.value)
            if node.func.attr in names or ("turnstile" in owner and node.func.attr in ("join", "leave")):
                lines.append(node.lineno)
    return lines


@pytest.mark.parametrize("module", GATED, ids=str)
def test_the_register_loops_ask_their_gate_not_the_turnstile(module):
    """The transaction and the progressive registrar never call the turnstile: their gate paces
    each call, waits for its bytes and for its turn."""
    assert not _turnstile_calls(MODULES[module]), f"{module}: lines {_turnstile_calls(MODULES[module])}"


def test_the_gate_rule_sees_the_gate():
    """Not vacuous: the gate itself is found calling the turnstile."""
    assert _turnstile_calls(MODULES["hicache.effects._cuda._gate"])


#: what a pool adopts from its geometry, once (`_adopt`, which `_come_up` calls: after `_build` made
#: the geometry, or `from_geometry` was handed one)
ADOPTED = {"size", "page_num", "size_per_token", "descriptor", "dtype", "layer_num", "target_layer_num", "start_layer",
           "end_layer", "page_size", "dcp_size", "dcp_rank", "device_capacity_tokens", "device_pool", "layout",
           "geometry", "_pages"}
ADOPTERS = {"_adopt", "_come_up", "init_kv_buffer"}  # _pages: the allocator, made at the bring-up


def _pool_classes() -> set[str]:
    """Names of the host-pool classes and their mixins in pools/ (from HostKVCache's bases on)."""
    classes = {node.name: node for path in (p for m, p in MODULES.items() if m.startswith("hicache.pools"))
               for node in ast.walk(ast.parse(path.read_text())) if isinstance(node, ast.ClassDef)}
    bases = {name: {b.id for b in node.bases if isinstance(b, ast.Name)} for name, node in classes.items()}
    descendants = {"HostKVCache"}
    while more := {name for name, b in bases.items() if b & descendants} - descendants:
        descendants |= more
    return descendants | {b for name in descendants for b in bases[name] if b in classes}  # and their mixins


def _attribute_writes(function, owners: set[str]) -> list[tuple[int, str]]:
    """``(line, attribute)`` of each assignment in ``function`` to an attribute of a name in
    ``owners`` (``self.x =``, ``pool.x +=``, ``self.a, self.b = ...``)."""
    writes = []
    for node in ast.walk(function):
        targets = node.targets if isinstance(node, ast.Assign) else [node.target] if isinstance(
            node, (ast.AugAssign, ast.AnnAssign)) else []
        for target in targets:
            for each in target.elts if isinstance(target, ast.Tuple) else [target]:
                if isinstance(each, ast.Attribute) and isinstance(each.value, ast.Name) and each.value.id in owners:
                    writes.append((node.lineno, each.attr))
    return writes


def _overwrites(path: Path, pool_classes: set[str]) -> list[int]:
    """Lines outside the adopters that assign an adopted field on a pool (``self.`` in a pool
    class, ``pool.`` in a module function taking the pool)."""
    lines = []

    def scan(function, owner: str) -> None:
        if function.name in ADOPTERS:
            return
        lines.extend(line for line, attr in _attribute_writes(function, {owner}) if attr in ADOPTED)

    for node in ast.parse(path.read_text()).body:
        if isinstance(node, ast.ClassDef) and node.name in pool_classes:
            for item in node.body:
                if isinstance(item, ast.FunctionDef):
                    scan(item, "self")
        elif isinstance(node, ast.FunctionDef) and node.args.args and node.args.args[0].arg == "pool":
            scan(node, "pool")
    return lines


@pytest.mark.parametrize("module", sorted(m for m in MODULES if m.startswith("hicache.pools")), ids=str)
def test_a_pools_geometry_is_adopted_once_and_never_written_over(module):
    """What a pool reports (size, pages, bytes a token, layers, its descriptor) is set only where
    it adopts its PoolGeometry - never written over after the bring-up (DSA and V4 once did)."""
    assert not _overwrites(MODULES[module], _pool_classes()), f"{module}: lines {_overwrites(MODULES[module], _pool_classes())}"


def test_the_overwrite_rule_sees_the_adopters_and_every_family():
    """Not vacuous: every family is a pool class, and the base's adopters are found to assign."""
    assert {"MHATokenToKVPoolHost", "DSAIndexerPoolHost", "DeepSeekV4StateHostPool", "MambaPoolHost",
            "MHATokenToKOnlyPoolHost", "ProgressiveMixin"} <= _pool_classes()
    saved = set(ADOPTERS)
    ADOPTERS.clear()
    try:
        assert _overwrites(MODULES["hicache.pools._base"], _pool_classes())
    finally:
        ADOPTERS.update(saved)


#: SGLang's calls on a `HostKVCache`, by concern (issue #55 item 1): each reads every fact of the
#: pool from its ``geometry`` and otherwise only what it declares in its ``NEEDS`` - its part
#: (`POOL_PARTS`) and the live state handed to it
PARTS = {"hicache.pools._slots": "SlotsMixin", "hicache.pools._device_copies": "DeviceCopiesMixin",
         "hicache.pools._progressive": "ProgressiveMixin", "hicache.pools._storage": "StoragePagesMixin",
         "hicache.pools._hisparse": "HiSparseHostPoolMixin"}
#: a pool's facts: what it adopts from its geometry, and what the base derives from them
FACTS = ADOPTED - {"geometry", "_pages"} | {"logical_page_size", "logical_size", "descriptor_class", "family"}


def _part_reads(path: Path, name: str) -> tuple[set[str], tuple]:
    """What class ``name`` of ``path`` reads of ``self`` (``self.x``, ``getattr(self, "x")``)
    beyond its own methods, class attributes and writes - and the ``NEEDS`` it declares."""
    node = next(n for n in ast.walk(ast.parse(path.read_text())) if isinstance(n, ast.ClassDef) and n.name == name)
    own, needs = set(), ()
    for item in node.body:
        if isinstance(item, ast.FunctionDef):
            own.add(item.name)
        for target in item.targets if isinstance(item, ast.Assign) else [item.target] if isinstance(item, ast.AnnAssign) else []:
            if isinstance(target, ast.Name):
                own.add(target.id)
                if target.id == "NEEDS":
                    needs = ast.literal_eval(item.value)
    reads = set()
    for each in ast.walk(node):
        if isinstance(each, ast.Attribute) and isinstance(each.value, ast.Name) and each.value.id == "self":
            (own.add if isinstance(each.ctx, ast.Store) else reads.add)(each.attr)
        elif (isinstance(each, ast.Call) and getattr(each.func, "id", None) == "getattr" and len(each.args) > 1
              and getattr(each.args[0], "id", None) == "self" and isinstance(each.args[1], ast.Constant)):
            reads.add(each.args[1].value)
    return reads - own, needs


@pytest.mark.parametrize("module", sorted(PARTS), ids=str)
def test_each_pool_part_takes_its_facts_from_the_geometry(module):
    """A pool's part (slots, device copies, progressive, L3 pages, HiSparse rows) reads every fact
    of the pool - page, layers, layout, sizes, DCP, device - from its ``geometry``, and of the rest
    only the live state its ``NEEDS`` declares: no implicit attribute shared between parts."""
    reads, needs = _part_reads(MODULES[module], PARTS[module])
    assert reads - {"geometry"} <= set(needs), f"{PARTS[module]} reads undeclared {sorted(reads - {'geometry'} - set(needs))}"
    assert not set(needs) & FACTS, f"{PARTS[module]} declares facts {sorted(set(needs) & FACTS)}: read them from the geometry"
    assert set(needs) <= reads, f"{PARTS[module]} declares {sorted(set(needs) - reads)} it never reads"


#: the parts a pool is made of (issue #55 item 1): objects made with the pool's geometry given
#: explicitly (and the rest they use, each by name), holding no pool
POOL_PARTS = {"hicache.pools._device_copies": "DeviceCopies", "hicache.pools._storage": "L3Pages",
              "hicache.pools._zero_copy": "PagePointers", "hicache.pools._progressive": "ProgressivePages"}
#: names a part may not take or keep: the pool itself, under any name
_POOL_NAMES = {"pool", "owner", "host_pool", "parent"}


def _part_shape(path: Path, name: str) -> tuple[list[str], set[str]]:
    """Class ``name`` of ``path``: its ``__init__``'s parameters, and the pool-like names it
    takes or reads (a parameter, or ``self.<name>``, in `_POOL_NAMES`)."""
    node = next(n for n in ast.walk(ast.parse(path.read_text())) if isinstance(n, ast.ClassDef) and n.name == name)
    init = next(item for item in node.body if isinstance(item, ast.FunctionDef) and item.name == "__init__")
    params = [a.arg for a in init.args.args[1:] + init.args.kwonlyargs]
    pools = {p for p in params if p in _POOL_NAMES}
    pools |= {each.attr for each in ast.walk(node) if isinstance(each, ast.Attribute) and each.attr in _POOL_NAMES
              and isinstance(each.value, ast.Name) and each.value.id == "self"}
    return params, pools


@pytest.mark.parametrize("module", sorted(POOL_PARTS), ids=str)
def test_each_part_is_made_with_the_geometry_and_holds_no_pool(module):
    """A pool's part (its copies, L3 pages, zero-copy pointers, progressive pages) is an object
    made with the pool's ``geometry`` given explicitly, and with no pool: what else it uses is
    handed to it by name, so no attribute is shared with the pool behind its back."""
    params, pools = _part_shape(MODULES[module], POOL_PARTS[module])
    assert "geometry" in params, f"{POOL_PARTS[module]}.__init__{tuple(params)} takes no geometry"
    assert not pools, f"{POOL_PARTS[module]} takes or keeps the pool as {sorted(pools)}"


def test_the_part_rule_sees_a_pool_and_a_missing_geometry(tmp_path):
    """Not vacuous: a part made with the pool, or keeping it, or taking no geometry, is found."""
    part = tmp_path / "part.py"
    part.write_text("class P:\n    def __init__(self, pool, geometry):\n        self.g = geometry\n")
    assert _part_shape(part, "P") == (["pool", "geometry"], {"pool"})
    part.write_text("class P:\n    def __init__(self, name):\n        self.n = name\n    def f(self):\n"
                    "        return self.owner\n")
    assert _part_shape(part, "P") == (["name"], {"owner"})


def test_the_parts_rule_sees_an_implicit_fact(tmp_path):
    """Not vacuous: a part that reads ``self.page_size``, or declares it, fails the rule."""
    part = tmp_path / "part.py"
    part.write_text("class P:\n    NEEDS = ('lock',)\n    def f(self):\n        return self.lock, self.page_size\n")
    reads, needs = _part_reads(part, "P")
    assert reads - {"geometry"} - set(needs) == {"page_size"}
    part.write_text("class P:\n    NEEDS = ('page_size',)\n    def f(self):\n        return self.page_size\n")
    assert set(_part_reads(part, "P")[1]) & FACTS == {"page_size"}


def _face_only(source: str) -> list[str]:
    """What a face module holds beyond its docstring, imports and ``__all__``: each statement's
    kind and name (an empty list: it is only a face)."""
    extra = []
    for node in ast.parse(source).body:
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            continue
        if (isinstance(node, ast.If) and ast.unparse(node.test) == "TYPE_CHECKING" and not node.orelse
                and all(isinstance(inner, (ast.Import, ast.ImportFrom)) for inner in node.body)):
            continue  # imports for type checkers only (tests/test_typing.py)
        if isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant) and isinstance(node.value.value, str):
            continue  # the docstring
        if isinstance(node, ast.Assign) and [getattr(t, "id", None) for t in node.targets] == ["__all__"]:
            continue
        name = getattr(node, "name", None) or (ast.unparse(node.targets[0]) if isinstance(node, ast.Assign)
                                               else ast.unparse(node))
        extra.append(f"{type(node).__name__} {name}")
    return extra


#: package faces that hold more than imports, and why (each statement is named: none may be added)
FACE_EXTRAS = {
    "hicache": (["Assign __version__"], "the version, which the build reads"),
    "hicache.plan": (["Assign _HOMES", "FunctionDef __getattr__", "FunctionDef __dir__"],
                     "PEP 562 lazy names: `hicache plan` imports only the modules it runs (issue #35 item 4)"),
    "hicache.pools": (["Expr require('torch', 'hicache.pools')"], "the torch requirement, named before anything imports it"),
}


@pytest.mark.parametrize("package", sorted(m for m, p in MODULES.items() if p.name == "__init__.py"), ids=str)
def test_every_packages_init_is_only_a_face(package):
    """A package's ``__init__`` only imports and names what callers reach (issue #55 items 4 and
    5: the store and the test support included); code lives in the package's modules. The three
    exceptions are named, with why."""
    assert _face_only(MODULES[package].read_text()) == FACE_EXTRAS.get(package, ([], ""))[0]


def test_the_face_rule_sees_code():
    """Not vacuous: a class, a function or an alias assignment in a face is found, and so is code
    beside the imports of an ``if TYPE_CHECKING:`` block (imports alone there are a face's)."""
    source = '"""doc."""\nimport x\n__all__ = ["a"]\na = x.a\ndef f():\n    pass\nclass C:\n    pass\n'
    assert _face_only(source) == ["Assign a", "FunctionDef f", "ClassDef C"]
    checkers_only = "if TYPE_CHECKING:\n    from x import a as a\n"
    assert _face_only(checkers_only) == [] and _face_only(checkers_only + "    b = 1\n") == [f"If {checkers_only}    b = 1"]


def _package_of(module: str) -> str:
    return ".".join(module.split(".")[:2])


def _private_crossings(path: Path, module: str) -> list[str]:
    """``from hicache.<a>._x import ...`` in ``module`` of another package: a reach past a face."""
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and not node.level and (node.module or "").startswith("hicache."):
            parts = node.module.split(".")
            if any(part.startswith("_") for part in parts[2:]) and _package_of(node.module) != _package_of(module):
                found.append(f"{module} -> {node.module}")
    return found


#: the reaches past another package's face that remain, and why (issue #55 item 5: 30 before the
#: plan's sub-faces; none may be added)
CROSSINGS = {
    "hicache.compat.sglang -> hicache.pools._range_records": "RANGES_ATTR: SGLang's own attribute name, which the pools "
                                                     "write and its helpers read; not a name for hicache's callers",
}


def test_packages_reach_each_other_through_faces():
    """A package imports another's public face or sub-faces (`hicache.plan.settings`,
    `store_format`, `transfer`, `thp`; effects' own), never its private modules - the one
    exception named, with why."""
    found = [c for m, p in MODULES.items() for c in _private_crossings(p, m)]
    assert sorted(found) == sorted(CROSSINGS), sorted(set(found) ^ set(CROSSINGS))


def test_the_crossing_rule_sees_a_reach(tmp_path):
    """Not vacuous: a module of the CLI importing plan's private ``_env`` is found; its own
    package's private module is not a crossing."""
    path = tmp_path / "cli.py"
    path.write_text("from hicache.plan._env import env_value\nfrom hicache.cli._render import table\n")
    assert _private_crossings(path, "hicache.cli._x") == ["hicache.cli._x -> hicache.plan._env"]


TESTS = Path(__file__).resolve().parent
#: the tests' imports that reach into effects' rooms (issue #55 item 5: they were 146 before the
#: names the faces export came from the faces); a test of a room's own internals may, but the
#: count only shrinks - lower it when a reach goes
ROOM_REACHES_LIMIT = 97


def _room_reaches(source: str) -> int:
    """Imports of ``hicache.effects._<room>`` (or of a room from the face) in one module."""
    count = 0
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("hicache.effects._"):
            count += 1
        elif isinstance(node, ast.ImportFrom) and node.module == FACE:
            count += sum(1 for alias in node.names if alias.name.startswith("_"))
        elif isinstance(node, ast.Import):
            count += sum(1 for alias in node.names if alias.name.startswith("hicache.effects._"))
    return count


def test_the_tests_reach_into_effects_rooms_no_more_than_before():
    """The tests import what effects' faces export from the faces; the reaches into its rooms
    that remain (a room's own internals under test) never grow past ROOM_REACHES_LIMIT."""
    reaches = sum(_room_reaches(path.read_text()) for path in TESTS.glob("*.py"))
    assert reaches <= ROOM_REACHES_LIMIT, f"{reaches} imports reach into hicache.effects' rooms (limit {ROOM_REACHES_LIMIT})"


def test_the_reach_count_sees_each_kind():
    """Not vacuous: a room's module imported from, a room imported from the face, and a room
    imported whole are each counted; the face itself is not."""
    source = ("from hicache.effects._host._memory import allocate_host\nfrom hicache.effects import _trace, HostSetup\n"
              "import hicache.effects._copy._engine as engine\nfrom hicache.effects import bring_up\n")
    assert _room_reaches(source) == 3


MAX_LINES = 400  # a module past this holds more than one charter (issue #34)
#: The modules still past it, and why (each shrinks with the item of #34 named; none may grow).
OVER_MAX = {
    "hicache.effects._hostwide._turnstile": (469, "tickets, pacing and the wait histogram in one file: #34 item 6's gate splits pacing off"),
    "hicache.effects._host._memory": (430, "mapping, hugepage choice and pre-fault: #34 item 5's host set-up takes the hugepage choice"),
}


@pytest.mark.parametrize("module", sorted(MODULES), ids=str)
def test_modules_stay_small(module):
    """No module is over MAX_LINES lines, except the few named in OVER_MAX - and those never grow."""
    lines = len(MODULES[module].read_text().splitlines())
    limit = OVER_MAX.get(module, (MAX_LINES, ""))[0]
    assert lines <= limit, f"{module}: {lines} lines, over {limit}" + (f" ({OVER_MAX[module][1]})" if module in OVER_MAX else "")


def test_the_exemptions_from_the_size_rule_are_still_needed():
    """Not stale: every module OVER_MAX names is still past MAX_LINES (else its entry goes)."""
    assert all(len(MODULES[m].read_text().splitlines()) > MAX_LINES for m in OVER_MAX)


def test_the_plan_packages_names_all_resolve_and_load_only_their_own_module():
    """hicache.plan's names load on first use (issue #35 item 4): every name of __all__ has a
    home and resolves to that module's object, an unknown name is an AttributeError naming it,
    and `hicache plan`'s start does not load the store's planner, the budget check (no host
    figure given), nor the layout classes of the families its model does not use (the default
    preset is MHA; a fresh process tells)."""
    import importlib
    import subprocess
    import sys

    import hicache.plan as plan

    assert set(plan.__all__) == set(plan._HOMES)
    for name, home in plan._HOMES.items():
        assert getattr(plan, name) is getattr(importlib.import_module(home), name), name
    with pytest.raises(AttributeError, match="'no_such_name'"):
        plan.no_such_name  # noqa: B018
    code = ("import sys, io, contextlib\nfrom hicache.cli import main\n"
            "with contextlib.redirect_stdout(io.StringIO()):\n    main(['plan', '--format', 'json'])\n"
            "print(sorted(m for m in sys.modules if m.startswith('hicache.plan.')))")
    loaded = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True)
    assert "hicache.plan._store" not in loaded.stdout and "hicache.plan._layouts'" in loaded.stdout, loaded.stdout
    assert "hicache.plan._layouts_mha'" in loaded.stdout, loaded.stdout
    assert not {"_budget", "_layouts_kv_split", "_layouts_mla", "_layouts_state"} & set(loaded.stdout.replace("'", " ").replace(
        "hicache.plan.", " ").split()), loaded.stdout


def test_the_layout_classes_table_names_each_family_by_its_own_class():
    """LAYOUT_CLASSES (loaded family by family) maps every family of LAYOUT_RULES to the class
    whose ``family`` it is, answers `in` and an unknown family as a dict does, and plan_pool
    refuses what is not exactly one of those classes (a subclass of one included)."""
    from hicache.errors import LayoutError
    from hicache.plan import LAYOUT_CLASSES, LAYOUT_RULES, Limits, MHALayout, plan_pool

    assert list(LAYOUT_CLASSES) == list(LAYOUT_RULES) and len(LAYOUT_CLASSES) == len(LAYOUT_RULES)
    for family, cls in LAYOUT_CLASSES.items():
        assert cls.family == family and cls.__name__.endswith("Layout"), family
    assert "mla" in LAYOUT_CLASSES and "nope" not in LAYOUT_CLASSES
    with pytest.raises(KeyError):
        LAYOUT_CLASSES["nope"]

    class Imitation(MHALayout):
        pass

    fields = dict(layer_num=2, head_num=2, head_dim=8, page_size=4, page_num=4, itemsize=2)
    plan_pool(MHALayout("page_first", **fields), Limits(chunk_limit_bytes=2**30))
    with pytest.raises(LayoutError, match="layout must be one of"):
        plan_pool(Imitation("page_first", **fields), Limits(chunk_limit_bytes=2**30))


def _catch_alls(path: Path, names: set[str]) -> list[str]:
    """The functions of ``path`` named in ``names`` that take ``**keywords``."""
    return [node.name for node in ast.walk(ast.parse(path.read_text()))
            if isinstance(node, ast.FunctionDef) and node.name in names and node.args.kwarg is not None]


def _parameters(path: Path, name: str) -> tuple[list[str], list[str]]:
    """The positional and the keyword-only parameters of function ``name`` in ``path``."""
    node = next(n for n in ast.walk(ast.parse(path.read_text())) if isinstance(n, ast.FunctionDef) and n.name == name)
    return [a.arg for a in node.args.posonlyargs + node.args.args], [a.arg for a in node.args.kwonlyargs]


#: `bring_up`'s one door per concern (issue #55 item 2): the requests, then how (``mode``), the
#: host's pieces (``host``, allocator included), how it is reported (``report``) and whether it is
#: budgeted (``budget``) - each a value with its own fields, so a new feature adds a field there
BRING_UP_DOORS = (["requests"], ["mode", "host", "report", "budget"])


def test_bring_up_has_one_door_per_concern_and_no_catch_all():
    """`bring_up` names every keyword it takes and takes no other (issue #55 items 2 and 6): the
    host's pieces come in ``host=``, the report's in ``report=``, dtypes and registration in the
    requests; no ``**keywords`` and none of the legacy keywords that spelt them one by one."""
    path = MODULES["hicache.effects._bringup._bring_up"]
    assert not _catch_alls(path, {"bring_up"})
    assert _parameters(path, "bring_up") == BRING_UP_DOORS


def test_the_bring_up_doors_rule_sees_a_legacy_keyword(tmp_path):
    """Not vacuous: a `bring_up` with one of its old keywords beside the four doors fails the rule."""
    legacy = tmp_path / "legacy.py"
    legacy.write_text("def bring_up(requests, /, *, mode=None, host=None, report=None, budget=True,\n"
                      "             allocator=None):\n    pass\n")
    assert _parameters(legacy, "bring_up") != BRING_UP_DOORS


def test_the_catch_all_rule_sees_one():
    """Not vacuous: the constructors that tell two SGLang signatures apart by their arguments
    (K-only's anchor or device pool, DSA's declaration, V4's pool name) still take ``**kwargs``."""
    assert _catch_alls(MODULES["hicache.pools._v4_pools"], {"__init__"})


#: the constructors that name every keyword they take (SGLang's signature, then hicache's
#: ``device_pool=``, ``page_num=``, ``options=``, ``host=``): the base's older form, the MHA pair's,
#: MLA's and Mamba's. K-only, DSA and V4 serve two SGLang signatures that differ in their
#: positional arguments, so they tell the form apart first and bind the call once to one of
#: these, or through `_forms.build_form` to a form's own builder that names every argument
#: (`test_a_forms_builder_names_every_argument`).
EXACT = {"hicache.pools._base": "HostKVCache", "hicache.pools._mha": "_MHAForms",
         "hicache.pools._mla": "MLATokenToKVPoolHost", "hicache.pools._mamba": "MambaPoolHost"}


def _catch_all_inits(path: Path, owner: str) -> list[str]:
    """``owner.__init__`` in ``path`` if it takes ``**keywords``."""
    return [f"{owner}.__init__" for node in ast.walk(ast.parse(path.read_text()))
            if isinstance(node, ast.ClassDef) and node.name == owner
            for item in node.body if isinstance(item, ast.FunctionDef) and item.name == "__init__"
            and item.args.kwarg is not None]


@pytest.mark.parametrize("module", sorted(EXACT), ids=str)
def test_a_pool_constructor_names_every_keyword_it_takes(module):
    """No ``**keywords`` on `HostKVCache` or a family with one SGLang signature (issue #55 items 2
    and 6): the signature says every name (31 once went through a catch-all), so a misspelt one
    is Python's own TypeError and tools read the real parameters."""
    assert "def __init__(" in MODULES[module].read_text()
    assert not _catch_all_inits(MODULES[module], EXACT[module])


def test_the_named_keywords_rule_sees_a_catch_all(tmp_path):
    """Not vacuous: a ``**kwargs`` on the named class's constructor is found, another class's is not."""
    path = tmp_path / "pool.py"
    path.write_text("class HostKVCache:\n    def __init__(self, a, **keywords):\n        pass\n\n"
                    "class Other:\n    def __init__(self, **kw):\n        pass\n")
    assert _catch_all_inits(path, "HostKVCache") == ["HostKVCache.__init__"]
    assert _catch_all_inits(path, "Missing") == []


def _budget_calls(path: Path) -> list[str]:
    """The functions of ``path`` that call hicache.plan's `check_budget` (the budget's verdict)."""
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.FunctionDef):
            for call in ast.walk(node):
                if isinstance(call, ast.Call) and getattr(call.func, "id", getattr(call.func, "attr", None)) == "check_budget":
                    found.append(node.name)
    return found


def test_the_host_budget_admits_in_one_place():
    """One admission entry (issue #55 items 3 and 6): outside hicache.plan only `check_admission`
    asks the budget's verdict, and only the one admission (`_hostwide._claim.claim`) asks it - a
    pool's bring-up, the node store's creation and SGLang's hooks all claim through it (the
    store re-did the arithmetic before, the pools booked a server's scope on their own)."""
    callers = {(module, function) for module, path in MODULES.items() if not module.startswith("hicache.plan")
               for function in _budget_calls(path)}
    assert callers == {("hicache.effects._hostwide._claim", "check_admission")}, callers
    askers = {(module, function) for module, path in MODULES.items()
              for function in _calls_of(path, "check_admission")}
    assert askers == {("hicache.effects._hostwide._claim", "claim")}, askers
    recorders = {(module, function) for module, path in MODULES.items() if module != "hicache.effects._hostwide._lock"
                 for function in _calls_of(path, "record", on="lock")}
    assert recorders == {("hicache.effects._hostwide._claim", "claim")}, recorders


def _calls_of(path: Path, name: str, *, on: str | None = None) -> list[str]:
    """The functions of ``path`` that call ``name`` (a plain or an attribute call; ``on``: only
    as an attribute of something whose source mentions it, e.g. ``lock.record``)."""
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.FunctionDef):
            for call in ast.walk(node):
                if isinstance(call, ast.Call) and getattr(call.func, "id", getattr(call.func, "attr", None)) == name \
                        and (on is None or isinstance(call.func, ast.Attribute) and on in ast.unparse(call.func.value)):
                    found.append(node.name)
    return found


def test_the_admission_rule_sees_a_call():
    """Not vacuous: the rule finds the verdict in check_admission and the claim's record in claim."""
    assert _budget_calls(MODULES["hicache.effects._hostwide._claim"]) == ["check_admission"]
    assert "claim" in _calls_of(MODULES["hicache.effects._hostwide._claim"], "record", on="lock")
    assert not _calls_of(MODULES["hicache.effects._hostwide._claim"], "record", on="ledger")


def _pool_parameters(source: str) -> list[str]:
    """Functions of ``source`` that take a pool (a parameter named ``pool`` or ``self``) or read a
    name ``pool``: what a pure geometry builder may not do."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.FunctionDef) and node.name == "make_geometry":
            names = [a.arg for a in (*node.args.posonlyargs, *node.args.args, *node.args.kwonlyargs)]
            found += [f"{node.name}({name})" for name in names if name in ("pool", "self")]
            found += [f"{node.name}: reads {n.id}" for n in ast.walk(node) if isinstance(n, ast.Name) and n.id == "pool"]
    return found


def test_the_geometry_is_made_without_the_pool():
    """`make_geometry` takes no pool and reads none (issue #55 items 1 and 6): the family's
    `Shape` over its device view says everything the geometry needs, so nothing is asked of a
    half-built pool (it once called 7-9 hooks on it and wrote 11 fields first)."""
    source = MODULES["hicache.pools._geometry"].read_text()
    assert "def make_geometry(" in source
    assert not _pool_parameters(source), _pool_parameters(source)


def test_the_no_pool_rule_sees_a_pool():
    """Not vacuous: the old signature, and a pool read from a closure, are both found."""
    assert _pool_parameters("def make_geometry(pool, form, view, sizing, layout):\n    return pool.x\n")
    assert _pool_parameters("def make_geometry(owner, shape):\n    return pool.layout_descriptor(1)\n")


def _writes_around_build(path: Path) -> list[int]:
    """Lines, in a function that calls ``_build`` (a family's constructor), that assign an
    attribute of ``self`` or ``pool`` or ``setattr`` one - before or after the call: the pool
    takes every field from its geometry (`Shape.fields`), in `_adopt`."""
    lines = []
    for function in ast.walk(ast.parse(path.read_text())):
        if not isinstance(function, ast.FunctionDef) or function.name in ADOPTERS:
            continue
        calls = [n for n in ast.walk(function) if isinstance(n, ast.Call) and getattr(n.func, "attr", None) == "_build"]
        if not calls:
            continue
        lines.extend(line for line, _ in _attribute_writes(function, {"self", "pool"}))
        for node in ast.walk(function):
            if isinstance(node, ast.Call) and getattr(node.func, "id", None) == "setattr" and node.args \
                    and isinstance(node.args[0], ast.Name) and node.args[0].id in ("self", "pool"):
                lines.append(node.lineno)
    return lines


@pytest.mark.parametrize("module", sorted(m for m in MODULES if m.startswith("hicache.pools")), ids=str)
def test_a_family_constructor_writes_no_pool_field(module):
    """No pool field is assigned around ``_build`` (issue #55 items 1 and 6): a family's
    constructor binds SGLang's call into a shape and a sizing and builds; its SGLang-facing
    fields (MHA's ``head_num``, DSA's ``indexer_layout_dim``, V4's ``pool_name``) come in the
    geometry (MLA, DSA, Mamba and V4 once set them after the bring-up)."""
    assert not _writes_around_build(MODULES[module]), f"{module}: lines {_writes_around_build(MODULES[module])}"


def test_the_constructor_write_rule_sees_a_write(tmp_path):
    """Not vacuous: a write after ``_build``, one before it and a ``setattr`` are all found."""
    path = tmp_path / "family.py"
    path.write_text("class P:\n    def __init__(self, v):\n        self.a = 1\n        self._build(v)\n"
                    "        setattr(self, 'b', 2)\n\n"
                    "def _init_from(pool, v):\n    pool._build(v)\n    pool.c = 3\n")
    assert sorted(_writes_around_build(path)) == [3, 5, 9]


def _form_builders(source: str) -> dict[str, bool]:
    """The builders a family's ``builders = {form: builder}`` lists in ``source``, each with
    whether it takes ``**keywords``: a function defined there, or ``Class.__init__`` of an exact
    constructor (`EXACT`); anything else counts as a catch-all (its signature is unchecked)."""
    tree = ast.parse(source)
    defined = {node.name: node.args.kwarg is not None for node in ast.walk(tree) if isinstance(node, ast.FunctionDef)}
    exact = set(EXACT.values())
    listed = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.Assign) and [getattr(t, "id", None) for t in node.targets] == ["builders"]:
            for value in node.value.values if isinstance(node.value, ast.Dict) else [node.value]:
                if isinstance(value, ast.Name):
                    listed[value.id] = defined.get(value.id, True)
                elif isinstance(value, ast.Attribute) and value.attr == "__init__" and isinstance(value.value, ast.Name):
                    listed[f"{value.value.id}.__init__"] = value.value.id not in exact
                else:
                    listed[ast.unparse(value)] = True
    return listed


@pytest.mark.parametrize("module", ["hicache.pools._mha", "hicache.pools._mla", "hicache.pools._v4_pools"], ids=str)
def test_a_forms_builder_names_every_argument(module):
    """SGLang's call is bound once against its form's own signature (issue #55 item 1): every
    builder a dispatching family lists (`_forms.dispatch` binds the call to it) is defined in
    its module and names every argument, or is an exact constructor's ``__init__`` - no
    ``**keywords`` to sort by hand (K-only's once was a hand-written parser)."""
    builders = _form_builders(MODULES[module].read_text())
    assert builders and not [name for name, catch_all in builders.items() if catch_all], builders


def test_the_form_builder_rule_sees_a_catch_all():
    """Not vacuous: a builder with ``**kwargs``, one not defined in the module, a lambda and the
    ``__init__`` of a class that is not an exact constructor are all found."""
    source = ("def _a(pool, x, **kw):\n    pass\n\n"
              "class P:\n    builders = {F: _a, G: _elsewhere, H: lambda *a: None, I: Other.__init__,\n"
              "                J: HostKVCache.__init__}\n")
    assert _form_builders(source) == {"_a": True, "_elsewhere": True, "lambda *a: None": True,
                                      "Other.__init__": True, "HostKVCache.__init__": False}
