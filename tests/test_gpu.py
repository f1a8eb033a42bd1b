"""Real CUDA: conformance of the cuda-python adapter and a chunked pool that copies correctly.
Marked `gpu`: skipped with the reason on machines without a usable CUDA driver."""

from __future__ import annotations

import json
import pathlib
import subprocess
import sys

import pytest

from hicache.effects import CudaPythonRuntime, allocate_host, apply_plan, probe_cuda
from hicache.plan import Limits, plan_registration
from hicache.testing import check_runtime_conformance

SCRIPT = pathlib.Path(__file__).resolve().parents[1] / "scripts" / "gpu_check.py"


@pytest.mark.gpu
def test_cuda_python_runtime_conforms():
    """The real adapter: 712 on overlap, interior unregister fails, errors drained."""
    buffer = allocate_host(3 * 4096)
    try:
        check_runtime_conformance(CudaPythonRuntime(), buffer.ptr, buffer.nbytes)
    finally:
        buffer.free()


@pytest.mark.gpu
def test_chunked_registration_of_real_memory():
    """A 64 MiB buffer registers in 4 calls and releases cleanly."""
    buffer = allocate_host(64 * 2**20)
    plan = plan_registration(buffer.nbytes, granularity_bytes=2**20, limits=Limits(chunk_limit_bytes=16 * 2**20))
    with apply_plan(plan, base_ptr=buffer.ptr, runtime=CudaPythonRuntime()) as registration:
        assert registration.status().call_count == 4
    buffer.free()


@pytest.mark.gpu
def test_gpu_check_script_passes():
    """scripts/gpu_check.py verifies boundary pages byte for byte."""
    out = subprocess.run([sys.executable, str(SCRIPT)], capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stdout + out.stderr
    assert json.loads(out.stdout)["bytes_match"] is True


def test_gpu_check_without_cuda_says_so():
    """Without CUDA the GPU check exits 2 with a one-line JSON reason."""
    if probe_cuda().available:
        pytest.skip("CUDA is available here")
    out = subprocess.run([sys.executable, str(SCRIPT)], capture_output=True, text=True, timeout=120)
    assert out.returncode == 2
    assert "CUDA unavailable" in json.loads(out.stdout)["reason"]
