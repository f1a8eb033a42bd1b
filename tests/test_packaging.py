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


def test_the_wheel_without_torch_plans_and_checks(tmp_path):
    wheel = _build("wheel", tmp_path / "dist")
    env_dir = tmp_path / "fresh"
    venv.create(env_dir, with_pip=True)
    python = env_dir / "bin" / "python"
    borrowed = tmp_path / "borrowed"
    borrowed.mkdir()
    for name in LIGHT:
        spec = importlib.util.find_spec(name)
        if spec is None:
            continue
        source = Path(spec.submodule_search_locations[0]) if spec.submodule_search_locations else Path(spec.origin)
        (borrowed / source.name).symlink_to(source)
    site = subprocess.run([str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                          capture_output=True, text=True, check=True).stdout.strip()
    Path(site, "borrowed.pth").write_text(str(borrowed) + "\n")
    subprocess.run([str(python), "-m", "pip", "install", "-q", "--no-deps", "--no-index", str(wheel)],
                   check=True, capture_output=True, text=True, timeout=300)
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    hicache = env_dir / "bin" / "hicache"
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
    sdist = _build("sdist", tmp_path / "dist")
    with tarfile.open(sdist) as archive:
        names = {name.split("/", 1)[1] for name in archive.getnames() if "/" in name}
    for needed in ("LICENSE", "CHANGELOG.md", "README.md", "docs/sglang.md", "docs/json.md", "hicache/py.typed",
                   "tests/conftest.py", "tests/machine.py", "tests/strategies.py", "tests/rank_child.py",
                   "tests/transfer_fuzz_child.py", "tests/golden/llama-3.1-70b-tp8.txt",
                   "hicache/effects/_copy/_hostcopy.c", "hicache/pools/_pagestack.c", "setup.py", "constraints-dev.txt",
                   "requirements-sglang.txt"):
        assert needed in names, needed
