"""Hypothesis profiles (quick `dev` by default, thorough `ci` in CI), the `gpu` marker, and the
file order: HICACHE_TEST_ORDER=reverse or random[:SEED] runs the test files in that order (each
file's tests in their own order), so a test that passes only after, or only before, another
file's shows up; CI runs a random order, its seed in the header (rerun with the same value)."""

import os
import sys
import random
import signal

from hypothesis import HealthCheck, settings

settings.register_profile("dev", max_examples=60, deadline=None)
settings.register_profile(
    "ci", max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow]
)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "dev"))

# The Ctrl-C tests raise a real SIGINT and expect Python's KeyboardInterrupt. A process started
# in the background by a non-interactive shell (`cmd &`) inherits SIGINT ignored, and Python then
# installs no handler: those tests would see nothing. The suite must not depend on how it was
# launched, so Python's own handler is put back.
if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
    signal.signal(signal.SIGINT, signal.default_int_handler)

# One thread for torch's (OpenMP) kernels in the test processes and the processes they start,
# unless the runner chose a number: the suite runs three workers and their children on two
# cores, and OpenMP's threads spin while they wait for one another - oversubscribed, the SGLang
# worker's largest test ran 28.6 s in the suite against 3.8 s alone (6.8 s with one thread; the
# CI form 252 s -> 208 s). No test measures torch's own threading. Set before anything imports
# torch (its thread count is read when it starts).
os.environ.setdefault("OMP_NUM_THREADS", "1")


def _file_order():
    """("reverse" | "random", seed) from HICACHE_TEST_ORDER, or None for pytest's order."""
    setting = os.environ.get("HICACHE_TEST_ORDER", "").strip()
    if not setting:
        return None
    kind, _, seed = setting.partition(":")
    if kind not in ("reverse", "random") or (seed and not seed.isdigit()):
        raise ValueError(f"HICACHE_TEST_ORDER={setting!r}: use reverse, random or random:SEED")
    if kind == "random" and not seed:
        # Chosen once, by the process that starts the run: its xdist workers inherit the
        # variable and so collect the same order (a different one per worker is an xdist error).
        seed = str(random.SystemRandom().randrange(10**6))
        os.environ["HICACHE_TEST_ORDER"] = f"random:{seed}"
    return kind, int(seed) if seed else 0


_ORDER = _file_order()


def pytest_report_header(config):
    if _ORDER is not None:
        kind, seed = _ORDER
        return f"test file order: {kind}" + (f" (HICACHE_TEST_ORDER=random:{seed} repeats it)" if kind == "random" else "")
    return None


def _reorder(items) -> None:
    files: dict = {}
    for item in items:
        files.setdefault(item.nodeid.split("::")[0], []).append(item)
    names = list(files)
    kind, seed = _ORDER
    if kind == "reverse":
        names.reverse()
    else:
        random.Random(seed).shuffle(names)
    items[:] = [item for name in names for item in files[name]]


def pytest_collection_modifyitems(config, items):
    """The file order asked for; skip `sanitizer_free` tests under `make test-sanitized` and `gpu`
    tests where CUDA is not usable, each with its reason."""
    if _ORDER is not None:
        _reorder(items)
    if os.environ.get("HICACHE_SANITIZED") == "1":
        import pytest

        for item in items:
            for mark in item.iter_markers("sanitizer_free"):
                item.add_marker(pytest.mark.skip(reason=f"not under AddressSanitizer: {mark.args[0]}"))
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


def pytest_addoption(parser):
    parser.addoption("--sglang-on-one-worker", action="store_true",
                     help="run the tests that import SGLang in-process on one xdist worker (tests/worker_groups.py)")


@pytest.hookimpl(optionalhook=True)  # an xdist hook: absent where the suite runs without xdist
def pytest_xdist_make_scheduler(config, log):
    """--sglang-on-one-worker: tests/worker_groups.py's scheduler, unless another --dist was
    asked for (xdist's default with -n is "load"); otherwise xdist's --dist."""
    if not config.getoption("sglang_on_one_worker") or config.getoption("dist") != "load":
        return None
    from worker_groups import scheduler

    return scheduler(config, log)


#: Settings of the machine running the tests that would change what the tests see: every row of
#: hicache's environment table (the runtime directory is set below) and the variables beside it.
_MACHINE_SETTINGS = (
    *(s.name for s in __import__("hicache.plan._env", fromlist=["SETTINGS"]).SETTINGS
      if s.name != "HICACHE_RUNTIME_DIR"),
    "LOCAL_WORLD_SIZE", "SGLANG_HICACHE_HOST_REGISTER_CHUNK_GB",
)


@pytest.fixture(autouse=True, scope="session")
def _no_machine_settings():
    """Tests set the HICACHE_* variables they test; the runner's own never leak in."""
    saved = {name: os.environ.pop(name) for name in _MACHINE_SETTINGS if name in os.environ}
    yield
    os.environ.update(saved)


@pytest.fixture(autouse=True)
def _no_trace_recording_left():
    """A trace recording lasts for the rest of its process (`hicache.effects._trace.start`, what a
    bring-up given a trace file does): it never runs on into the next test, where it would take
    that test's own trace and its bring-ups' spans (seen: a worker's later trace and progressive
    tests failing after one in-process traced bring-up)."""
    yield
    recorder = sys.modules.get("hicache.effects._trace")  # only where a test imported it
    if recorder is not None:
        recorder.stop()


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


@pytest.fixture(autouse=True, scope="session")
def _a_small_machine():
    """psutil reports a 4 GB machine with 3 GB available for the whole run: a test that reads
    the real machine's memory instead of injecting facts (tests/machine.py) fails everywhere,
    not only on small CI boxes."""
    import collections

    import psutil

    from machine import SMALL_AVAILABLE, SMALL_TOTAL

    real = psutil.virtual_memory
    Memory = collections.namedtuple("svmem", real()._fields)

    def small():
        values = real()._asdict()
        values.update(total=SMALL_TOTAL, available=SMALL_AVAILABLE, free=SMALL_AVAILABLE)
        return Memory(**values)

    small.__wrapped__ = real  # for tests that need the real figure (tests/test_ranks.py)
    psutil.virtual_memory = small
    yield
    psutil.virtual_memory = real


@pytest.fixture
def cudart(monkeypatch):
    """SGLang's own tests' fake: torch.cuda.cudart() returns a FakeCudart with int codes, and
    SGLang's registration chunk is 1 GiB."""
    import torch

    from hicache.compat.sglang import CHUNK_ENV
    from hicache.testing import FakeCudart

    fake = FakeCudart()
    monkeypatch.setattr(torch.cuda, "cudart", lambda: fake)
    monkeypatch.setenv(CHUNK_ENV, "1")
    return fake


@pytest.fixture(scope="session")
def fork_server():
    """One fork server for this test process (tests/forked.py): child scripts forked from an
    interpreter that imported torch and hicache once, as `subprocess.Popen` would start them."""
    from forked import ForkServer

    server = ForkServer()
    yield server
    server.close()
