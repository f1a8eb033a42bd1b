"""Stand-ins that let SGLang's real code import and run on a CPU box (issue #24's test setup).

Owns the one piece SGLang's host-pool path cannot import without: `torchvision`, which
`sglang.srt.configs` imports at module level and for which PyPI has no CPU build matching
torch 2.13 (the CUDA wheel fails with ``operator torchvision::nms does not exist``). Nothing on
the host-pool paths calls it; every name it is asked for is a class that refuses to be built.
transformers' own "is torchvision installed" answer is settled (cached False) before the
stand-in exists, so it never takes the stand-in for the real package. CUDA itself is stood
in for by `hicache.testing.fake_cuda`. Imports nothing of hicache.
"""

from __future__ import annotations

import enum
import importlib.machinery
import sys
import types

_NAMES = ("torchvision", "torchvision.transforms", "torchvision.transforms.functional")


class InterpolationMode(enum.Enum):
    """What SGLang's multimodal helpers name at import time (``torchvision.transforms``)."""

    NEAREST = "nearest"
    BILINEAR = "bilinear"
    BICUBIC = "bicubic"


def _stub(name: str, package: bool) -> types.ModuleType:
    module = types.ModuleType(name, f"hicache's CPU stand-in for {name} (see hicache/_sglang_cpu.py)")
    module.__spec__ = importlib.machinery.ModuleSpec(name, None, is_package=package)
    if package:
        module.__path__ = []

    def __getattr__(attribute: str):
        if attribute.startswith("__"):
            raise AttributeError(attribute)

        class Unavailable:
            def __init__(self, *args, **kwargs):
                raise RuntimeError(f"{name}.{attribute} is a CPU stand-in: torchvision is not installed here")

        Unavailable.__name__ = Unavailable.__qualname__ = attribute
        return Unavailable

    module.__getattr__ = __getattr__
    return module


def install() -> bool:
    """Put the torchvision stand-in in ``sys.modules`` unless a real one imports; idempotent.
    Returns True when the stand-in is (now) in place."""
    existing = sys.modules.get("torchvision")
    if existing is not None:
        return "CPU stand-in" in (getattr(existing, "__doc__", None) or "")
    try:
        import torchvision  # noqa: F401 - a working real one wins
        return False
    except Exception:  # absent, or the CUDA wheel beside a CPU torch
        sys.modules.pop("torchvision", None)
    try:
        from transformers.utils import import_utils

        import_utils.is_torchvision_available()  # settled (lru_cache) while none is importable
    except Exception:  # transformers absent or of another shape: nothing to settle
        pass
    root, transforms, functional = (_stub(name, name != _NAMES[-1]) for name in _NAMES)
    root.transforms, transforms.functional = transforms, functional
    transforms.InterpolationMode = functional.InterpolationMode = InterpolationMode
    sys.modules.update(zip(_NAMES, (root, transforms, functional)))
    return True
