"""The CUDA copy path, with a fake binding: both cuda-bindings call conventions, the per-page
fallback on cudaErrorNotSupported, and errors named."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from hicache.effects._copy._device import memcpy_batch
from hicache.errors import CudaCallError
from hicache.effects._copy._engine import CopyEngine, cuda_copy as _cuda_copy

cuda_runtime = pytest.importorskip("cuda.bindings.runtime")


class FakeCopyBinding:
    """cudaMemcpyBatchAsync in the 13.x (8 args) or 12.x (9 args, failIdx) convention."""

    cudaMemcpyAttributes = cuda_runtime.cudaMemcpyAttributes
    cudaMemcpySrcAccessOrder = cuda_runtime.cudaMemcpySrcAccessOrder
    cudaMemcpyKind = cuda_runtime.cudaMemcpyKind

    def __init__(self, *, old_convention=False, batch_code=0, log=None):
        self.old_convention, self.batch_code, self.log = old_convention, batch_code, log
        self.batches, self.singles, self.synced, self.streams = [], [], 0, []

    def cudaMemcpyBatchAsync(self, dsts, srcs, sizes, count, attrs, attrs_idxs, num_attrs, *rest):
        if len(rest) != (2 if self.old_convention else 1):
            raise TypeError("wrong number of arguments")
        assert count == len(sizes) and attrs_idxs == [0] and num_attrs == 1
        self.batches.append(list(zip(dsts, srcs, sizes)))
        self.streams.append(rest[-1])
        if self.log is not None:
            self.log.append(("batch", rest[-1]))
        return (cuda_runtime.cudaError_t(self.batch_code),)

    def cudaMemcpyAsync(self, dst, src, size, kind, stream):
        self.singles.append((dst, src, size))
        self.streams.append(stream)
        return (cuda_runtime.cudaError_t(0),)

    def cudaStreamSynchronize(self, stream):
        self.synced += 1
        return (cuda_runtime.cudaError_t(0),)

    def cudaGetLastError(self):
        return (cuda_runtime.cudaError_t(0),)


@pytest.mark.parametrize("old", [False, True])
def test_one_batch_call_with_one_descriptor_per_block(old):
    """Every (dst, src, bytes) goes into one cudaMemcpyBatchAsync, in either convention."""
    binding = FakeCopyBinding(old_convention=old)
    assert _cuda_copy([100, 200], [1000, 2000], [64, 64], stream=7, binding=binding) == "batched"
    assert binding.batches == [[(100, 1000, 64), (200, 2000, 64)]] and binding.streams == [7]
    assert binding.synced == 0  # asynchronous: the caller orders later work on its stream


def test_not_supported_falls_back_to_per_page_copies():
    """cudaErrorNotSupported (801) from the batch call: one cudaMemcpyAsync per block."""
    binding = FakeCopyBinding(batch_code=801)
    assert _cuda_copy([100, 200], [1000, 2000], [64, 64], stream=7, binding=binding) == "per-page"
    assert binding.singles == [(100, 1000, 64), (200, 2000, 64)] and binding.streams == [7, 7, 7]


def test_other_batch_errors_are_raised_with_their_name():
    """invalid argument (1) - e.g. a source spanning two registrations - is not retried."""
    binding = FakeCopyBinding(batch_code=1)
    with pytest.raises(CudaCallError, match="cudaMemcpyBatchAsync .* cudaErrorInvalidValue"):
        memcpy_batch([100], [1000], [64], stream=7, binding=binding)
    assert binding.singles == []


def test_the_legacy_null_stream_is_refused_before_any_call():
    """A batched copy on the legacy NULL stream is refused before any call reaches the binding."""
    binding = FakeCopyBinding()
    with pytest.raises(ValueError, match="legacy NULL stream"):
        memcpy_batch([100], [1000], [64], stream=0, binding=binding)
    assert binding.batches == []


def test_descriptors_for_cuda_reach_the_batch_call_as_int_lists(monkeypatch):
    """A CUDA-side batch: layers' patterns concatenated, addresses as Python ints, one call."""
    import torch

    from hicache.pools import _transfer

    seen = []
    engine = CopyEngine(host_copy_mode="python")
    monkeypatch.setattr(engine, "issue_cuda_copies", lambda device, *lists: seen.append(lists) or "batched")
    dst, src = torch.zeros(8, 16), torch.ones(8, 16)
    pattern = _transfer.block_pattern(torch.tensor([5, 1, 2]), 64, torch.tensor([0, 3, 4]), 64, 64)
    batch = _transfer.Descriptors(engine)
    batch.add(dst, src, pattern)
    batch.add(dst, src[3:], pattern)  # 5 rows: block 4 (bytes 256-320) is still inside
    batch.cuda = torch.device("cuda", 0)
    batch.prepare().run()
    (dsts, srcs, sizes), = seen
    base_d, base_s = dst.data_ptr(), src.data_ptr()
    assert all(type(v) is int for v in dsts + srcs + sizes)
    # blocks 1 and 2 <- 3 and 4 coalesce into one 128-byte copy; block 5 <- 0 stays alone
    assert list(zip(dsts, srcs, sizes)) == [
        (base_d + 64, base_s + 192, 128), (base_d + 320, base_s, 64),
        (base_d + 64, base_s + 192 + 192, 128), (base_d + 320, base_s + 192, 64),
    ]


def test_a_link_whose_device_side_is_on_cuda_makes_its_batch_a_cuda_one(monkeypatch):
    """A batch queued through a link whose device tensor is on CUDA is issued as CUDA copies,
    never as host memmoves (which would treat device addresses as host memory)."""
    import torch

    from hicache.pools import _transfer

    seen = []
    engine = CopyEngine(host_copy_mode="python")
    monkeypatch.setattr(engine, "issue_cuda_copies", lambda device, *lists: seen.append((device, lists)) or "batched")
    host, other = torch.zeros(8, 16), torch.ones(8, 16)  # host memory stands in for the device side's addresses
    link = SimpleNamespace(dst=host, src=other, dst_extent=host.nbytes, src_extent=other.nbytes,
                           dst_ptr=host.data_ptr(), src_ptr=other.data_ptr(),
                           device=SimpleNamespace(device=torch.device("cuda", 0)))
    pattern = _transfer.block_pattern(torch.tensor([1]), 64, torch.tensor([2]), 64, 64)
    batch = _transfer.Descriptors(engine)
    batch.add_checked(pattern, link, _transfer.Where(0, 0, None))
    batch.prepare().run()
    assert seen == [(torch.device("cuda", 0), ([host.data_ptr() + 64], [other.data_ptr() + 128], [64]))]
    assert not bool(host.any())  # nothing went through a host copy


class FakeStream:
    def __init__(self, handle, log):
        self.cuda_stream, self.log = handle, log

    def wait_stream(self, other):
        self.log.append(("wait", self.cuda_stream, other.cuda_stream))


class FakeTorchCuda:
    """torch.cuda's stream calls, logged."""

    def __init__(self, current_handle):
        self.log, self.created = [], 0
        self.current = FakeStream(current_handle, self.log)

    def device(self, device):
        import contextlib

        self.log.append(("device", device))
        return contextlib.nullcontext()

    def current_stream(self, device):
        return self.current

    def Stream(self, device):  # noqa: N802 - torch.cuda's name
        self.created += 1
        return FakeStream(100 + self.created, self.log)


def test_copies_go_on_the_callers_current_stream(monkeypatch):
    """Device copies are issued on the caller's current CUDA stream (no stream created, the device
    set first)."""
    cuda, binding = FakeTorchCuda(current_handle=42), FakeCopyBinding()
    assert CopyEngine(host_copy_mode="python", cuda=cuda, binding=binding).issue_cuda_copies("dev", [1], [2], [64]) == "batched"
    assert binding.streams == [42] and cuda.created == 0 and cuda.log == [("device", "dev")]


@pytest.mark.parametrize("batch_code", [0, 1])
def test_from_the_null_stream_a_side_stream_is_ordered_both_ways(monkeypatch, batch_code):
    """torch's default stream is the legacy NULL stream: the batch runs on a side stream
    that waits for it and that it then waits for - also when the batch call fails."""
    cuda = FakeTorchCuda(current_handle=0)
    engine = CopyEngine(host_copy_mode="python", cuda=cuda)
    for _ in range(2):
        cuda.log.clear()
        binding = engine._binding = FakeCopyBinding(batch_code=batch_code, log=cuda.log)
        if batch_code:
            with pytest.raises(CudaCallError):
                engine.issue_cuda_copies("dev", [1], [2], [64])
        else:
            engine.issue_cuda_copies("dev", [1], [2], [64])
        assert binding.streams == [101]
        assert cuda.log == [("device", "dev"), ("wait", 101, 0), ("batch", 101), ("wait", 0, 101)]
    assert cuda.created == 1  # made once per device, then reused


def test_a_block_past_the_end_of_either_tensor_is_refused_before_any_copy():
    """Memory safety: a pattern reaching past a (shorter) tensor never becomes a descriptor."""
    import torch

    from hicache.errors import TransferError
    from hicache.pools import _transfer

    engine = CopyEngine(host_copy_mode="python")
    dst, src = torch.zeros(8, 16), torch.ones(8, 16)
    pattern = _transfer.block_pattern(torch.tensor([5, 1, 2]), 64, torch.tensor([0, 3, 4]), 64, 64)
    batch = _transfer.Descriptors(engine)
    with pytest.raises(TransferError, match="layer 3, buffer 0, V: a block reaches byte 320 of the source"):
        batch.add(dst, src[4:], pattern, where="layer 3, buffer 0, V")  # 4 rows: block 4 is past it
    with pytest.raises(TransferError, match="destination tensor, which holds 320 bytes"):
        batch.add(dst[:5], src, pattern)  # block 5 of the destination is past its 5 rows
    batch.add(dst[:6], src[:5], pattern)  # exactly up to the last byte of each: fine
    assert len(batch.parts) == 1
    # a pattern made by hand (no reach measured: the defaults) is measured before it is trusted
    unmeasured = _transfer.BlockPattern(pattern.dst, pattern.src, pattern.sizes)
    with pytest.raises(TransferError, match="reaches byte 320 of the source"):
        batch.add(dst, src[4:], unmeasured)
    assert len(batch.parts) == 1 and batch.total == pattern.total
