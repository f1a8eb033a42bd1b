"""Batched host block copies: the native helper and the memmove fallback copy exactly the bytes asked."""

from __future__ import annotations

import random
import threading

import pytest
from hypothesis import example, given
from hypothesis import strategies as st

from hicache.effects._copy import _host_copy
from hicache.errors import EnvError

pytestmark = pytest.mark.concurrency  # processes, threads, signals or waits: `make test-loaded`

torch = pytest.importorskip("torch")
native = pytest.mark.skipif(_host_copy._native is None, reason="hicache.effects._copy._hostcopy was not built (no C compiler)")


def _scenario(sizes, gaps, seed):
    """Source/destination arenas and descriptors: destinations disjoint, at odd alignments, shuffled."""
    rng = random.Random(seed)
    src = torch.randint(0, 256, (sum(sizes) + 4096,), dtype=torch.uint8, generator=torch.Generator().manual_seed(seed))
    dst = torch.zeros(sum(sizes) + sum(gaps) + 64, dtype=torch.uint8)
    blocks, cursor = [], 0
    for size, gap in zip(sizes, gaps):
        cursor += gap
        blocks.append((cursor, rng.randrange(0, src.numel() - size + 1), size))
        cursor += size
    rng.shuffle(blocks)
    return src, dst, blocks


def _expected(src, dst, blocks):
    """Independent oracle: the same copies done with Python bytes slicing."""
    out = bytearray(bytes(dst.tolist()))
    data = bytes(src.tolist())
    for d, s, n in blocks:
        out[d : d + n] = data[s : s + n]
    return bytes(out)


def _addresses(src, dst, blocks):
    dsts = torch.tensor([dst.data_ptr() + d for d, _, _ in blocks], dtype=torch.int64)
    srcs = torch.tensor([src.data_ptr() + s for _, s, _ in blocks], dtype=torch.int64)
    sizes = torch.tensor([n for _, _, n in blocks], dtype=torch.int64)
    return dsts, srcs, sizes


blocks_strategy = st.integers(1, 24).flatmap(
    lambda n: st.tuples(st.lists(st.integers(0, 5000), min_size=n, max_size=n), st.lists(st.integers(0, 70), min_size=n, max_size=n))
)


@native
@given(blocks_strategy, st.integers(0, 5), st.booleans(), st.integers(0, 2**16))
@example(([300, 5], [3, 0]), 0, True, 1)  # no threads asked for: the caller's thread copies it all
def test_native_copy_matches_the_oracle(size_gaps, threads, streaming, seed):
    """Any sizes, odd alignments, shares split mid-block, streamed or not, any thread count (0 is
    the calling thread alone): exactly the oracle's bytes."""
    sizes, gaps = size_gaps
    src, dst, blocks = _scenario(sizes, gaps, seed)
    expected = _expected(src, dst, blocks)
    dsts, srcs, lengths = _addresses(src, dst, blocks)
    _host_copy._native.copy_blocks(dsts.data_ptr(), srcs.data_ptr(), lengths.data_ptr(), len(blocks), threads, streaming)
    assert bytes(dst.tolist()) == expected


@pytest.mark.parametrize("mode", ["native", "python"])
@given(blocks_strategy, st.integers(0, 2**16))
def test_copy_host_blocks_matches_the_oracle_in_both_modes(mode, size_gaps, seed):
    """copy_host_blocks in native and python modes writes exactly what the byte-wise oracle writes,
    for any block sizes and gaps."""
    if mode == "native" and _host_copy._native is None:
        pytest.skip("hicache.effects._copy._hostcopy was not built")
    sizes, gaps = size_gaps
    src, dst, blocks = _scenario(sizes, gaps, seed)
    expected = _expected(src, dst, blocks)
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv(_host_copy.ENV_VAR, mode)
        patch.setattr(_host_copy, "PARALLEL_BYTES", 0)  # threads and streaming on small inputs too
        patch.setattr(_host_copy, "STREAM_BYTES", 0)
        assert _host_copy.copy_host_blocks(*_addresses(src, dst, blocks), threads=3) == mode
    assert bytes(dst.tolist()) == expected


@native
@pytest.mark.parametrize("call, error, refusal", [
    (lambda c: c.copy_blocks(0, 0, 0, -1, 1, False), ValueError, "count must be >= 0, got -1"),
    (lambda c: c.copy_parts([(0, 0, 0, 0, 0, 0), (0, 0, 0, -1, 0, 0)], 1, False), ValueError, "count must be >= 0"),
    (lambda c: c.copy_parts([(0, 0, 0, 0, 0)], 1, False), TypeError, "6"),
], ids=["blocks-count", "parts-count", "parts-shape"])
def test_the_helper_refuses_a_bad_count_or_part_before_copying(call, error, refusal):
    """The helper's own checks, under the engine's: a negative count or a malformed part is an
    error before any byte moves (every address given is 0: a copy would end the process), the
    parts list it had built given back (`make test-sanitized` holds that)."""
    with pytest.raises(error, match=refusal):
        call(_host_copy._native)


@native
@pytest.mark.parametrize("shift", [-5, 5, 0])
@pytest.mark.parametrize("size", [100, 1000])
@pytest.mark.parametrize("bases", [False, True], ids=["addresses", "offsets and bases"])
@pytest.mark.parametrize("threads", [1, 4])
def test_a_block_overlapping_its_source_is_a_memmove(shift, size, bases, threads):
    """A block overlapping its own source is copied as memmove would (either shift), given as
    addresses or as offsets from a destination and a source base (the layer pattern's form), and
    large enough to stream (a forward streamed copy over its own source would read bytes it
    had already overwritten)."""
    buffer = torch.arange(size + 100, dtype=torch.uint8)
    expected = bytearray(bytes(buffer.tolist()))
    expected[50 + shift : 50 + size + shift] = bytes(buffer.tolist())[50 : 50 + size]
    base = buffer.data_ptr()
    dst, src, extra = (50 + shift, 50, (base, base)) if bases else (base + 50 + shift, base + 50, ())
    dsts, srcs, sizes = (torch.tensor([v], dtype=torch.int64) for v in (dst, src, size))
    _host_copy._native.copy_blocks(dsts.data_ptr(), srcs.data_ptr(), sizes.data_ptr(), 1, threads, True, *extra)
    assert bytes(buffer.tolist()) == bytes(expected)


def test_a_large_copy_uses_threads_and_matches(monkeypatch):
    """Past the thresholds (real sizes): a 12 MiB batch of 64 KiB blocks in reverse order."""
    src = torch.randint(0, 256, (12 * 2**20,), dtype=torch.uint8)
    dst = torch.zeros_like(src)
    unit, count = 2**16, 192
    order = torch.arange(count).flip(0)
    dsts = order * unit + dst.data_ptr()
    srcs = torch.arange(count) * unit + src.data_ptr()
    for mode in ("auto", "python"):
        dst.zero_()
        monkeypatch.setenv(_host_copy.ENV_VAR, mode)
        _host_copy.copy_host_blocks(dsts, srcs, torch.full((count,), unit))
        assert torch.equal(dst.view(count, unit), src.view(count, unit).flip(0))


def test_the_mode_follows_the_environment(monkeypatch):
    """HICACHE_HOST_COPY chooses the copy path; a bad value or native without the built helper is an
    EnvError naming it."""
    monkeypatch.setenv(_host_copy.ENV_VAR, "python")
    assert _host_copy.host_copy_mode() == "python"
    monkeypatch.setenv(_host_copy.ENV_VAR, "turbo")
    with pytest.raises(EnvError, match="HICACHE_HOST_COPY='turbo' must be one of auto, native, python"):
        _host_copy.host_copy_mode()
    monkeypatch.setattr(_host_copy, "_native", None)
    monkeypatch.setenv(_host_copy.ENV_VAR, "native")
    with pytest.raises(EnvError, match="was not built"):
        _host_copy.host_copy_mode()
    monkeypatch.setenv(_host_copy.ENV_VAR, "auto")
    assert _host_copy.host_copy_mode() == "python"


@pytest.mark.parametrize(
    "args, error, pattern",
    [
        (([1.0], [0], [0]), TypeError, "dst_addrs must be a 1-D int64 tensor"),
        (([0, 0], [0], [0, 0]), ValueError, "src_addrs has 1 entries, expected 2"),
        (([0], [0], [-1]), ValueError, "sizes must be >= 0, got -1"),
    ],
)
def test_bad_descriptors_are_refused(args, error, pattern):
    """Descriptors of the wrong dtype, shape, device or length are refused with an error naming
    them, before any copy."""
    dsts, srcs, sizes = (torch.tensor(a) for a in args)
    with pytest.raises(error, match=pattern):
        _host_copy.copy_host_blocks(dsts, srcs, sizes)


def test_ctrl_c_in_the_fallback_waits_for_every_share(monkeypatch):
    """A KeyboardInterrupt while waiting re-raises only after no thread still writes."""
    done, release = [], threading.Event()

    def share(dsts, srcs, sizes):
        if dsts[0] == 0:
            raise KeyboardInterrupt
        release.wait(5)
        done.append(dsts[0])

    waited = []
    from concurrent.futures import wait as real_wait

    def wait(futures):
        release.set()
        waited.append(len(futures))
        return real_wait(futures)

    monkeypatch.setattr(_host_copy, "_memmove_all", share)
    monkeypatch.setattr("hicache.effects._interrupts.wait", wait)  # run_each's wait: the shares' end
    with pytest.raises(KeyboardInterrupt):
        _host_copy._memmove_threads([0, 1, 2], [0, 0, 0], [1, 1, 1], 3)
    assert waited == [3] and sorted(done) == [1, 2]


@pytest.mark.parametrize("mode", ["native", "python"])
@given(blocks_strategy, st.integers(1, 4), st.integers(1, 5), st.booleans(), st.integers(0, 2**16))
def test_copy_parts_matches_the_oracle(mode, size_gaps, nparts, threads, streaming, seed):
    """A transfer's parts - offsets at their own bases, one call, shares split across parts and
    mid-block - copy exactly the oracle's bytes (native and memmove paths)."""
    if mode == "native" and _host_copy._native is None:
        pytest.skip("hicache.effects._copy._hostcopy was not built")
    sizes, gaps = size_gaps
    src, dst, blocks = _scenario(sizes, gaps, seed)
    expected = _expected(src, dst, blocks)
    rng = random.Random(seed)
    parts, cuts = [], sorted(rng.sample(range(1, len(blocks)), min(nparts - 1, len(blocks) - 1))) if len(blocks) > 1 else []
    for start, end in zip([0, *cuts], [*cuts, len(blocks)]):
        chunk = blocks[start:end]
        dst_base = dst.data_ptr() + min(d for d, _, _ in chunk)  # offsets relative to per-part bases
        src_base = src.data_ptr() + min(s for _, s, _ in chunk)
        offsets_d = torch.tensor([dst.data_ptr() + d - dst_base for d, _, _ in chunk], dtype=torch.int64)
        offsets_s = torch.tensor([src.data_ptr() + s - src_base for _, s, _ in chunk], dtype=torch.int64)
        lengths = torch.tensor([n for _, _, n in chunk], dtype=torch.int64)
        parts.append((offsets_d, offsets_s, lengths, int(lengths.sum()), dst_base, src_base))
    total = sum(p[3] for p in parts)
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(_host_copy, "PARALLEL_BYTES", 0 if threads > 1 else 2**62)
        patch.setattr(_host_copy, "STREAM_BYTES", 0 if streaming else 2**62)
        _host_copy.copy_parts(parts, total, mode=mode, threads=threads)
    assert bytes(dst.tolist()) == expected


@native
def test_nothing_to_copy_is_no_error():
    """A copy of no blocks, and a part of no blocks among others (a layer with nothing to move),
    is a call that copies what there is, not a refusal."""
    src, dst = torch.arange(64, dtype=torch.uint8), torch.zeros(64, dtype=torch.uint8)
    none = torch.zeros(1, dtype=torch.int64)
    _host_copy._native.copy_blocks(none.data_ptr(), none.data_ptr(), none.data_ptr(), 0, 2, False)
    assert not dst.any()
    table = [torch.tensor([v], dtype=torch.int64) for v in (dst.data_ptr(), src.data_ptr(), 64)]
    empty = (none.data_ptr(), none.data_ptr(), none.data_ptr(), 0, 0, 0)
    _host_copy._native.copy_parts([empty, (*(t.data_ptr() for t in table), 1, 0, 0), empty], 2, False)
    assert dst.equal(src)
