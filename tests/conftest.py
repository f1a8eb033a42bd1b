"""Hypothesis profiles (quick `dev` by default, thorough `ci` in CI) and the `gpu` marker."""

import os

from hypothesis import HealthCheck, settings

settings.register_profile("dev", max_examples=60, deadline=None)
settings.register_profile(
    "ci", max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow]
)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "dev"))


def pytest_collection_modifyitems(config, items):
    """Skip `gpu` tests, with the reason, where CUDA is not usable."""
    gpu_items = [item for item in items if "gpu" in item.keywords]
    if not gpu_items:
        return
    import pytest

    from hicache.effects import probe_cuda

    facts = probe_cuda()
    if facts.available:
        return
    skip = pytest.mark.skip(reason=f"needs CUDA: {facts.error}")
    for item in gpu_items:
        item.add_marker(skip)
