"""Shared setup for the tests that run SGLang 0.5.23's real code with the hicache plug-in:
SGLang's modules imported on CPU (`hicache.testing.sglang_on_cpu`), SGLang's own functions put
back everywhere the plug-in's hooks reached between tests, and SGLang's pool modules told they
run on CUDA (their destroy() unregisters only there) while `fake_cuda` stands in for the driver.

Skips naming `make sglang` where SGLang is absent; fails instead under HICACHE_REQUIRE_SGLANG=1."""

from __future__ import annotations

import contextlib
import os
import sys
import threading
import warnings

import pytest

from hicache.compat.sglang_plugin import POOL_CLASSES
from hicache.testing import sglang_on_cpu

#: SGLang's host-pool modules, imported up front (the plug-in's hooks reach names they import)
POOL_MODULES = (
    "sglang.srt.mem_cache.pool_host.base", "sglang.srt.mem_cache.pool_host.mha",
    "sglang.srt.mem_cache.pool_host.mla", "sglang.srt.mem_cache.pool_host.dsa",
    "sglang.srt.mem_cache.pool_host.mamba", "sglang.srt.mem_cache.memory_pool_host",
)


def need_sglang() -> None:
    """Skip (naming `make sglang`) where SGLang is not installed - fail where CI requires it -
    without importing it: for tests whose child processes import SGLang themselves."""
    from hicache.effects import package_version

    if package_version("sglang") is None:
        if os.environ.get("HICACHE_REQUIRE_SGLANG") == "1":
            pytest.fail("SGLang's real code is required here (HICACHE_REQUIRE_SGLANG=1): run `make sglang`")
        pytest.skip("SGLang 0.5.23 is not installed: `make sglang` installs its real code for these tests")


def load_sglang():
    need_sglang()
    sglang_on_cpu()
    with warnings.catch_warnings():  # SGLang's imports warn about their own dependencies
        warnings.simplefilter("ignore")
        import importlib

        import sglang.srt.mem_cache.memory_pool  # noqa: F401
        import sglang.srt.mem_cache.pool_host.common as common
        import sglang.srt.plugins  # noqa: F401

        for name in POOL_MODULES:
            importlib.import_module(name)

    return common


COMMON = "sglang.srt.mem_cache.pool_host.common"
#: what `plug` last loaded in this test ((pools, progressive); None once `restore` ran)
_PLUGGED: list = [None]
NAMES = ("alloc_with_host_register", "_cuda_host_register", "_cuda_host_unregister")
ORIGINALS: dict = {}
CLASSES: dict = {}  # SGLang's host-pool classes the plug-in may REPLACE (HICACHE_SGLANG_POOLS=1)


def restore(common) -> None:
    """Put SGLang's own functions back everywhere the registry's propagation put ours."""
    from sglang.srt.plugins import hook_registry

    import sglang.srt.plugins as plugins

    import sglang.srt.mem_cache.pool_host.base as base

    if not ORIGINALS:
        import sglang.srt.mem_cache.host_memory as host_memory

        ORIGINALS.update({name: getattr(common, name) for name in NAMES})
        ORIGINALS["host_memory_budget_bytes"] = base.host_memory_budget_bytes
        # the plug-in wraps it too (AROUND): left in place, every load wrapped the last one's
        # wrapper - as many layers as a worker's loads by its end, each sampling again
        ORIGINALS["available_host_memory_bytes"] = host_memory.available_host_memory_bytes
        for target in POOL_CLASSES:  # SGLang's own host-pool classes, before any class REPLACE
            module, name = target.rsplit(".", 1)
            CLASSES[name] = getattr(sys.modules[module], name)
    # sys.modules.copy(): one C call - a finalizer's warning importing a module mid-iteration
    # must not break the restore
    for module in [m for name, m in sys.modules.copy().items() if name.startswith("sglang") and m is not None]:
        for name, original in CLASSES.items():
            current = getattr(module, name, None)
            if isinstance(current, type) and current.__module__.startswith("hicache."):
                setattr(module, name, original)
    for module in [m for name, m in sys.modules.copy().items() if name.startswith("sglang") and m is not None]:
        for name, original in ORIGINALS.items():
            current = getattr(module, name, None)
            if current is not None and current is not original and getattr(current, "__wrapped__", None) is not None:
                setattr(module, name, original)
    for key, func in list(common.ALLOC_MEMORY_FUNCS.items()):
        if func is not ORIGINALS["alloc_with_host_register"] and getattr(func, "__wrapped__", None) is not None:
            del common.ALLOC_MEMORY_FUNCS[key]  # a resolved entry of the patched function
    hook_registry.HookRegistry.reset()
    plugins._plugins_loaded = False
    _PLUGGED[0] = None


def plug(monkeypatch, *, pools: bool, progressive: bool = False) -> None:
    """The plug-in loaded by SGLang's own `load_plugins()`, with HICACHE_SGLANG_POOLS and
    HICACHE_PROGRESSIVE on or off as given, after SGLang's functions are put back - unless this
    test already loaded just that: SGLang's loader propagates every hook through every loaded
    module (about 0.15 s a load here), and the radix tree's tests build engines by the dozen."""
    import sglang.srt.mem_cache.pool_host.common as common
    import sglang.srt.plugins as plugins

    if _PLUGGED[0] == (pools, progressive):
        return
    restore(common)
    for name, on in (("HICACHE_SGLANG_POOLS", pools), ("HICACHE_PROGRESSIVE", progressive)):
        if on:
            monkeypatch.setenv(name, "1")
        else:
            monkeypatch.delenv(name, raising=False)
    plugins.load_plugins()
    _PLUGGED[0] = (pools, progressive)


def loaded_side_first(sides: tuple) -> tuple:
    """``sides`` - each "sglang" or "hicache" (whose pools), or a tuple beginning with one - in
    the same order, except that those of the pools mode the plug-in is loaded in now come first:
    a hypothesis example run after one that ended in that mode then loads the plug-in once less
    (SGLang's loader takes ~0.27 s here, more than a short traffic)."""
    loaded = _PLUGGED[0]
    if loaded is None:
        return sides
    now = "hicache" if loaded[0] else "sglang"
    return tuple(sorted(sides, key=lambda side: side[0] != now if isinstance(side, tuple) else side != now))


@pytest.fixture
def sglang(monkeypatch):
    """SGLang's modules with no plug-in applied, before and after the test."""
    common = load_sglang()
    import sglang.srt.mem_cache.pool_host.base as base

    restore(common)
    for name in ("HICACHE_SGLANG", "SGLANG_PLUGINS", "HICACHE_SGLANG_POOLS", "HICACHE_PROGRESSIVE"):
        monkeypatch.delenv(name, raising=False)
    # SGLang's destroy() unregisters only where it thinks CUDA is (`base._is_cuda`): this CPU box
    # stands in for a CUDA node, as fake_cuda stands in for its driver. (Only base's: the pool
    # modules' own flags also switch CUDA-only set-up on; see `cuda_at_destroy`.)
    monkeypatch.setattr(sys.modules["sglang.srt.mem_cache.pool_host.base"], "_is_cuda", True)
    yield common
    restore(common)


def plugged(common) -> bool:
    return all(getattr(common, name) is not ORIGINALS[name] for name in NAMES)


def cuda_at_destroy(monkeypatch, module_name: str) -> None:
    """For a pool built on CPU whose own module gates its destroy() on `_is_cuda` (DSA's
    indexer): say CUDA from now on, after its CUDA-only set-up was skipped."""
    monkeypatch.setattr(sys.modules[module_name], "_is_cuda", True)


@contextlib.contextmanager
def published(prepared=None, /, **server_args):
    """SGLang's runtime context published as a server publishes it at start (SGLang's own
    `publish` over a `ServerArgs`, as its `sglang.test.test_utils.published_topology` does, whose
    module needs `datasets`): what its pools read through get_parallel()/get_memory(). From
    ``server_args``, or a ``prepared`` ServerArgs (one whose resolved fields a test set)."""
    from sglang.srt.runtime_context import SpawnRanks, publish, reset_context
    from sglang.srt.server_args import ServerArgs

    reset_context()
    args = prepared if prepared is not None else ServerArgs(model_path="dummy", **server_args)
    publish(args, role="test", ranks=SpawnRanks(world_rank=0, dp_rank=None))
    try:
        yield
    finally:
        reset_context()


def recording_allocators(monkeypatch) -> list:
    """Every hicache allocator the plug-in makes for SGLang's default one, from now on (to check
    that what it mapped is unmapped again: each one's ``owned()``)."""
    from hicache.compat import sglang as compat

    made = []

    class Recording(compat.HostTensorAllocator):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            made.append(self)

    monkeypatch.setattr(compat, "HostTensorAllocator", Recording)
    return made


def hold_background_registration(monkeypatch, fake, held: threading.Event) -> None:
    """Under ``fake`` (`fake_cuda`'s runtime), a progressive pool's background calls (its
    "hicache-progressive" thread) wait in the driver until ``held`` is set: what a test does
    while pools register is the test's order, not the clock's. (A pool's foreground calls, and a
    non-progressive pool's, are not held.)"""
    register = fake.cudart.cudaHostRegister

    def waiting(ptr, size, flags):
        if threading.current_thread().name == "hicache-progressive":
            assert held.wait(timeout=60), "hang guard"
        return register(ptr, size, flags)

    monkeypatch.setattr(fake.cudart, "cudaHostRegister", waiting)
