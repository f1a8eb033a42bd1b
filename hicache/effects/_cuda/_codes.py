"""CUDA error codes as data: which exception each `cudaError_t` becomes.

Owns the classification (712/713, sticky codes that poison the context, "no usable CUDA") and
the names of the codes we branch on, so an error is named even when the binding returns a bare
int (torch's cudart) and cannot name it. Imports only hicache.errors.
"""

from __future__ import annotations

from hicache.errors import (
    CudaCallError,
    CudaUnavailableError,
    HostAlreadyRegisteredError,
    HostNotRegisteredError,
    StickyCudaError,
)

SUCCESS = 0
ALREADY_REGISTERED = 712  # cudaErrorHostMemoryAlreadyRegistered (overlap, sglang PR #38832)
NOT_REGISTERED = 713  # cudaErrorHostMemoryNotRegistered (not a registration's base pointer)
NOT_SUPPORTED = 801  # cudaErrorNotSupported (e.g. cudaMemcpyBatchAsync on an old driver)
CALL_REQUIRES_NEWER_DRIVER = 36
INSUFFICIENT_DRIVER = 35  # cudaErrorInsufficientDriver: no driver, or one older than the runtime

#: No usable CUDA in this process: no driver, a driver older than the runtime, no device.
UNAVAILABLE = {
    3: "cudaErrorInitializationError",
    34: "cudaErrorStubLibrary",
    35: "cudaErrorInsufficientDriver",
    46: "cudaErrorDevicesUnavailable",
    100: "cudaErrorNoDevice",
}

#: Codes after which "any further CUDA work will return the same error": the context is
#: poisoned and only a new process recovers, so no compensation can run (CUDA runtime docs).
STICKY = {
    214: "cudaErrorECCUncorrectable",
    700: "cudaErrorIllegalAddress",
    702: "cudaErrorLaunchTimeout",
    710: "cudaErrorAssert",
    714: "cudaErrorHardwareStackError",
    715: "cudaErrorIllegalInstruction",
    716: "cudaErrorMisalignedAddress",
    717: "cudaErrorInvalidAddressSpace",
    718: "cudaErrorInvalidPc",
    719: "cudaErrorLaunchFailure",
}

NAMES = {
    SUCCESS: "cudaSuccess",
    1: "cudaErrorInvalidValue",
    2: "cudaErrorMemoryAllocation",
    ALREADY_REGISTERED: "cudaErrorHostMemoryAlreadyRegistered",
    NOT_REGISTERED: "cudaErrorHostMemoryNotRegistered",
    NOT_SUPPORTED: "cudaErrorNotSupported",
    CALL_REQUIRES_NEWER_DRIVER: "cudaErrorCallRequiresNewerDriver",
    999: "cudaErrorUnknown",
    **UNAVAILABLE,
    **STICKY,
}


def error_class(code: int) -> type[CudaCallError]:
    """The exception type for a failed call's ``code``."""
    if code == ALREADY_REGISTERED:
        return HostAlreadyRegisteredError
    if code == NOT_REGISTERED:
        return HostNotRegisteredError
    if code in STICKY:
        return StickyCudaError
    if code in UNAVAILABLE:
        return CudaUnavailableError
    return CudaCallError


def cuda_error(
    op: str, code: int, name: str, detail: str, *, ptr: int | None = None,
    size: int | None = None, found: str = "",
) -> CudaCallError:
    """Build the classified exception with a message that names the call, code and range."""
    where = ""
    if ptr is not None:
        where = f" (ptr=0x{ptr:x}" + (f", size={size}" if size is not None else "") + ")"
    cls = error_class(code)
    message = f"{op}{where} failed: {name} ({code}): {detail}"
    if cls is CudaUnavailableError:
        message = f"CUDA unavailable: {message}" + (f"; {found}" if found else "")
    elif cls is StickyCudaError:
        message += "; the CUDA context is poisoned, only a new process recovers"
    return cls(message, op=op, code=code, name=name, ptr=ptr, size=size)
