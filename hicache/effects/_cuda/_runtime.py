"""The CUDA boundary: a `HostRuntime` protocol and adapters over cuda-python and torch.

Owns turning return codes into classified `CudaCallError`s (with the enum's name - never
`cudaGetErrorString(int)`, which raises TypeError, sglang PR #38509) and draining the pending
error after a failed call (a stale error otherwise surfaces in an unrelated call, vLLM #51081).
The bindings are imported lazily, on first use.
"""

from __future__ import annotations

import contextlib
import threading
from typing import Protocol, runtime_checkable

from hicache.effects._cuda import _codes
from hicache.errors import CudaCallError


@runtime_checkable
class HostRuntime(Protocol):
    """What the executor needs from CUDA: register a range, unregister a base pointer.

    Both raise a `CudaCallError` subclass on failure and return None on success.
    """

    def register(self, ptr: int, size: int, flags: int) -> None: ...

    def unregister(self, ptr: int) -> None: ...


class CudaPythonRuntime:
    """`HostRuntime` over ``cuda.bindings.runtime`` (calls return ``(cudaError_t, ...)``).

    ``binding``: any object with that call convention (``cudaHostRegister``,
    ``cudaHostUnregister``, ``cudaGetLastError``, ``cudaGetErrorName``, ``cudaGetErrorString``),
    so a fake stands in without monkeypatching. Default: the real cuda-python module.
    """

    def __init__(self, binding=None) -> None:
        if binding is None:
            from hicache._extras import require

            require("cuda.bindings", "CudaPythonRuntime")
            from cuda.bindings import runtime as binding  # lazy: heavy, and absent on some hosts
        self.binding = binding

    def __repr__(self) -> str:
        return f"CudaPythonRuntime(binding={getattr(self.binding, '__name__', self.binding)!r})"

    def register(self, ptr: int, size: int, flags: int) -> None:
        _check(self, self._call("cudaHostRegister", ptr, size, ptr, size, flags), "cudaHostRegister", ptr, size)

    def unregister(self, ptr: int) -> None:
        _check(self, self._call("cudaHostUnregister", ptr, None, ptr), "cudaHostUnregister", ptr, None)

    def _call(self, op: str, ptr: int, size: int | None, *args):
        """The binding's call; where the binding cannot reach a driver at all it is CUDA
        unavailable. cuda-bindings 12.8 raises ``RuntimeError('Function "cuInit" not found')``
        where no driver library loads (13.x returns cudaErrorInsufficientDriver, 35, for the
        same machine): classified as that code, so every caller sees one error for no driver."""
        try:
            return getattr(self.binding, op)(*args)
        except RuntimeError as error:
            if isinstance(error, CudaCallError):
                raise
            raise _codes.cuda_error(op, _codes.INSUFFICIENT_DRIVER, "cudaErrorInsufficientDriver",
                                    f"the binding could not call the driver ({error})", ptr=ptr, size=size,
                                    found=self._found()) from error

    def _describe(self, status, code: int) -> tuple[str, str]:
        return self._text("cudaGetErrorName", status, code), self._text("cudaGetErrorString", status, code)

    def _enum(self, status, code):
        enum = getattr(self.binding, "cudaError_t", None)
        if enum is not None and not isinstance(status, enum):
            try:
                return enum(code)
            except ValueError:
                return status
        return status

    def _text(self, getter: str, status, code: int) -> str:
        fallback = _codes.NAMES.get(code, f"cudaError({code})")
        try:
            result = getattr(self.binding, getter)(self._enum(status, code))
            text = result[1] if isinstance(result, tuple) else result
            return text.decode() if isinstance(text, bytes) else str(text)
        except Exception:  # naming an error must never hide it
            return fallback if getter == "cudaGetErrorName" else "(no description)"

    def _drain(self) -> None:
        try:
            self.binding.cudaGetLastError()
        except Exception:
            pass  # the original failure is what the caller needs to see

    def _found(self) -> str:
        parts = []
        for label, getter in (("driver", "cudaDriverGetVersion"), ("runtime", "cudaRuntimeGetVersion")):
            try:
                result = getattr(self.binding, getter)()
                version = int(result[1]) if int(result[0]) == 0 else None
            except Exception:
                continue
            parts.append(f"{label} {_version(version)}")
        return "found " + ", ".join(parts) if parts else ""


def _version(value: int | None) -> str:
    if not value:
        return "none"
    return f"{value // 1000}.{value % 1000 // 10}"


class TorchCudartRuntime:
    """`HostRuntime` over ``torch.cuda.cudart()`` (calls return plain int codes).

    For processes that already use torch's binding. Error names come from hicache's own table
    (and cuda-python's enum when installed), never from ``cudaGetErrorString(int)``.
    """

    def __init__(self, cudart=None) -> None:
        if cudart is None:
            import torch  # lazy

            cudart = torch.cuda.cudart()
        self.cudart = cudart

    def register(self, ptr: int, size: int, flags: int) -> None:
        _check(self, self.cudart.cudaHostRegister(ptr, size, flags), "cudaHostRegister", ptr, size)

    def unregister(self, ptr: int) -> None:
        _check(self, self.cudart.cudaHostUnregister(ptr), "cudaHostUnregister", ptr, None)

    def _drain(self) -> None:
        drain = getattr(self.cudart, "cudaGetLastError", None)  # torch's binding may lack it
        if drain is not None:
            try:
                drain()
            except Exception:
                pass  # the original failure is what the caller needs to see

    def _describe(self, status, code: int) -> tuple[str, str]:
        return _names_from_cuda_python(code)

    def _found(self) -> str:
        return ""


def _check(adapter, result, op: str, ptr: int, size: int | None) -> None:
    """The one result checker of every adapter: success returns; any other code drains the
    pending error (else the next call would report it) and raises its classified
    `CudaCallError`, named by the adapter (``_describe``) with what it found (``_found``)."""
    status = result[0] if isinstance(result, tuple) else result
    code = int(status)
    if code == _codes.SUCCESS:
        return
    adapter._drain()
    name, detail = adapter._describe(status, code)
    raise _codes.cuda_error(op, code, name, detail, ptr=ptr, size=size, found=adapter._found())


def _names_from_cuda_python(code: int) -> tuple[str, str]:
    name = _codes.NAMES.get(code, f"cudaError({code})")
    try:
        from cuda.bindings import runtime

        enum = runtime.cudaError_t(code)
        name = enum.name
        status, text = runtime.cudaGetErrorString(enum)
        return name, text.decode() if isinstance(text, bytes) else str(text)
    except Exception:
        return name, "(no description)"


#: Stand-ins installed by `hicache.testing.fake_cuda`: (runtime, cuda-python-style binding).
#: Empty in production; every default below then means the real CUDA.
_STAND_INS: list = []
_STAND_INS_LOCK = threading.Lock()


@contextlib.contextmanager
def stand_in_runtime(runtime, binding):
    """Within the block every default runtime is ``runtime`` and every default binding
    ``binding`` (process-wide; blocks nest, the innermost wins). What `hicache.testing.fake_cuda`
    uses to stand in for CUDA."""
    entry = (runtime, binding)
    with _STAND_INS_LOCK:
        _STAND_INS.append(entry)
    try:
        yield runtime
    finally:
        with _STAND_INS_LOCK:
            _STAND_INS.remove(entry)


def default_runtime() -> HostRuntime:
    """The runtime a bring-up uses when none is given: cuda-python (or the active fake)."""
    if _STAND_INS:
        return _STAND_INS[-1][0]
    return CudaPythonRuntime()


def default_binding():
    """The cuda-python-style binding probes use when none is given (or the active fake's)."""
    if _STAND_INS:
        return _STAND_INS[-1][1]
    from cuda.bindings import runtime as binding

    return binding


def torch_runtime(lookup_cudart) -> HostRuntime:
    """A runtime over ``lookup_cudart()`` (SGLang passes ``torch.cuda.cudart``), or the fake."""
    if _STAND_INS:
        return _STAND_INS[-1][0]
    return TorchCudartRuntime(lookup_cudart())
