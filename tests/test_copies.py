"""The CUDA copy path, with a fake binding: both cuda-bindings call conventions, the per-page
fallback on cudaErrorNotSupported, and errors named."""

from __future__ import annotations

import pytest

from hicache.effects._copies import memcpy_batch
from hicache.errors import CudaCallError
from hicache.pools._transfer import _cuda_copy

cuda_runtime = pytest.importorskip("cuda.bindings.runtime")


class FakeCopyBinding:
    """cudaMemcpyBatchAsync in the 13.x (8 args) or 12.x (9 args, failIdx) convention."""

    cudaMemcpyAttributes = cuda_runtime.cudaMemcpyAttributes
    cudaMemcpySrcAccessOrder = cuda_runtime.cudaMemcpySrcAccessOrder
    cudaMemcpyKind = cuda_runtime.cudaMemcpyKind

    def __init__(self, *, old_convention=False, batch_code=0):
        self.old_convention, self.batch_code = old_convention, batch_code
        self.batches, self.singles, self.synced = [], [], 0

    def cudaMemcpyBatchAsync(self, dsts, srcs, sizes, count, attrs, attrs_idxs, num_attrs, *rest):
        if len(rest) != (2 if self.old_convention else 1):
            raise TypeError("wrong number of arguments")
        assert count == len(sizes) and attrs_idxs == [0] and num_attrs == 1
        self.batches.append(list(zip(dsts, srcs, sizes)))
        return (cuda_runtime.cudaError_t(self.batch_code),)

    def cudaMemcpyAsync(self, dst, src, size, kind, stream):
        self.singles.append((dst, src, size))
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
    assert _cuda_copy([100, 200], [1000, 2000], [64, 64], binding=binding) == "batched"
    assert binding.batches == [[(100, 1000, 64), (200, 2000, 64)]] and binding.synced == 1


def test_not_supported_falls_back_to_per_page_copies():
    """cudaErrorNotSupported (801) from the batch call: one cudaMemcpyAsync per block."""
    binding = FakeCopyBinding(batch_code=801)
    assert _cuda_copy([100, 200], [1000, 2000], [64, 64], binding=binding) == "per-page"
    assert binding.singles == [(100, 1000, 64), (200, 2000, 64)]


def test_other_batch_errors_are_raised_with_their_name():
    """invalid argument (1) - e.g. a source spanning two registrations - is not retried."""
    binding = FakeCopyBinding(batch_code=1)
    with pytest.raises(CudaCallError, match="cudaMemcpyBatchAsync .* cudaErrorInvalidValue"):
        memcpy_batch([100], [1000], [64], binding=binding)
    assert binding.singles == []


def test_descriptors_for_cuda_reach_the_batch_call_as_int_lists(monkeypatch):
    """A CUDA-side batch: layers' patterns concatenated, addresses as Python ints, one call."""
    import torch

    from hicache.pools import _transfer

    seen = []
    monkeypatch.setattr(_transfer, "_cuda_copy", lambda *lists: seen.append(lists) or "batched")
    dst, src = torch.zeros(8, 16), torch.ones(8, 16)
    pattern = _transfer.block_pattern(torch.tensor([5, 1, 2]), 64, torch.tensor([0, 3, 4]), 64, 64)
    batch = _transfer.Descriptors()
    batch.add(dst, src, pattern)
    batch.add(dst, src[4:], pattern)
    batch.cuda = True
    batch.run()
    (dsts, srcs, sizes), = seen
    base_d, base_s = dst.data_ptr(), src.data_ptr()
    assert all(type(v) is int for v in dsts + srcs + sizes)
    # blocks 1 and 2 <- 3 and 4 coalesce into one 128-byte copy; block 5 <- 0 stays alone
    assert list(zip(dsts, srcs, sizes)) == [
        (base_d + 64, base_s + 192, 128), (base_d + 320, base_s, 64),
        (base_d + 64, base_s + 256 + 192, 128), (base_d + 320, base_s + 256, 64),
    ]
    assert batch.parts == [] and batch.keep == []
