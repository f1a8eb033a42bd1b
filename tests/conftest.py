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


import pytest  # noqa: E402


@pytest.fixture(autouse=True, scope="session")
def _private_runtime_dir(tmp_path_factory):
    """Budget-lock files of the tests live in a private temporary directory."""
    directory = tmp_path_factory.mktemp("hicache-runtime")
    directory.chmod(0o700)
    previous = os.environ.get("HICACHE_RUNTIME_DIR")
    os.environ["HICACHE_RUNTIME_DIR"] = str(directory)
    yield
    if previous is None:
        os.environ.pop("HICACHE_RUNTIME_DIR", None)
    else:
        os.environ["HICACHE_RUNTIME_DIR"] = previous
