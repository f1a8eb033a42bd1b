"""Shared set-up for the node store's tests: a private directory on the machine's real tmpfs
(/dev/shm), removed after the test; small arenas (a container's /dev/shm may be 64 MB); a fake
machine root whose mountinfo and sysfs say what a test needs (disk, hugetlbfs, free hugepages)
while statvfs still reads the real directory."""

from __future__ import annotations

import shutil
import tempfile
from pathlib import Path

import pytest

ARENA_BYTES = 8 << 20


def arena_of(slots: int, page_bytes: int) -> int:
    """The size of an arena of exactly ``slots`` slots of ``page_bytes``: its header, namespace
    table and index take 73,728 bytes before the slots' data at such small sizes (the plan's
    ``data_offset``; the tests that use this check the slot count they get)."""
    return 73728 + slots * page_bytes


def build_slotops(directory: Path, define: str):
    """The node store's C helper built from its installed source with ``-D<define>`` (a loop or a
    hook setup.py never builds) and $CFLAGS, as setup.py takes them (`make test-sanitized`'s
    sanitizers), into ``directory`` and loaded beside the build in use; skips, naming why, where
    the helper is not built here or there is no C compiler."""
    import os
    import shlex
    import subprocess
    import sysconfig

    import hicache
    from hicache.effects import arena

    try:
        arena.slot_ops("native")
    except ImportError:
        pytest.skip("the C helper is not built here (no compiler): the fallback runs, and is tested as such")
    source = Path(hicache.__file__).parent / "effects" / "_arena" / "_slotops.c"
    compiler = (sysconfig.get_config_var("CC") or "cc").split()
    if not source.is_file() or shutil.which(compiler[0]) is None:
        pytest.skip(f"no C compiler ({compiler[0]}) or no {source.name} here: -D{define} is built where both are")
    target = directory / ("_slotops" + sysconfig.get_config_var("EXT_SUFFIX"))
    subprocess.run([*compiler, "-shared", "-fPIC", "-O3", "-std=gnu99", f"-D{define}",
                    *shlex.split(os.environ.get("CFLAGS", "")), f"-I{sysconfig.get_paths()['include']}", str(source),
                    "-o", str(target)],
                   check=True, capture_output=True, timeout=180)
    return load_slotops(target, f"{define.lower()}._slotops")


def load_slotops(path, name: str):
    """A build of the C helper at ``path`` loaded under ``name``, beside the one in use."""
    import importlib.util

    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def leave_torn(store, slot: int) -> None:
    """Make a published slot's generation odd, as a writer kill -9ed mid-write leaves it (a slot
    already odd or never written is left as it is)."""
    addr = store.arena.record_addr(slot)
    gen = store.arena.ops.load(addr)
    if gen and not gen & 1:
        store.arena.ops.store(addr, gen + 1)


@pytest.fixture
def shm_dir():
    path = Path(tempfile.mkdtemp(prefix="hicache-test-", dir="/dev/shm"))
    try:
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)


def fake_root(tmp_path: Path, directory: Path, fstype: str, options: str = "rw", *, free_hugepages=None,
              hugepage_kb: int = 2048) -> str:
    """A machine root whose /proc/self/mountinfo mounts ``directory`` as ``fstype`` with super
    options ``options`` (and / as ext4), and whose sysfs has ``free_hugepages`` of that size."""
    root = tmp_path / "root"
    (root / "proc/self").mkdir(parents=True)
    (root / "proc/self/mountinfo").write_text(
        "1 0 8:1 / / rw,relatime - ext4 /dev/vda rw\n"
        f"2 1 0:5 / {directory} rw,nosuid - {fstype} {fstype} {options}\n"
    )
    if free_hugepages is not None:
        pages = root / f"sys/kernel/mm/hugepages/hugepages-{hugepage_kb}kB"
        pages.mkdir(parents=True)
        (pages / "nr_hugepages").write_text(f"{free_hugepages}\n")
        (pages / "free_hugepages").write_text(f"{free_hugepages}\n")
    return str(root)


class Zygote:
    """tests/store_child.py as a context manager: `start` forks a task, `wait_for` reads its
    events (a deadline only as a hang guard), `result` its report, `kill` sends SIGKILL."""

    def __init__(self, *, sglang: bool = False, env=None) -> None:
        import os
        import queue
        import subprocess
        import sys
        import threading

        here = Path(__file__).resolve().parent
        self.process = subprocess.Popen(
            [sys.executable, str(here / "store_child.py"), *(["--sglang"] if sglang else [])], cwd=here.parent,
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env={**os.environ, **(env or {})},
        )
        self.lines: dict = {}
        self.pids: dict = {}
        self._queue: queue.Queue = queue.Queue()
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()
        self._take("zygote", "ready", timeout=600)

    def _read(self) -> None:
        for line in self.process.stdout:
            self._queue.put(line.rstrip("\n"))
        self._queue.put(None)

    def _take(self, task: str, event: str, *, timeout: float) -> list:
        import queue
        import time

        deadline = time.monotonic() + timeout
        while True:
            for i, words in enumerate(self.lines.get(task, [])):
                if words[0] == event or (event == "done" and words[0] == "error"):
                    return self.lines[task].pop(i)
            try:
                line = self._queue.get(timeout=max(0.01, deadline - time.monotonic()))
            except queue.Empty:
                raise AssertionError(f"hang guard: task {task} never said {event!r}; it said {self.lines.get(task)}")
            if line is None:
                raise AssertionError(f"the zygote ended; task {task} said {self.lines.get(task)}")
            if line == "ready":
                self.lines.setdefault("zygote", []).append(["ready"])
                continue
            name, _, rest = line.partition(" ")
            words = rest.split(" ", 1) if rest.startswith(("done ", "error ")) else rest.split()
            if words[:1] == ["pid"]:
                self.pids[name] = int(words[1])
            self.lines.setdefault(name, []).append(words)

    def start(self, task: str, role: str, **args) -> int:
        """Fork a task named ``task`` (a name may be reused by later tests: each start gets an
        id of its own, so an earlier task's unread events are never taken for this one's)."""
        import json

        self._seq = getattr(self, "_seq", 0) + 1
        self.current = getattr(self, "current", {})
        self.current[task] = run = f"{task}.{self._seq}"
        self.process.stdin.write(json.dumps({"id": run, "role": role, "args": args}) + "\n")
        self.process.stdin.flush()
        self._take(run, "pid", timeout=120)
        return self.pids[run]

    def wait_for(self, task: str, event: str, *, timeout: float = 300) -> list:
        return self._take(self.current[task], event, timeout=timeout)

    def result(self, task: str, *, timeout: float = 300):
        import json

        words = self._take(self.current[task], "done", timeout=timeout)
        if words[0] == "error":
            raise AssertionError(f"task {task} failed:\n{json.loads(words[1])}")
        return json.loads(words[1])

    def kill(self, task: str) -> None:
        """SIGKILL the task and return once it is gone (its pidfd is readable: the kernel has
        released its locks and mappings) - the next attach must not race its death."""
        import os
        import select
        import signal

        pid = self.pids[self.current[task]]
        pidfd = os.pidfd_open(pid)
        try:
            os.kill(pid, signal.SIGKILL)
            ready, _, _ = select.select([pidfd], [], [], 120)  # a hang guard
            assert ready, f"hang guard: task {task} outlived SIGKILL for 120 s"
        finally:
            os.close(pidfd)

    def close(self) -> None:
        """Kill every task still running (a test that failed half-way leaves some waiting for
        a barrier that will not come), end the zygote, and close its pipe once the reader thread
        saw its end (closing it under a blocked read would wait forever)."""
        import os
        import signal

        for pid in self.pids.values():
            try:
                os.kill(pid, signal.SIGKILL)  # gone already: ESRCH (its pid may be reused only by ours)
            except OSError:
                pass
        from forked import end_server

        end_server(self.process, self._reader)

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.close()


class StoppingOps:
    """A store's slot ops (``real``) that stop inside every page copy or read until ``go`` is set;
    ``inside`` says a copy got there. Put in place as ``store.index.ops = StoppingOps(...)``."""

    def __init__(self, real) -> None:
        import threading

        self.real = real
        self.inside, self.go = threading.Event(), threading.Event()

    def __getattr__(self, name):
        return getattr(self.real, name)

    def _stop(self) -> None:
        self.inside.set()
        assert self.go.wait(60), "hang guard"

    def copy_pages(self, direction, *args):
        self._stop()
        return self.real.copy_pages(direction, *args)

    def read_pages(self, *args, **kwargs):
        self._stop()
        return self.real.read_pages(*args, **kwargs)


class MovedOnAfterLookup:
    """The arena's ops, but between a read's lookup and its record read ``change(found, gens)``
    runs - a writer arriving then (read_pages over slots the caller looked up: its seam)."""

    def __init__(self, ops, change) -> None:
        self.ops, self.change = ops, change

    def __getattr__(self, name):
        return getattr(self.ops, name)

    def read_pages(self, index_addr, data_addr, nslots, window, *rest):
        found, gens = self.ops.lookup(index_addr, nslots, window, rest[2])
        gens = self.change(found, gens)
        return self.ops.read_pages(index_addr, data_addr, nslots, window, *rest, found=found, gens=gens)


def wait_until(predicate, *, timeout_s: float = 60) -> None:
    """Poll ``predicate`` until it holds; the deadline is only a hang guard."""
    import time

    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, "hang guard"
        time.sleep(0.001)
