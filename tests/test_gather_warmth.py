"""The gather kernel is compiled when a pool is built, not at its first transfer: a pool's build
warms, in the background, the word size of every batch its transfers will launch (an oracle:
the words the transfers then use); each (device, word) compiles once per process, whoever asks
first; a kernel that cannot build leaves its words to torch's index kernels, the pool serving
the same bytes. Run on CPU tensors, where the kernel is interpreted: the launch is a stand-in
that records who asked, so order is proved from events."""

from __future__ import annotations

import logging
import sys
import threading

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from hicache.effects import CopyEngine, HostSetup
from hicache.effects._copy._gather import WARM_THREAD, WARMTH, GatherCopy, KernelWarmth, launch_empty, word_of

from hicache.pools import MHATokenToKVPoolHost
from hicache.testing import MHADevicePool
from machine import ROOMY
from test_pool_layout_oracle import LIMITS
from test_pools import CASES, make, round_trip
from triton_support import known_cause, require_interpreter

torch = pytest.importorskip("torch")


@pytest.fixture
def launches(monkeypatch):
    """The process's record, cleared once no warm-up runs, with a launch that logs (device, word, thread) and then
    runs the real empty launch (the interpreter here); cleared again after."""
    require_interpreter()
    log: list = []

    def recording(device, word):
        log.append((device, word, threading.current_thread().name))
        launch_empty(device, word)

    _join_warming()  # an earlier test's pool may still be warming: its launch is not this test's
    WARMTH.forget()
    monkeypatch.setattr(WARMTH, "launch", recording)
    yield log
    WARMTH.forget()


@pytest.fixture
def runs(monkeypatch):
    """Every gather batch run: (word, runner, what run() returned)."""
    log: list = []
    run = GatherCopy.run

    def recording(self):
        result = run(self)
        log.append((self.word, self.runner, result))
        return result

    monkeypatch.setattr(GatherCopy, "run", recording)
    return log


def _join_warming() -> None:
    assert WARMTH.settle(60), "a warm-up thread still runs"


def _host_bytes(pool, device) -> list:
    """A write-back then a load of three random pages (`test_pools.round_trip`: the device rows
    come back); the host bytes after the write-back."""
    return round_trip(pool, device, seed=3, pages_seed=2, pages=3, backend="kernel")[1]


@pytest.mark.timeout(120)
@pytest.mark.parametrize("name, layout", CASES, ids=[f"{n}-{l}" for n, l in CASES])
def test_a_pool_build_warms_every_word_its_transfers_launch(name, layout, launches, runs):
    """Built for the gather, a pool compiles - on its warm-up thread, before any transfer - the
    kernel for each word size its batches then use; the transfers compile nothing more and
    every batch runs the kernel (not the torch fallback)."""
    pool, device = make(name, layout, copy_engine=CopyEngine(transfer="gather", programs=2))
    try:
        _join_warming()
        warmed = {word for _, word, thread in launches}
        assert all(thread == WARM_THREAD for _, _, thread in launches)
        built = list(launches)
        _host_bytes(pool, device)
        assert runs, "no batch went through the gather"
        assert launches == built, f"a transfer compiled: {launches[len(built):]}"
        assert {word for word, _, _ in runs} <= warmed
        assert {runner for _, runner, _ in runs} == {"triton"}
    finally:
        pool.destroy()


@pytest.mark.timeout(300)
@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(layout=st.sampled_from(["layer_first", "page_first", "page_first_direct", "page_head"]),
       dtype=st.sampled_from(["bfloat16", "float32", "uint8", "float64"]), head_num=st.sampled_from([1, 2, 3]),
       head_dim=st.sampled_from([1, 3, 4, 8]), page_size=st.sampled_from([1, 2, 4]))
def test_any_row_size_warms_exactly_the_words_its_transfers_use(launches, runs, layout, dtype, head_num, head_dim,
                                                                page_size):
    """MHA pools of any row size and dtype (words of 1, 2, 4 and 8 bytes): the build warms the
    word of every batch the transfers then run, and the transfers compile nothing."""
    WARMTH.forget()
    launches.clear()
    runs.clear()
    device = MHADevicePool(size=8 * page_size, layer_num=2, head_num=head_num, head_dim=head_dim,
                           page_size=page_size, dtype=getattr(torch, dtype))
    engine = CopyEngine(transfer="gather", programs=2)
    pool = MHATokenToKVPoolHost(device, 2.0, 0, page_size, layout, False, "cpu",
                                host=HostSetup(limits=LIMITS, machine=ROOMY, copy_engine=engine))
    try:
        _join_warming()
        built = list(launches)
        host_idx = torch.arange(2 * page_size) + page_size
        device_idx = torch.arange(2 * page_size) + 3 * page_size
        pool.backup_from_device_all_layer(device, host_idx, device_idx, "kernel")
        pool.load_to_device_per_layer(device, host_idx, device_idx, 1, "kernel")
        assert runs and launches == built
        assert {word for word, _, _ in runs} <= {word for _, word, _ in built}
    finally:
        pool.destroy()


def test_without_the_gather_a_pool_build_warms_nothing(launches):
    """HICACHE_TRANSFER=dma (and host memory under auto): no warm-up thread, nothing compiled."""
    for transfer in ("dma", "auto"):
        pool, device = make("mha", "page_first", copy_engine=CopyEngine(transfer=transfer))
        try:
            _join_warming()
            _host_bytes(pool, device)
        finally:
            pool.destroy()
    assert launches == []


@pytest.mark.timeout(120)
def test_a_kernel_that_cannot_build_leaves_its_words_to_torch_and_the_bytes_are_the_same(
        monkeypatch, runs, caplog):
    """A launch that fails (a Triton that cannot compile here) at the build: the pool is built,
    the failure is logged once naming the word and why, the batches run through torch's index
    kernels - and the host bytes and device rows equal the working kernel's."""
    require_interpreter()
    pool, device = make("mha", "page_first", copy_engine=CopyEngine(transfer="gather", programs=2))
    try:
        _join_warming()
        good = _host_bytes(pool, device)
    finally:
        pool.destroy()

    def failing(device, word):
        raise RuntimeError("PTX .version 8.7 does not support .target sm_90\nmore lines")

    WARMTH.forget()
    monkeypatch.setattr(WARMTH, "launch", failing)
    runs.clear()
    try:
        with caplog.at_level(logging.WARNING, logger="hicache.effects._copy._gather"):
            pool, device = make("mha", "page_first", copy_engine=CopyEngine(transfer="gather", programs=2))
            try:
                _join_warming()
                assert all(torch.equal(a, b) for a, b in zip(_host_bytes(pool, device), good))
            finally:
                pool.destroy()
        states = WARMTH.states()
        assert states and all(reason == "RuntimeError: PTX .version 8.7 does not support .target sm_90"
                              for reason in states.values())
        assert {runner for _, runner, _ in runs} == {"torch"}
        assert {result for _, _, result in runs} == {"gather-torch"}
        warnings = [r.getMessage() for r in caplog.records if "does not run" in r.getMessage()]
        assert len(warnings) == len(states) and "8-byte words" in warnings[0] and "sm_90" in warnings[0]
    finally:
        WARMTH.forget()


def test_each_pair_is_tried_once_and_a_bad_word_is_refused():
    """warm() launches once per (device, word) - the answer, ready or why not, is kept - and
    refuses a word the kernel has no type for, naming it."""
    calls: list = []

    def launch(device, word):
        calls.append((device, word))
        if word == 2:
            raise ValueError("")

    warmth = KernelWarmth(launch=launch)
    assert [warmth.warm(None, 8), warmth.warm(None, 8), warmth.warm("cuda:1", 8)] == [None, None, None]
    assert warmth.warm(None, 2) == "ValueError: " and warmth.warm(None, 2) == "ValueError: "
    assert calls == [(None, 8), ("cuda:1", 8), (None, 2)]
    assert warmth.states() == {("cpu", 8): None, ("cuda:1", 8): None, ("cpu", 2): "ValueError: "}
    with pytest.raises(ValueError, match="word must be one of .* got 16"):
        warmth.warm(None, 16)
    warmth.forget()
    warmth.warm(None, 8)
    assert calls[-1] == (None, 8) and len(calls) == 4


def test_where_triton_does_not_import_no_word_is_ready_and_nothing_launches(monkeypatch):
    """Without Triton (not installed, or a broken install) every word's answer is why not - so
    its pieces go to torch's index kernels - and no launch is tried."""
    calls: list = []
    monkeypatch.setattr("hicache.effects._copy._gather.triton_ready", lambda: False)
    warmth = KernelWarmth(launch=lambda device, word: calls.append((device, word)))
    assert warmth.warm(None, 8) == "Triton does not import here" == warmth.warm("cuda:0", 4)
    assert calls == []
    part = (torch.tensor([0]), torch.tensor([0]), torch.tensor([8]), 8, 0x1000, 0x2000)
    monkeypatch.setattr("hicache.effects._copy._gather.WARMTH", warmth)
    assert GatherCopy([part], None, programs=1).runner == "torch"


@pytest.mark.concurrency
@pytest.mark.timeout(60)
def test_a_transfer_that_comes_first_waits_for_the_compile_and_never_runs_it_twice():
    """Two threads ask for the same pair while its launch is still running: one launch; the
    second returns only after it ended (events: start, end, then the second's answer)."""
    events: list = []
    started, release = threading.Event(), threading.Event()

    def slow(device, word):
        events.append("launch-start")
        started.set()
        assert release.wait(30)
        events.append("launch-end")

    warmth = KernelWarmth(launch=slow)
    first = threading.Thread(target=lambda: events.append(("first", warmth.warm(None, 4))))
    first.start()
    assert started.wait(30)
    second = threading.Thread(target=lambda: events.append(("second", warmth.warm(None, 4))))
    second.start()
    assert events == ["launch-start"]  # nothing answers while the launch runs
    release.set()
    first.join(30)
    second.join(30)
    assert events[:2] == ["launch-start", "launch-end"]
    assert sorted(events[2:]) == [("first", None), ("second", None)]


@pytest.mark.concurrency
@pytest.mark.timeout(120)
def test_a_warm_up_beside_a_transfer_leaves_every_batch_exact():
    """A warm-up launching on its own thread while another thread's batches run (Triton's
    interpreter patches triton.language while it runs; threads switched every microsecond): 40 batches, each copying exactly its
    pieces, while the other thread launches again and again - until both are done."""
    require_interpreter()
    src = torch.arange(256, dtype=torch.uint8)
    dst = torch.zeros(256, dtype=torch.uint8)
    offsets = torch.arange(0, 256, 16, dtype=torch.int64)
    sizes = torch.full((16,), 3, dtype=torch.int64)
    batch = GatherCopy([(offsets, offsets, sizes, 48, dst.data_ptr(), src.data_ptr())], None, programs=2,
                       runner="triton")
    done, launched = threading.Event(), []

    def warming():
        while not done.is_set() or len(launched) < 40:
            launch_empty(None, 1)
            launched.append(1)

    interval = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)  # interleave the two threads as finely as the interpreter allows
    other = threading.Thread(target=warming)
    other.start()
    try:
        for _ in range(40):
            dst.zero_()
            assert batch.run() == "gather-interpreted"
            expected = torch.zeros(256, dtype=torch.uint8)
            for start in offsets.tolist():
                expected[start: start + 3] = src[start: start + 3]
            assert torch.equal(dst, expected)
    finally:
        done.set()
        other.join(60)
        sys.setswitchinterval(interval)
    assert not other.is_alive() and len(launched) >= 40


def test_the_word_of_plain_numbers_is_the_widest_dividing_them_all():
    """word_of agrees with the tensor form the batches use (an independent oracle: divisibility
    checked number by number)."""
    from hypothesis import given
    from hypothesis import strategies as st

    @given(st.lists(st.integers(0, 2**48), min_size=1, max_size=8))
    def check(numbers):
        expected = next((w for w in (8, 4, 2) if all(n % w == 0 for n in numbers)), 1)
        assert word_of(numbers) == expected

    check()


def test_the_known_interpreter_break_is_named_for_its_versions_only():
    """Triton before 3.7 beside numpy 2.4 or later is named as triton-lang/triton#9171; a fixed
    Triton or an older numpy is not."""
    assert "triton-lang/triton#9171" in known_cause("3.6.0", "2.4.6")
    assert "#9171" in known_cause("3.2.0", "2.5.2")
    assert known_cause("3.7.0", "2.4.6") == known_cause("3.9.0", "2.5.2") == ""
    assert known_cause("3.6.0", "2.3.5") == known_cause("3.6.0", "1.26.4") == ""
