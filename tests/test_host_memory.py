"""Host memory: page-aligned mmap tensors, parallel pre-fault, no unmap while registered, and
pages given back in parallel - at the interpreter's exit too."""

from __future__ import annotations

import subprocess
import sys
import threading
from concurrent.futures import ThreadPoolExecutor

import pytest
from hypothesis import given
from hypothesis import strategies as st

from hicache.effects import HostLedger
from hicache.effects._host import _memory as _host_memory, _release
from hicache.effects._host._memory import PREFAULT_PIECE_BYTES, allocate_host, prefault, started_executor
from hicache.effects._bringup._faulting import BACKGROUND_NICE, PIECE_BYTES, Prefaulter, _cpus_text  # the pre-fault pool's internals, under test
from hicache.effects import apply_plan, os_page_bytes
from hicache.errors import HostOutOfMemoryError, PlanError, RegistrationStateError
from hicache.plan import Limits, plan_registration
from hicache.testing import FakeRuntime

pytestmark = pytest.mark.concurrency  # processes, threads, signals or waits: `make test-loaded`

torch = pytest.importorskip("torch")


def test_allocation_is_page_aligned_and_backs_a_tensor():
    """The base is OS-page aligned and the tensor has exactly nbytes, mapping rounded up."""
    page = os_page_bytes()
    buffer = allocate_host(3 * page + 5)
    assert buffer.ptr % page == 0 and buffer.tensor.numel() == 3 * page + 5
    assert buffer.mapped_bytes == 4 * page
    buffer.tensor[-1] = 7
    assert buffer.view(torch.uint8, (3 * page + 5,))[-1] == 7
    buffer.free()
    buffer.free()  # idempotent
    assert buffer.freed
    with pytest.raises(RegistrationStateError, match="freed"):
        buffer.tensor


def test_prefault_keeps_contents_and_reports():
    """Pre-faulting from several threads keeps data and reports how it ran."""
    buffer = allocate_host(8 * 2**20)
    buffer.tensor[12345] = 42
    report = prefault(buffer, threads=2, piece_bytes=2**20)
    assert report.pieces == 8 and report.threads == 2
    assert report.method in ("madvise", "touch", "madvise+touch")
    assert int(buffer.tensor[12345]) == 42
    buffer.free()


def test_memory_still_registered_is_never_unmapped():
    """free() refuses while the ledger says any of the buffer is registered, then succeeds."""
    buffer = allocate_host(4 * os_page_bytes())
    ledger = HostLedger()
    plan = plan_registration(buffer.nbytes, granularity_bytes=4096, limits=Limits(chunk_limit_bytes=8192))
    registration = apply_plan(plan, base_ptr=buffer.ptr, runtime=FakeRuntime(), ledger=ledger)
    with pytest.raises(RegistrationStateError, match="still registered"):
        buffer.free(ledger=ledger)
    assert not buffer.freed
    registration.release()
    buffer.free(ledger=ledger)
    assert buffer.freed


def test_views_keep_the_mapping_alive_after_free():
    """A view taken before free() stays valid: the mapping goes when the last view does."""
    buffer = allocate_host(2 * os_page_bytes())
    view = buffer.tensor[:16]
    view.fill_(3)
    buffer.free()
    assert int(view.sum()) == 48


def test_zero_byte_allocation_is_empty():
    """allocate_host(0) maps nothing and frees cleanly."""
    buffer = allocate_host(0)
    assert buffer.nbytes == 0 and buffer.ptr == 0
    assert prefault(buffer).pieces == 0
    buffer.free()


def test_required_hugepages_say_free_versus_needed(tmp_path):
    """With no reserved hugepages, 'required' fails naming pages needed and free."""
    pool = tmp_path / "sys/kernel/mm/hugepages/hugepages-2048kB"
    pool.mkdir(parents=True)
    (pool / "nr_hugepages").write_text("4\n")
    (pool / "free_hugepages").write_text("1\n")
    with pytest.raises(HostOutOfMemoryError, match=r"needs 3 pages of 2 MiB, 1 free of 4 reserved"):
        allocate_host(5 * 2**20, hugepages="required", sysfs_root=str(tmp_path))
    buffer = allocate_host(5 * 2**20, hugepages="prefer", sysfs_root=str(tmp_path))
    assert buffer.hugepage_bytes is None and "using normal pages" in buffer.notes[0]
    buffer.free()


def test_bad_arguments():
    """Negative sizes and unknown hugepage modes are refused by name."""
    with pytest.raises(PlanError, match="allocate_host.nbytes must be >= 0, got -1"):
        allocate_host(-1)
    with pytest.raises(PlanError, match="hugepages must be one of"):
        allocate_host(4096, hugepages="yes")


def _failing_madvise(code):
    import ctypes

    def madvise(addr, length, advice):
        ctypes.set_errno(code)
        return -1

    return lambda: madvise


def test_prefault_falls_back_to_touching_pages(monkeypatch):
    """On a kernel without MADV_POPULATE_WRITE (EINVAL) every page is touched, data kept."""
    import errno

    monkeypatch.setattr(_host_memory, "_madvise", _failing_madvise(errno.EINVAL))
    buffer = allocate_host(4 * 2**20)
    buffer.tensor[4096 * 3] = 9
    report = prefault(buffer, threads=2, piece_bytes=2**20)
    assert report.method == "touch" and int(buffer.tensor[4096 * 3]) == 9
    buffer.free()


def test_prefault_enomem_is_host_out_of_memory(monkeypatch):
    """ENOMEM from MADV_POPULATE_WRITE becomes HostOutOfMemoryError, not the OOM killer."""
    import errno

    monkeypatch.setattr(_host_memory, "_madvise", _failing_madvise(errno.ENOMEM))
    buffer = allocate_host(2 * 2**20)
    with pytest.raises(HostOutOfMemoryError, match="out of memory"):
        prefault(buffer, threads=1)
    buffer.free()


def _recording_madvise(calls: list, *, fail_at: int | None = None, on_call=None, delay: float = 0.0,
                       started: list | None = None, failed: list | None = None):
    """A stand-in for libc's madvise: records ``(address, length, prefault threads alive)``
    per call (faulting nothing) and, in ``started``, when each began; call ``fail_at`` fails
    with ENOMEM (``failed``: when it returned)."""
    import ctypes
    import errno
    import time

    lock = threading.Lock()
    started = [] if started is None else started
    failed = [] if failed is None else failed

    def madvise(addr, length, advice):
        with lock:
            live = sum(t.name.startswith("hicache-prefault_") for t in threading.enumerate())
            calls.append((addr, length, live))
            number = len(calls)
            started.append(time.perf_counter())
        if on_call is not None:
            on_call(number)
        time.sleep(delay)
        if number == fail_at:
            failed.append(time.perf_counter())
            ctypes.set_errno(errno.ENOMEM)
            return -1
        return 0

    return lambda: madvise


def test_prefault_calls_stay_small_and_start_once_every_thread_runs(monkeypatch):
    """A MADV_POPULATE_WRITE call holds the process's mmap lock for its whole range: every
    mmap, munmap and thread start in the process (a serving engine's too) waits behind it
    (measured here: a 1 MiB mmap waited 592 ms behind a 2 GiB call, 309 ms behind 512 MiB).
    So no call covers more than PREFAULT_PIECE_BYTES, the calls tile the mapping exactly, and
    none starts before every worker thread exists (a thread started beside a running call
    waits for it: the second of two threads began only when the first's 2 GiB was done)."""

    calls: list = []
    monkeypatch.setattr(_host_memory, "_madvise", _recording_madvise(calls))
    page = os_page_bytes()
    buffer = allocate_host(5 * PREFAULT_PIECE_BYTES + 3 * page - 7)  # virtual: nothing is faulted
    report = prefault(buffer, threads=3)
    spans = sorted((addr - buffer.ptr, length) for addr, length, _ in calls)
    assert spans[0][0] == 0 and all(a + n == b for (a, n), (b, _) in zip(spans, spans[1:]))
    assert spans[-1][0] + spans[-1][1] == buffer.mapped_bytes
    assert max(n for _, n in spans) <= PREFAULT_PIECE_BYTES <= 64 * 2**20  # <= ~32 ms of mmap lock here
    assert [live for *_, live in calls] == [3] * len(calls)
    assert (report.pieces, report.threads, report.method) == (6, 3, "madvise")
    buffer.free()


def test_the_prefault_pool_has_every_thread_running_when_returned():
    """started_executor: all of its threads exist before anything is submitted."""


    pool = started_executor(4, prefix="hicache-test-started")
    try:
        assert sum(t.name.startswith("hicache-test-started_") for t in threading.enumerate()) == 4
    finally:
        pool.shutdown(wait=True)


def test_a_failing_piece_stops_the_other_threads_after_their_call_in_flight(monkeypatch):
    """ENOMEM on one piece: the error is raised once every thread has ended, and once it is
    known no thread takes a new piece (but the one the other thread may be taking then)."""
    calls, started, failed = [], [], []
    monkeypatch.setattr(_host_memory, "_madvise",
                        _recording_madvise(calls, fail_at=3, delay=0.002, started=started, failed=failed))
    buffer = allocate_host(64 * 2**20)
    with pytest.raises(HostOutOfMemoryError, match="out of memory"):
        prefault(buffer, threads=2, piece_bytes=2**20)
    assert len([t for t in started if t > failed[0]]) <= 1  # the other thread's next piece at most
    buffer.free()


def test_ctrl_c_while_prefaulting_stops_the_threads_before_it_is_raised(monkeypatch):
    """A Ctrl-C reaching the waiting caller stops the workers after their call in flight and
    is raised only once none is still faulting (the memory may be freed next), without
    faulting the rest of the buffer first."""
    import signal
    import time

    calls: list = []
    in_flight = [0]
    lock = threading.Lock()
    def on_call(number: int) -> None:
        if number == 4:
            signal.pthread_kill(threading.main_thread().ident, signal.SIGINT)
        if number >= 4:
            time.sleep(0.05)  # every call from here on is still running when Ctrl-C lands

    record = _recording_madvise(calls, delay=0.005, on_call=on_call)()

    def madvise(addr, length, advice):
        with lock:
            in_flight[0] += 1
        try:
            return record(addr, length, advice)
        finally:
            with lock:
                in_flight[0] -= 1

    monkeypatch.setattr(_host_memory, "_madvise", lambda: madvise)
    buffer = allocate_host(256 * 2**20)
    try:
        with pytest.raises(KeyboardInterrupt):
            prefault(buffer, threads=2, piece_bytes=2**20)
        assert in_flight[0] == 0
        made = len(calls)
        time.sleep(0.1)
        assert len(calls) == made < 256 // 2
    finally:
        buffer.free()


@pytest.mark.parametrize("threads", [1, 2])
def test_the_pipelines_prefault_calls_stay_small_too(monkeypatch, threads):
    """The pipelined bring-up's background pre-fault reports progress every PIECE_BYTES
    (256 MiB) but still faults at most PREFAULT_PIECE_BYTES a call, every thread of its pool
    started before the first."""

    calls: list = []
    monkeypatch.setattr(_host_memory, "_madvise", _recording_madvise(calls))
    buffer = allocate_host(PIECE_BYTES + 5 * os_page_bytes())  # virtual: nothing is faulted
    faulter = Prefaulter([buffer], threads=threads).start()
    faulter.join()
    assert faulter.done == [buffer.nbytes]
    assert sum(n for _, n, _ in calls) == buffer.mapped_bytes
    assert max(n for _, n, _ in calls) <= PREFAULT_PIECE_BYTES
    assert {live for *_, live in calls} == ({threads} if threads > 1 else {0})
    buffer.free()


def test_the_pipelines_threads_do_not_wait_for_each_other_at_piece_ends(monkeypatch):
    """The background pre-fault streams its calls: while one thread is held up on a slow call,
    the other goes on past the end of that piece (and of its span) instead of idling until
    the slow call ends - and progress is still reported in order: nothing past the slow call
    counts as resident before it ends."""
    import time


    piece = 2**20
    starts, slow_end, seen = [], [], []

    def madvise(addr, length, advice):
        starts.append((addr, time.perf_counter()))
        if len(starts) == 1:
            time.sleep(0.2)
            seen.append(list(faulter.done))  # nothing counted past the call still in flight
            slow_end.append(time.perf_counter())
        return 0

    monkeypatch.setattr(_host_memory, "_madvise", lambda: madvise)
    buffers = [allocate_host(4 * piece), allocate_host(4 * piece)]
    order = [(0, 0, 2 * piece), (0, 2 * piece, 2 * piece), (1, 0, 4 * piece)]
    faulter = Prefaulter(buffers, threads=2, piece_bytes=piece, order=order).start()
    faulter.join()
    first = starts[0][0]
    assert first == buffers[0].ptr and seen == [[0, 0]]
    assert any(t < slow_end[0] and not first <= addr < first + 2 * piece for addr, t in starts[1:])
    assert faulter.done == [4 * piece, 4 * piece] and faulter.spans_done == 3
    for buffer in buffers:
        buffer.free()


def test_a_ctrl_c_at_any_step_of_handing_out_the_pieces_is_raised_only_once_no_call_runs(monkeypatch):
    """Whichever bytecode of the caller's side a Ctrl-C lands on - submitting the tasks,
    waiting, collecting their results - prefault raises it only once no call is faulting and
    none starts afterwards (traced at opcode level, as CPython delivers signals)."""
    import signal
    import sys
    import time

    in_flight, lock, calls = [0], threading.Lock(), []

    def madvise(addr, length, advice):
        with lock:
            in_flight[0] += 1
            calls.append(addr)
        time.sleep(0.004)
        with lock:
            in_flight[0] -= 1
        return 0

    class Recording:  # the executor prefault is given: every task it was handed is known
        def __init__(self, pool):
            self.pool, self.futures = pool, []

        def submit(self, *args):
            future = self.pool.submit(*args)
            self.futures.append(future)
            return future

        def shutdown(self, wait=True):  # prefault's own shutdown: the test reuses the threads
            pass

    monkeypatch.setattr(_host_memory, "_madvise", lambda: madvise)
    here = _host_memory.__file__
    buffer = allocate_host(12 * 2**20)
    pool = Recording(_host_memory.started_executor(2))
    monkeypatch.setattr(_host_memory, "started_executor", lambda workers, prefix="", nice=0: pool)
    landed = []
    try:
        target = 0
        while True:
            target += 1
            seen = [0]

            def trace(frame, event, arg):
                if frame.f_code.co_filename != here or frame.f_code.co_name not in ("_run_workers", "<genexpr>"):
                    return None
                frame.f_trace_opcodes = True
                if event == "opcode":
                    seen[0] += 1
                    if seen[0] == target:
                        time.sleep(0.002)  # the tasks handed out so far are faulting by now
                        signal.getsignal(signal.SIGINT)(signal.SIGINT, frame)
                return trace

            calls.clear()
            here_frame = sys._getframe()
            # Python 3.12 sends opcode events only where a frame asked for them before settrace
            # (cpython gh-114480); 3.11 and 3.13 honour the flag set inside the trace function
            here_frame.f_trace_opcodes = True
            sys.settrace(trace)
            try:
                prefault(buffer, threads=2, piece_bytes=2**20)
                interrupted = False
            except KeyboardInterrupt:
                interrupted = True
            finally:
                sys.settrace(None)
                here_frame.f_trace_opcodes = False
            if not interrupted:
                break  # past the last opcode: every later target is the same
            landed.append(target)
            assert in_flight[0] == 0 and all(f.done() for f in pool.futures), target
            made = len(calls)
            time.sleep(0.01)
            assert len(calls) == made, target
    finally:
        pool.pool.shutdown(wait=True)
        buffer.free()
    assert len(landed) > 20


def test_background_prefault_threads_run_nicer_than_the_caller():
    """started_executor(nice=n): every thread runs n steps nicer than the caller, so the
    register calls and serving threads beside a background pre-fault get the cores first."""
    import os


    mine = os.getpriority(os.PRIO_PROCESS, threading.get_native_id())
    pool = started_executor(2, prefix="hicache-test-nice", nice=3)
    try:
        theirs = {pool.submit(lambda: os.getpriority(os.PRIO_PROCESS, threading.get_native_id())).result()
                  for _ in range(8)}
    finally:
        pool.shutdown(wait=True)
    assert theirs == {min(mine + 3, 19)}


@pytest.mark.parametrize("threads", [1, 2])
def test_the_pipelines_prefault_runs_at_background_priority(monkeypatch, threads):
    """Every pre-fault call of the pipelined / progressive bring-up runs BACKGROUND_NICE steps
    nicer than the caller, on one thread or several."""
    import os


    seen = set()

    def madvise(addr, length, advice):
        seen.add(os.getpriority(os.PRIO_PROCESS, threading.get_native_id()))
        return 0

    monkeypatch.setattr(_host_memory, "_madvise", lambda: madvise)
    mine = os.getpriority(os.PRIO_PROCESS, threading.get_native_id())
    buffer = allocate_host(64 * 2**20)
    faulter = Prefaulter([buffer], threads=threads).start()
    faulter.join()
    buffer.free()
    assert BACKGROUND_NICE > 0 and seen == {min(mine + BACKGROUND_NICE, 19)}


def test_a_small_span_is_shared_by_every_pre_fault_thread(monkeypatch):
    """The first span (what the first register call waits for) is small: it is cut into one
    call per thread, so every thread faults it, rather than one thread while the others run
    ahead."""

    calls: list = []
    monkeypatch.setattr(_host_memory, "_madvise", _recording_madvise(calls))
    buffer = allocate_host(96 * 2**20)
    order = [(0, 0, 16 * 2**20), (0, 16 * 2**20, 80 * 2**20)]
    faulter = Prefaulter([buffer], threads=4, order=order).start()
    faulter.join()
    first = sorted(n for addr, n, _ in calls if addr - buffer.ptr < 16 * 2**20)
    buffer.free()
    assert first == [4 * 2**20] * 4


def test_a_forked_child_neither_inherits_nor_touches_the_pool_memory():
    """Host pool memory is mapped MADV_DONTFORK: a forked child (SGLang starts workers) has no
    mapping there - it cannot copy-on-write the parent's pinned pages - and the parent's bytes
    are what the parent wrote, before and after the child ran."""
    import os

    buffer = allocate_host(8 * 2**20)
    try:
        buffer.tensor[::4096] = 7
        start, end = buffer.ptr, buffer.ptr + buffer.mapped_bytes
        read, write = os.pipe()
        pid = os.fork()
        if pid == 0:  # the child: is any of the parent's mapping there?
            try:
                os.close(read)
                inherited = False
                with open("/proc/self/maps") as maps:
                    for line in maps:
                        lo, hi = (int(x, 16) for x in line.split()[0].split("-"))
                        inherited |= lo < end and start < hi
                os.write(write, b"inherited" if inherited else b"absent")
            finally:
                os._exit(0)
        os.close(write)
        seen = os.read(read, 64)
        os.close(read)
        os.waitpid(pid, 0)
        assert seen == b"absent"
        assert int(buffer.tensor[::4096].eq(7).all()) == 1
    finally:
        buffer.free()


def test_free_all_keeps_a_buffer_whose_unmap_was_refused_and_frees_it_later():
    """A buffer still registered (here: in the ledger the allocator frees against) must not be
    forgotten by `free_all`: it stays in `owned()` - what a failed teardown quarantines, so the
    garbage collector never unmaps pinned memory - while every other buffer is freed; once it is
    unregistered a second `free_all` frees it."""
    from hicache.effects import HostTensorAllocator
    from hicache.effects import HostLedger
    from hicache.errors import RegistrationStateError

    allocator, ledger = HostTensorAllocator(prefault_threads=1), HostLedger()
    pinned = allocator.allocate((64 * 1024,), torch.uint8)
    other = allocator.allocate((64 * 1024,), torch.uint8)
    (pinned_buffer,) = [b for b in allocator.owned() if b.ptr == pinned.data_ptr()]
    (other_buffer,) = [b for b in allocator.owned() if b.ptr == other.data_ptr()]
    assert ledger.claim([(pinned.data_ptr(), 4096)]) is None  # as if CUDA still pinned its first page
    del pinned, other
    with pytest.raises(RegistrationStateError, match="still registered"):
        allocator.free_all(ledger=ledger)
    assert allocator.owned() == [pinned_buffer] and not pinned_buffer.freed
    assert other_buffer.freed
    ledger.replace([pinned_buffer.ptr], [])
    allocator.free_all(ledger=ledger)
    assert allocator.owned() == [] and pinned_buffer.freed


def test_a_freed_buffer_gives_its_pages_back_in_parallel_pieces_then_unmaps(monkeypatch):
    """give_back frees every page of a pre-faulted range from several threads (the range stays
    mapped, nothing resident, reads as zeros); HostBuffer.free calls it over the whole mapping
    before the unmap, and a range of one piece is left to munmap alone."""

    from hicache.effects._host._tiers import resident_bytes

    monkeypatch.setattr(_release, "RELEASE_PIECE_BYTES", 64 * 1024)
    buffer = allocate_host(1024 * 1024)
    prefault(buffer, threads=1)
    buffer.tensor.fill_(7)
    assert resident_bytes(buffer.ptr, buffer.mapped_bytes) == buffer.mapped_bytes
    names = set()
    real = _release._libc_madvise

    def recording():
        madvise = real()
        return lambda *args: names.add(threading.current_thread().name) or madvise(*args)

    monkeypatch.setattr(_release, "_libc_madvise", recording)
    assert _release.give_back(buffer.ptr, buffer.mapped_bytes, threads=4) == 4
    assert resident_bytes(buffer.ptr, buffer.mapped_bytes) == 0 and not buffer.tensor.any()
    assert names and all(n.startswith("hicache-release") for n in names)  # on the pool's threads (how many
    # of its four take a piece is the scheduler's: under load one may take them all)
    assert _release.give_back(buffer.ptr, 64 * 1024, threads=4) == 0  # one piece: munmap alone
    calls = []
    monkeypatch.setattr(_release, "give_back", lambda ptr, length: calls.append((ptr, length)))
    ptr, mapped = buffer.ptr, buffer.mapped_bytes
    buffer.free()
    assert calls == [(ptr, mapped)] and buffer.freed


def _mapped(ptr: int) -> bool:
    """Some mapping of this process covers ``ptr`` (/proc/self/maps)."""
    with open("/proc/self/maps") as maps:
        return any(low <= ptr < high for low, high in
                   ((int(x, 16) for x in line.split()[0].split("-")) for line in maps))


@pytest.mark.parametrize("pieces, threaded", [(16, True), (1, False)])
def test_the_last_view_of_a_freed_buffer_gives_its_pages_back_on_the_release_thread(monkeypatch, pieces, threaded):
    """A mapping that outlives its buffer's free() in a view (the plug-in's seam mode: SGLang keeps
    the tensor) gives its pages back in parallel pieces when that view dies - on the release
    thread, then unmapped there; a mapping of fewer than two pieces is unmapped as it dies, as
    any mmap is."""


    monkeypatch.setattr(_release, "RELEASE_PIECE_BYTES", 1024 * 1024 // pieces)
    calls = []
    monkeypatch.setattr(_release, "give_back", lambda ptr, length: calls.append(
        (ptr, length, threading.current_thread().name)))
    buffer = allocate_host(1024 * 1024)
    ptr, mapped = buffer.ptr, buffer.mapped_bytes
    view = buffer.tensor.view(-1)[:4096]
    buffer.free()
    assert calls == [] and _mapped(ptr)
    del view
    assert _release.wait_for_releases(timeout=60)  # a hang guard: the thread answers in order
    assert calls == ([(ptr, mapped, "hicache-release")] if threaded else []) and not _mapped(ptr)


def test_a_buffer_another_tensor_still_views_is_neither_zapped_nor_unmapped_by_free(monkeypatch):
    """free() while a view of the memory lives elsewhere: no page is given back and nothing is
    unmapped (the view keeps its bytes); the mapping goes with the last view."""

    calls = []
    monkeypatch.setattr(_release, "give_back", lambda ptr, length: calls.append((ptr, length)))
    buffer = allocate_host(1024 * 1024)
    buffer.tensor.fill_(7)
    view = buffer.tensor.view(-1)[:4096]
    buffer.free()
    assert calls == [] and buffer.freed and bool((view == 7).all())


def _strict_overcommit_root(tmp_path, *, mode="2", limit_kb=8 * 2**20, committed_kb=8 * 2**20 - 1024):
    """A /proc under tmp_path where the kernel commits strictly (``mode``) with 1 MiB left."""
    (tmp_path / "proc/sys/vm").mkdir(parents=True)
    (tmp_path / "proc/sys/vm/overcommit_memory").write_text(mode + "\n")
    (tmp_path / "proc/meminfo").write_text(f"MemTotal:       99999999 kB\nCommitLimit:    {limit_kb} kB\n"
                                           f"Committed_AS:   {committed_kb} kB\n")
    return str(tmp_path)


@pytest.mark.parametrize("mode, said", [("2", True), ("0", False)])
def test_an_mmap_refused_under_strict_overcommit_says_the_commit_limit_refused_it(tmp_path, monkeypatch, mode, said):
    """ENOMEM from the pool's mmap under vm.overcommit_memory=2 is HostOutOfMemoryError naming the
    commit limit and the room left (1 MiB here), not bare "out of memory"; in the heuristic mode
    the message stays as it was."""
    import errno

    def refused(length, flags):
        raise OSError(errno.ENOMEM, "Cannot allocate memory")

    monkeypatch.setattr(_host_memory, "_map", refused)
    with pytest.raises(HostOutOfMemoryError) as info:
        allocate_host(2**30, sysfs_root=_strict_overcommit_root(tmp_path, mode=mode))
    message = str(info.value)
    assert message.startswith(f"mmap of {2**30} bytes failed: out of memory")
    assert ("vm.overcommit_memory=2: 1048576 bytes were left to commit" in message) is said, message


# Work handed to threads when the interpreter is exiting: from the atexit handlers on, an executor
# schedules nothing, so a pool destroyed in a server's shutdown hook, or a mapping whose last view
# dies at exit, must do its parallel work on the calling thread - never raise from destroy() or
# print a traceback. `run_each` (hicache.effects._interrupts; give_back's) is the one rule; a real
# interpreter's exit proves it.


def _refusing_after(pool, accepted: int):
    """An executor's submit that takes ``accepted`` calls, then refuses as one does at exit."""
    taken = []

    def submit(function, *arguments):
        if len(taken) >= accepted:
            raise RuntimeError("cannot schedule new futures after interpreter shutdown")
        taken.append(arguments)
        return pool.submit(function, *arguments)

    return submit


@pytest.mark.concurrency
@given(calls=st.integers(0, 12), accepted=st.integers(0, 12))
def test_every_call_runs_once_whether_the_pool_takes_it_or_refuses_it(calls, accepted):
    """run_each runs each call exactly once: the ones the pool took on its threads, the ones it
    refused (the interpreter exiting) on the calling thread, and returns once all have ended."""
    done, lock, caller = [], threading.Lock(), threading.get_ident()

    def record(number):
        with lock:
            done.append((number, threading.get_ident() == caller))

    with ThreadPoolExecutor(max_workers=3) as pool:
        _release.run_each(_refusing_after(pool, accepted), record, [(number,) for number in range(calls)])
        assert sorted(number for number, _ in done) == list(range(calls))
    on_caller = {number for number, here in done if here}
    assert on_caller == set(range(min(accepted, calls), calls))


@pytest.mark.concurrency
def test_an_error_is_raised_only_after_every_call_handed_out_has_ended():
    """A refused call that fails on the calling thread raises only once the calls the pool took
    have finished (they may write into memory the caller frees next)."""
    release, finished = threading.Event(), []

    def work(number):
        if number == 0:
            release.wait(10)
            finished.append(number)
        else:
            release.set()
            raise ValueError(f"call {number}")

    with ThreadPoolExecutor(max_workers=1) as pool:
        with pytest.raises(ValueError, match="call 1"):
            _release.run_each(_refusing_after(pool, 1), work, [(0,), (1,)])
        assert finished == [0]


EXIT_CHILD = """
import atexit
from hicache.effects._host import _release
from hicache.effects._host._memory import allocate_host

size = _release.RELEASE_PIECE_BYTES + 4096 * 16  # two pieces: given back in parallel
freed = allocate_host(size)
viewed = allocate_host(size)
keep = [viewed.tensor[:8]]  # a view that outlives its buffer, as SGLang's pool keeps its tensor
viewed.free()
threads = []
real = _release.give_back

def give_back(ptr, length, **kw):
    threads.append(real(ptr, length, **kw))
    return threads[-1]

_release.give_back = give_back

import torch
from hicache.effects._copy import _host_copy

source = torch.arange(2**21, dtype=torch.int64)  # 16 MiB: a copy the memmove fallback shares out
target = torch.zeros_like(source)
blocks = [torch.tensor([t.data_ptr() + i * 2**20 for i in range(16)]) for t in (target, source)]

@atexit.register
def shutdown():  # registered last, so it runs first: executors refuse work from here on
    _host_copy.copy_host_blocks(*blocks, torch.full((16,), 2**20), threads=4, mode="python")
    assert torch.equal(target, source), "the copy at exit lost bytes"
    freed.free()  # a server's shutdown hook destroying its pool
    keep.clear()  # the last view dies: the release thread gives the mapping back
    assert _release.RELEASER.wait(30), "the release thread did not finish"
    print("given back in", threads, flush=True)
"""


@pytest.mark.concurrency
def test_a_pool_freed_or_dropped_at_the_interpreter_s_exit_gives_its_pages_back_without_an_error():
    """A real interpreter's exit: a host copy on the memmove fallback's threads, a buffer freed in
    an atexit handler and a mapping whose last view dies there all do their work on the exiting
    thread - the copy whole, both buffers given back in pieces - and the process exits 0, nothing
    raised, no traceback on stderr."""
    result = subprocess.run([sys.executable, "-c", EXIT_CHILD], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert "Traceback" not in result.stderr and "failed" not in result.stderr, result.stderr
    assert result.stdout.strip() == "given back in [2, 2]", (result.stdout, result.stderr)


def _span_buffers(*sizes):
    """Stand-ins for HostBuffers as the pre-fault's planning reads them (sizes and pages only)."""
    from types import SimpleNamespace

    return [SimpleNamespace(nbytes=size, page_bytes=4096, hugepage_bytes=None) for size in sizes]


def test_the_pipelines_calls_share_each_span_among_its_threads_and_keep_an_empty_span():
    """Prefaulter's calls: each span is cut into one share per thread (measured from the span's
    own start, not the buffer's), at most PREFAULT_PIECE_BYTES each; an empty span is one empty
    call, so progress passes it in order (without it the span would never count as done)."""
    MiB = 2**20
    faulter = Prefaulter(_span_buffers(64 * MiB), threads=4, order=[(0, 0, 0), (0, 16 * MiB, 32 * MiB)])
    assert faulter._calls() == [(0, 0, 0, 0)] + [(1, 0, (16 + 8 * k) * MiB, 8 * MiB) for k in range(4)]
    one = Prefaulter(_span_buffers(64 * MiB), threads=1)
    assert [length for *_, length in one._calls()] == [PREFAULT_PIECE_BYTES] * 2


@pytest.mark.parametrize("cpus, workers", [(64, 16), (3, 3), (None, 1)])
def test_the_pipeline_takes_a_thread_a_cpu_up_to_16(monkeypatch, cpus, workers):
    """Without ``threads`` the background pre-fault runs a thread per CPU, at most 16, and one
    where the CPU count is unknown: seen as the shares its first span is cut into."""
    monkeypatch.setattr("os.cpu_count", lambda: cpus)
    faulter = Prefaulter(_span_buffers(PREFAULT_PIECE_BYTES))
    assert len(faulter._calls()) == workers
    assert faulter._thread.daemon  # a pre-fault never holds the interpreter's exit


@pytest.mark.concurrency
def test_the_pipelines_seconds_follow_its_clock_while_it_runs_and_once_it_ended(monkeypatch):
    """elapsed(): 0 before the pre-fault starts, the clock since its start while it runs (a
    progressive pool's metrics read it mid-way), and its whole time once it has ended - which
    is also ``seconds``, the report's pre-fault figure (an injected clock: no time judged)."""
    from types import SimpleNamespace

    now, inside, go = [10.0], threading.Event(), threading.Event()
    monkeypatch.setattr("hicache.effects._bringup._faulting.time", SimpleNamespace(perf_counter=lambda: now[0]))

    def on_piece(nbytes):
        inside.set()
        assert go.wait(60)

    buffer = allocate_host(4 * os_page_bytes())
    try:
        faulter = Prefaulter([buffer], threads=1, on_piece=on_piece)
        assert faulter.elapsed() == 0
        faulter.start()
        assert inside.wait(60)
        now[0] = 13.0
        assert faulter.elapsed() == 3.0
        now[0] = 15.0
        go.set()
        faulter.join()
        now[0] = 20.0
        assert faulter.seconds == 5.0 and faulter.elapsed() == 5.0
    finally:
        go.set()
        buffer.free()


@pytest.mark.parametrize("cpus, text", [
    ({0, 1, 2, 3, 8, 10, 11}, "0-3,8,10-11"),
    ({5}, "5"),
    ({0, 2, 4}, "0,2,4"),
    ({7, 6, 5, 1}, "1,5-7"),
])
def test_the_traces_cpu_list_reads_as_the_kernel_writes_one(monkeypatch, cpus, text):
    """A pre-fault span's trace names the CPUs it may run on as the kernel lists them (runs of
    consecutive CPUs as a-b), whatever order the affinity set comes in; None where it is unknown."""
    monkeypatch.setattr("os.sched_getaffinity", lambda pid: cpus)
    assert _cpus_text() == text

    def unknown(pid):
        raise OSError("no")

    monkeypatch.setattr("os.sched_getaffinity", unknown)
    assert _cpus_text() is None
