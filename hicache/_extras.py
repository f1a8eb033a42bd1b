"""Optional dependencies: torch and cuda-python come with ``pip install "hicache[cuda]"``.

Owns the one clear error when a module that needs them is used without them. A plain
``pip install hicache`` is enough for `hicache.plan`, ``hicache plan`` and ``hicache doctor``.
Imports importlib only.
"""

from __future__ import annotations

EXTRA = "cuda"


class MissingExtraError(ImportError):
    """A module needs an optional dependency that is not installed."""


def require(module: str, what: str) -> None:
    """Raise `MissingExtraError` naming the extra when ``module`` cannot be imported."""
    import importlib.util  # here: `hicache plan` imports this module and never asks

    try:
        found = importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):  # a parent package missing, or blocked in sys.modules
        found = False
    if not found:
        raise MissingExtraError(
            f"{what} needs {module.split('.')[0]}, which is not installed: "
            f"pip install \"hicache[{EXTRA}]\" (adds torch and cuda-python; see the README for "
            "the CPU-only torch and the cuda-bindings line that fits your driver)",
            name=module,
        )
