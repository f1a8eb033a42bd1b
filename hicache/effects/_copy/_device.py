"""Batched host<->device copies through cuda-python `cudaMemcpyBatchAsync`.

Owns the call convention across cuda-bindings lines (12.8+ takes a ``failIdx`` out-parameter
that 13.x dropped) and turns failures into classified `CudaCallError`s; a
``cudaErrorNotSupported`` / ``cudaErrorCallRequiresNewerDriver`` tells the caller to fall back
to per-page copies. One descriptor per page per layer: a source that spans two registrations
fails with invalid argument (sglang PR #36798), which the plan rules out.
"""

from __future__ import annotations

from hicache.effects._cuda import _codes

FALLBACK_CODES = (_codes.NOT_SUPPORTED, _codes.CALL_REQUIRES_NEWER_DRIVER)


def _status(result):
    return result[0] if isinstance(result, tuple) else result


def memcpy_batch(dsts, srcs, sizes, *, stream, binding=None) -> None:
    """Copy ``sizes[i]`` bytes from ``srcs[i]`` to ``dsts[i]`` (ints: pointers) on ``stream``.

    ``stream`` must be a created stream: cudaMemcpyBatchAsync rejects the legacy NULL stream
    (0), so that is refused here with a ValueError before any call.
    Raises a `CudaCallError` (``.code`` 801 or 36 means: use per-page copies instead).
    """
    try:
        handle = int(stream)
    except TypeError:
        handle = None
    if handle == 0:
        raise ValueError("stream 0 (the legacy NULL stream) is rejected by cudaMemcpyBatchAsync; pass a created stream")
    if binding is None:
        from cuda.bindings import runtime as binding
    count = len(sizes)
    if not count:
        return
    attrs = binding.cudaMemcpyAttributes()
    attrs.srcAccessOrder = binding.cudaMemcpySrcAccessOrder.cudaMemcpySrcAccessOrderStream
    args = (list(dsts), list(srcs), list(sizes), count, [attrs], [0], 1)
    try:
        result = binding.cudaMemcpyBatchAsync(*args, stream)  # cuda-bindings 13.x
    except TypeError:
        result = binding.cudaMemcpyBatchAsync(*args, 0, stream)  # 12.8-12.9: failIdx
    code = int(_status(result))
    if code:
        binding.cudaGetLastError()
        name = getattr(_status(result), "name", _codes.NAMES.get(code, str(code)))
        raise _codes.cuda_error(
            "cudaMemcpyBatchAsync", code, name, f"batch of {count} copies", ptr=srcs[0],
        )


def memcpy(dst: int, src: int, size: int, *, stream=0, binding=None) -> None:
    """One asynchronous copy (the per-page fallback of `memcpy_batch`)."""
    if binding is None:
        from cuda.bindings import runtime as binding
    kind = binding.cudaMemcpyKind.cudaMemcpyDefault
    code = int(_status(binding.cudaMemcpyAsync(dst, src, size, kind, stream)))
    if code:
        binding.cudaGetLastError()
        raise _codes.cuda_error("cudaMemcpyAsync", code, _codes.NAMES.get(code, str(code)), "copy", ptr=src, size=size)
