"""The package as users get it: the built wheel in a fresh virtualenv *without* torch or
cuda-python runs `hicache plan` and `hicache doctor`, and the pools say which extra they need;
the sdist carries what its own tests and readers need. Offline: the fresh environment borrows
only attrs, cattrs, psutil (and their dependencies) from this one."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
import tarfile
import venv
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
LIGHT = ("attr", "attrs", "cattrs", "psutil", "typing_extensions", "exceptiongroup")


def _build(kind: str, out: Path) -> Path:
    pytest.importorskip("setuptools")
    if kind == "wheel":
        cmd = [sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation", "-w", str(out), str(ROOT)]
    else:
        cmd = [sys.executable, "-c", "import sys, setuptools; sys.argv = ['setup.py', '-q', 'sdist', '-d', sys.argv[1]];"
               " exec(open('setup.py').read())", str(out)]
    subprocess.run(cmd, check=True, cwd=ROOT, capture_output=True, text=True, timeout=300)
    (built,) = out.glob("*.whl" if kind == "wheel" else "*.tar.gz")
    return built


def _borrowing_venv(tmp_path: Path, modules, *, paths=(), with_pip: bool = False) -> Path:
    """A fresh virtualenv (offline) that sees ``modules`` of this environment (top-level import
    names, symlinked; names not installed here are left out) and ``paths``; its python."""
    borrowed = tmp_path / "borrowed"
    borrowed.mkdir()
    for name in modules:
        spec = importlib.util.find_spec(name)
        if spec is None or (spec.origin is None and not spec.submodule_search_locations):
            continue
        source = Path(spec.submodule_search_locations[0]) if spec.submodule_search_locations else Path(spec.origin)
        if not (borrowed / source.name).exists():
            (borrowed / source.name).symlink_to(source)
    for path in paths:  # a directory as it is (metadata, a checkout)
        if not (borrowed / path.name).exists():
            (borrowed / path.name).symlink_to(path.resolve())
    env_dir = tmp_path / "fresh"
    venv.create(env_dir, with_pip=with_pip)
    python = env_dir / "bin" / "python"
    site = subprocess.run([str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                          capture_output=True, text=True, check=True).stdout.strip()
    Path(site, "borrowed.pth").write_text(str(borrowed) + "\n")
    return python


def test_the_wheel_without_torch_plans_and_checks(tmp_path):
    """The built wheel in a fresh environment without torch plans and runs the doctor, and torch
    stays out."""
    wheel = _build("wheel", tmp_path / "dist")
    python = _borrowing_venv(tmp_path, LIGHT, with_pip=True)
    # without PYTHONPATH: where it names a hicache tree pip would take that as installed and skip the wheel
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    subprocess.run([str(python), "-m", "pip", "install", "-q", "--no-deps", "--no-index", str(wheel)],
                   check=True, capture_output=True, text=True, timeout=300, env=env)
    hicache = python.parent / "hicache"
    check = [str(python), "-c", "import importlib.util as u, sys; sys.exit(any(u.find_spec(m) for m in ('torch', 'cuda')))"]
    assert subprocess.run(check, env=env, cwd=tmp_path).returncode == 0, "torch leaked into the fresh environment"
    plan = subprocess.run([str(hicache), "plan", "--format", "json"], capture_output=True, text=True, env=env, cwd=tmp_path)
    assert plan.returncode == 0 and '"kind": "capacity"' in plan.stdout, plan.stderr
    doctor = subprocess.run([str(hicache), "doctor"], capture_output=True, text=True, env=env, cwd=tmp_path)
    assert doctor.returncode in (0, 1) and "Traceback" not in doctor.stderr, doctor.stderr
    assert "cuda" in doctor.stdout and "cuda-python cannot be imported" in doctor.stdout
    pools = subprocess.run([str(python), "-c", "import hicache.pools"], capture_output=True, text=True, env=env, cwd=tmp_path)
    assert pools.returncode == 1 and 'pip install "hicache[cuda]"' in pools.stderr
    apply = subprocess.run([str(hicache), "apply"], capture_output=True, text=True, env=env, cwd=tmp_path)
    assert apply.returncode == 2 and apply.stderr.startswith("error[missing-extra]"), apply.stderr


def test_the_sdist_carries_docs_license_and_test_helpers(tmp_path):
    """The sdist holds the docs, the license and the tests' helper modules."""
    sdist = _build("sdist", tmp_path / "dist")
    with tarfile.open(sdist) as archive:
        names = {name.split("/", 1)[1] for name in archive.getnames() if "/" in name}
    for needed in ("LICENSE", "CHANGELOG.md", "README.md", "docs/sglang.md", "docs/json.md", "hicache/py.typed",
                   "tests/conftest.py", "tests/machine.py", "tests/strategies.py", "tests/rank_child.py",
                   "tests/transfer_fuzz_child.py", "tests/golden/llama-3.1-70b-tp8.txt",
                   "hicache/effects/_copy/_hostcopy.c", "hicache/pools/_pagestack.c", "setup.py", "constraints-dev.txt", "constraints-floors.txt",
                   "requirements-sglang.txt"):
        assert needed in names, needed


def _project() -> dict:
    tomllib = pytest.importorskip("tomllib", reason="reading pyproject.toml needs Python 3.11's tomllib")
    return tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]


def test_the_floors_file_pins_exactly_the_lowest_version_each_requirement_admits():
    """constraints-floors.txt (`make test-floors`) pins, for every requirement of pyproject.toml -
    the dependencies and every extra - the version its `>=` admits first, and nothing else: a
    floor raised in one file and not the other fails here."""
    from packaging.requirements import Requirement
    from packaging.utils import canonicalize_name

    project = _project()
    requirements = list(project["dependencies"]) + [r for extra in project["optional-dependencies"].values()
                                                     for r in extra]
    floors = {}
    for requirement in map(Requirement, requirements):
        lowest = [spec.version for spec in requirement.specifier if spec.operator == ">="]
        assert len(lowest) == 1, f"{requirement}: one >= floor expected"
        floors[canonicalize_name(requirement.name)] = lowest[0]
    pinned = {}
    for line in (ROOT / "constraints-floors.txt").read_text().splitlines():
        if line.strip() and not line.startswith("#"):
            name, _, version = line.partition("==")
            pinned[canonicalize_name(name)] = version.strip()
    assert set(pinned) == set(floors), set(pinned) ^ set(floors)
    from packaging.version import Version

    assert all(Version(pinned[name]) == Version(floors[name]) for name in floors), \
        {n: (pinned[n], floors[n]) for n in floors if Version(pinned[n]) != Version(floors[n])}


def _readme_requirements() -> list[str]:
    """What the README's `make test` installs: pyproject's dependencies and the extras the
    Makefile's install line names (read from both files, so neither can drift from this test)."""
    import re

    project = _project()
    extras = re.search(r"-e '\.\[([a-z,]+)\]'", (ROOT / "Makefile").read_text())[1].split(",")
    return list(project["dependencies"]) + [r for extra in extras for r in project["optional-dependencies"][extra]]


def _closure(requirements: list[str]):
    """The installed distributions those requirements pull in (markers evaluated, no extras)."""
    import importlib.metadata as metadata

    from packaging.requirements import Requirement

    seen: dict = {}
    todo = [Requirement(r) for r in requirements]
    while todo:
        requirement = todo.pop()
        if requirement.marker is not None and not requirement.marker.evaluate({"extra": ""}):
            continue
        name = requirement.name.lower().replace("_", "-")
        if name in seen:
            continue
        seen[name] = dist = metadata.distribution(requirement.name)  # installed here by `make test`
        todo += [Requirement(r) for r in dist.requires or []]
    return seen


def _fresh_env(tmp_path: Path, requirements: list[str]) -> tuple[Path, dict]:
    """A fresh virtualenv holding hicache (as make test's editable install has it: the checkout
    on the path) and exactly the installed distributions ``requirements`` pull in, metadata
    included (pytest finds its plugins - hypothesis, xdist - by entry points); its python and
    an environment without this one's PYTHONPATH or CI's SGLang requirement."""
    import importlib.metadata as metadata

    dists = _closure(requirements)
    modules = [top for top, owners in metadata.packages_distributions().items()
               if {o.lower().replace("_", "-") for o in owners} & set(dists)]
    metadata_dirs = [Path(str(d._path)) for d in dists.values() if Path(str(d._path)).is_dir()]
    python = _borrowing_venv(tmp_path, modules, paths=metadata_dirs)
    site = subprocess.run([str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                          capture_output=True, text=True, check=True).stdout.strip()
    Path(site, "checkout.pth").write_text(f"{ROOT}\n")
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "HICACHE_REQUIRE_SGLANG")}
    # its own host-wide runtime directory: a pool of another test worker claims memory in the
    # shared one, and a stated room for one rank (--ranks-per-host 1) then refuses this run
    runtime = tmp_path / "runtime"
    runtime.mkdir(mode=0o700)
    env["HICACHE_RUNTIME_DIR"] = str(runtime)
    return python, env


def test_the_readme_environment_alone_collects_every_test_module(tmp_path):
    """A new user's `make test` environment - hicache and exactly what pyproject's dependencies
    and the Makefile's extras pull in, nothing of `make sglang` - imports every test module
    (collection succeeds, no error for a missing package), and every package any test imports
    anywhere (inside test functions too) is there, but for SGLang's and Mooncake's, whose tests
    skip naming `make sglang`."""
    import ast
    import json

    python, env = _fresh_env(tmp_path, _readme_requirements())
    imported = set()
    for path in sorted((ROOT / "tests").glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                imported |= {a.name.split(".")[0] for a in node.names}
            elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                imported.add(node.module.split(".")[0])
    local = {p.stem for p in (ROOT / "tests").glob("*.py")}
    probe = ("import importlib.util, json, sys; names = json.loads(sys.argv[1]); "
             "print(json.dumps(sorted(n for n in names if importlib.util.find_spec(n) is None)))")
    missing = subprocess.run([str(python), "-c", probe, json.dumps(sorted(imported - local))], capture_output=True,
                             text=True, env=env, cwd=tmp_path, check=True)
    assert "sglang" in json.loads(missing.stdout)  # the environment really is a new user's
    assert set(json.loads(missing.stdout)) <= {"sglang", "mooncake"}, missing.stdout
    collect = subprocess.run([str(python), "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider"],
                             capture_output=True, text=True, env=env, cwd=ROOT, timeout=600)
    assert collect.returncode == 0, collect.stdout[-4000:] + collect.stderr[-2000:]
    assert "error" not in collect.stdout.splitlines()[-1], collect.stdout[-2000:]


def test_apply_says_nothing_of_numpy_where_numpy_is_absent(tmp_path):
    """`pip install "hicache[cuda]"` brings no NumPy; torch's CPU build warns at import then -
    `hicache apply` keeps that warning out of its progress display (hicache never uses NumPy)."""
    project = _project()
    python, env = _fresh_env(tmp_path, list(project["dependencies"]) + project["optional-dependencies"]["cuda"])
    check = subprocess.run([str(python), "-c", "import importlib.util as u; print(u.find_spec('numpy'))"],
                           capture_output=True, text=True, env=env, cwd=tmp_path)
    assert check.stdout.strip() == "None"
    result = subprocess.run([str(python), "-m", "hicache", "apply", "--model", "llama-3.1-8b", "--host-gb", "0.05",
                             "--chunk-limit", "16MiB", "--fake-cuda", "--host-memory", "1TB", "--ranks-per-host", "1"],
                            capture_output=True, text=True, env=env, cwd=tmp_path, timeout=300)
    assert result.returncode == 0, result.stderr
    assert "NumPy" not in result.stderr and "Traceback" not in result.stderr, result.stderr
