"""`make test-sanitized` runs the suite over the C helpers built with AddressSanitizer and UBSan.
These tests prove that run is what it says - the helpers the public packages load are the
sanitized build of this tree, and an overrun in one is caught and ends the process - so a clean
run of the rest means the helpers made no bad access the suite could reach. Elsewhere they skip."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from store_support import build_slotops

ROOT = Path(__file__).resolve().parents[1]
#: the three optional helpers (setup.py); imported by hicache.pools and hicache.store
HELPERS = ("hicache.effects._copy._hostcopy", "hicache.pools._pagestack", "hicache.effects._arena._slotops")

pytestmark = pytest.mark.skipif(os.environ.get("HICACHE_SANITIZED") != "1",
                                reason="runs under `make test-sanitized` (the C helpers built with ASan and UBSan)")


def test_the_helpers_loaded_are_this_trees_sanitized_build():
    """Importing hicache.pools and hicache.store loads all three helpers, from this tree, each
    carrying ASan's and UBSan's instrumentation (not a fallback, not another tree's build)."""
    import hicache.pools  # noqa: F401
    import hicache.store  # noqa: F401

    for name in HELPERS:
        module = sys.modules.get(name)
        assert module is not None, f"{name} did not load: the sanitized build failed (see the build's output)"
        path = Path(module.__file__).resolve()
        assert path.is_relative_to(ROOT), f"{name} came from {path}, not this tree"
        image = path.read_bytes()
        assert b"__asan_report" in image and b"__ubsan_handle" in image, f"{path} is not instrumented"


def test_an_overrun_in_a_helper_is_reported_and_ends_the_process():
    """The raw block copy (below every Python bounds check) asked to copy 4160 bytes into a
    4096-byte buffer: ASan reports a heap-buffer-overflow in the helper and the child dies - so an overrun
    anywhere else in the run could not have passed quietly."""
    code = ("import ctypes, sys\n"
            "import hicache.pools\n"
            f"copy = sys.modules[{HELPERS[0]!r}]\n"
            "dst, src = ctypes.create_string_buffer(4096), ctypes.create_string_buffer(8192)\n"
            "table = [(ctypes.c_int64 * 1)(v) for v in (ctypes.addressof(dst), ctypes.addressof(src), 4160)]\n"
            "copy.copy_blocks(*(ctypes.addressof(t) for t in table), 1, 1, False)\n"
            "print('copied')\n")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert result.returncode != 0 and "copied" not in result.stdout, result.stdout + result.stderr[-2000:]
    assert "AddressSanitizer: heap-buffer-overflow" in result.stderr and "_hostcopy" in result.stderr, result.stderr[-3000:]


def test_the_suites_own_builds_of_a_helper_are_sanitized_too(tmp_path):
    """The builds the suite makes itself (the portable sum loop, the step hook) take the run's
    CFLAGS: they carry the same instrumentation as the helpers setup.py built."""
    module = build_slotops(tmp_path, "HICACHE_STEP_HOOK")
    image = Path(module.__file__).read_bytes()
    assert b"__asan_report" in image and b"__ubsan_handle" in image, f"{module.__file__} is not instrumented"
