"""Triton's interpreter, which the suite runs the gather kernel through on CPU tensors: present
and able to run the kernel, or a failure that says why and what to install. Never a skip: the
README's `make test` installs a Triton whose interpreter runs it (constraints-dev.txt), and a
skip would let the code path users run on a GPU go untested without a word."""

from __future__ import annotations

import functools

import pytest

from hicache.effects._copy._gather import launch_empty, triton_ready

#: the first Triton whose interpreter takes numpy >= 2.4 (it turned a scalar's 1-element array
#: into an int with int(array), which numpy 2.4 refuses: triton-lang/triton#9171, fixed in 3.7)
NUMPY_24_FIXED_IN = (3, 7)


@functools.lru_cache(maxsize=1)
def interpreter_failure() -> str | None:
    """None when Triton's interpreter runs the kernel here (one empty launch), else why not."""
    if not triton_ready():
        return "triton does not import"
    try:
        launch_empty(None, 8)
    except Exception as error:  # noqa: BLE001 - any failure: the interpreter cannot run it
        return f"{type(error).__name__}: {error}"
    return None


def known_cause(triton_version: str, numpy_version: str) -> str:
    """The known reason an interpreter of ``triton_version`` fails beside ``numpy_version``, or ''."""
    def release(version: str) -> tuple:
        return tuple(int(part) for part in version.split(".")[:2] if part.isdigit())

    if release(triton_version) < NUMPY_24_FIXED_IN and release(numpy_version) >= (2, 4):
        return (f"Triton {triton_version}'s interpreter cannot run a loop with a runtime bound beside numpy "
                f"{numpy_version} (triton-lang/triton#9171, fixed in Triton 3.7); the compiled kernel is "
                f"not affected (tests/test_gather_kernel_compiles.py builds it with this Triton). ")
    return ""


def require_interpreter() -> None:
    """Fail the calling test, naming the cause and the remedy, where the interpreter cannot run
    the kernel here."""
    failure = interpreter_failure()
    if failure is None:
        return
    if failure == "triton does not import":
        pytest.fail("triton is in the test extra (pyproject.toml): reinstall with make test")
    import numpy
    import triton

    pytest.fail(f"Triton's interpreter cannot run the gather kernel here ({failure[:200]}). "
                f"{known_cause(triton.__version__, numpy.__version__)}"
                "Run the suite with `make test` (constraints-dev.txt pins a Triton whose interpreter runs it), "
                "or use Triton >= 3.7 or numpy < 2.4.")
