"""The CUDA boundary: codes become classified errors with names; the no-driver path is real."""

from __future__ import annotations

import pytest

from hicache.effects import CudaPythonRuntime, TorchCudartRuntime, apply_plan, probe_cuda
from hicache.effects import HostLedger
from hicache.errors import (
    ApplyError,
    CudaCallError,
    CudaUnavailableError,
    HostAlreadyRegisteredError,
    HostNotRegisteredError,
    StickyCudaError,
)
from hicache.plan import Limits, plan_registration
from hicache.testing import FakeCudaBinding, FakeCudart, FakeRuntime, check_runtime_conformance

BASE = 1 << 40


@pytest.mark.parametrize(
    "code, cls, name",
    [
        (712, HostAlreadyRegisteredError, "cudaErrorHostMemoryAlreadyRegistered"),
        (713, HostNotRegisteredError, "cudaErrorHostMemoryNotRegistered"),
        (700, StickyCudaError, "cudaErrorIllegalAddress"),
        (719, StickyCudaError, "cudaErrorLaunchFailure"),
        (35, CudaUnavailableError, "cudaErrorInsufficientDriver"),
        (100, CudaUnavailableError, "cudaErrorNoDevice"),
        (2, CudaCallError, "cudaErrorMemoryAllocation"),
    ],
)
@pytest.mark.parametrize("adapter", ["cuda-python", "torch-cudart"])
def test_codes_become_classified_errors_with_names(code, cls, name, adapter):
    """Each code maps to its exception class carrying op, code, name, ptr and size."""
    cudart = FakeCudart(fail_register={0: code})
    runtime = CudaPythonRuntime(FakeCudaBinding(cudart)) if adapter == "cuda-python" else TorchCudartRuntime(cudart)
    with pytest.raises(cls) as info:
        runtime.register(BASE, 4096, 0)
    error = info.value
    assert type(error) is cls
    assert (error.op, error.code, error.name, error.ptr, error.size) == ("cudaHostRegister", code, name, BASE, 4096)
    cudart.check_valid()  # the pending error was drained through the same binding


def test_int_codes_never_reach_cuda_get_error_string():
    """torch's int codes are named without cudaGetErrorString(int), which raises TypeError."""
    cudart = FakeCudart(fail_register={0: 2})
    with pytest.raises(CudaCallError, match="cudaErrorMemoryAllocation"):
        TorchCudartRuntime(cudart).register(BASE, 4096, 0)


def test_fake_runtime_conforms():
    """The fake passes the conformance check any runtime can run."""
    runtime = FakeRuntime()
    assert check_runtime_conformance(runtime, BASE, 3 * 4096) == [
        "register-unregister", "overlap-is-712", "interior-unregister-fails", "errors-drained",
    ]
    assert runtime.held() == set()
    runtime.check_valid()


def test_the_conformance_check_fails_a_wrong_error_also_under_python_O():
    """check_runtime_conformance judges with raises, not asserts: a runtime whose interior
    unregister fails with another code is refused in a child run with -O (asserts stripped)."""
    import subprocess
    import sys

    code = """
from hicache.errors import CudaCallError
from hicache.testing import FakeRuntime, check_runtime_conformance
class Odd(FakeRuntime):
    def unregister(self, ptr):
        if ptr % (2 * 4096):
            raise CudaCallError("odd", op="cudaHostUnregister", code=999, name="cudaErrorUnknown")
        super().unregister(ptr)
try:
    check_runtime_conformance(Odd(), 1 << 30, 3 * 4096)
except AssertionError as error:
    print("refused:", error)
else:
    print("passed")
"""
    result = subprocess.run([sys.executable, "-O", "-c", code], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert result.stdout.startswith("refused: unregistering an interior pointer failed with"), result.stdout


def test_real_cuda_python_without_a_driver_is_cuda_unavailable():
    """On this CPU-only machine the real binding fails with CudaUnavailableError, and nothing
    is registered or leaked."""
    if probe_cuda().available:
        pytest.skip("a CUDA driver is present; the no-driver path cannot be exercised")
    runtime = CudaPythonRuntime()
    with pytest.raises(CudaUnavailableError, match=r"CUDA unavailable: .*cudaErrorInsufficientDriver|cudaErrorNoDevice") as info:
        runtime.register(BASE, 4096, 0)
    assert info.value.code in (35, 100, 34, 3)
    ledger = HostLedger()
    plan = plan_registration(3 * 4096, granularity_bytes=4096, limits=Limits(chunk_limit_bytes=4096))
    with pytest.raises(ApplyError) as applied:
        apply_plan(plan, base_ptr=BASE, runtime=runtime, ledger=ledger)
    assert isinstance(applied.value.__cause__, CudaUnavailableError)
    assert "rolled back 0 registration(s)" in str(applied.value)
    assert ledger.held() == ()


def test_a_binding_that_cannot_reach_a_driver_is_cuda_unavailable_not_a_runtime_error():
    """cuda-bindings 12.8 raises RuntimeError('Function "cuInit" not found') where no driver
    library loads (13.x returns code 35): both are CudaUnavailableError naming the call, the
    range and the binding's words, and an apply over it rolls back to nothing held."""

    class NoDriverBinding:
        def __getattr__(self, name):
            def call(*args):
                raise RuntimeError('Function "cuInit" not found')

            return call

    runtime = CudaPythonRuntime(binding=NoDriverBinding())
    for act, op in ((lambda: runtime.register(BASE, 4096, 0), "cudaHostRegister"),
                    (lambda: runtime.unregister(BASE), "cudaHostUnregister")):
        with pytest.raises(CudaUnavailableError, match=r'CUDA unavailable: .*cudaErrorInsufficientDriver .*cuInit" not found') as info:
            act()
        assert (info.value.op, info.value.code, info.value.ptr) == (op, 35, BASE)
        assert isinstance(info.value.__cause__, RuntimeError)
    ledger = HostLedger()
    plan = plan_registration(3 * 4096, granularity_bytes=4096, limits=Limits(chunk_limit_bytes=4096))
    with pytest.raises(ApplyError) as applied:
        apply_plan(plan, base_ptr=BASE, runtime=runtime, ledger=ledger)
    assert isinstance(applied.value.__cause__, CudaUnavailableError)
    assert ledger.held() == ()


def test_probe_cuda_says_what_it_found():
    """probe_cuda reports availability with a reason instead of raising."""
    facts = probe_cuda()
    assert facts.available or facts.error
    broken = probe_cuda(binding=object())
    assert not broken.available and broken.error
