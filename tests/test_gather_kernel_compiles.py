"""The gather engine's Triton kernel compiles for the GPUs it serves (issue #52): the suite runs
it through Triton's interpreter, which accepts Python that Triton's compiler refuses (a
``break``, a data-dependent ``if``, a pointer cast it cannot lower), so here Triton's own
compiler and the ptxas its wheel ships turn it into a cubin for each GPU generation - no GPU
needed - with the argument types `GatherCopy` launches it with, in every word size."""

from __future__ import annotations

import re

import pytest

from hicache.effects._copy._gather import ROWS, GatherCopy, _kernel, triton_ready

torch = pytest.importorskip("torch")

#: compute capability -> a GPU that has it (the H200 of ../shared/reference/h200-measured.md is 90)
ARCHS = {80: "A100", 90: "H100/H200", 100: "B200"}

#: torch dtype -> Triton's name for it in a kernel signature
_TRITON_TYPES = {torch.int64: "i64", torch.int32: "i32", torch.int16: "i16", torch.uint8: "u8"}


def _batch(word: int) -> GatherCopy:
    """A prepared CPU batch whose pieces allow exactly ``word``-byte words."""
    src = torch.zeros(256, dtype=torch.uint8)
    dst = torch.zeros(256, dtype=torch.uint8)
    base = 64 - src.data_ptr() % 64  # 64-byte aligned both sides, so the piece's size sets the word
    dst_base = 64 - dst.data_ptr() % 64
    parts = [(torch.tensor([0, 64], dtype=torch.int64), torch.tensor([0, 64], dtype=torch.int64),
              torch.tensor([word, 2 * word], dtype=torch.int64), 3 * word,
              dst.data_ptr() + dst_base, src.data_ptr() + base)]
    batch = GatherCopy(parts, None, programs=4, runner="triton")
    assert batch.word == word
    return batch


def _signature(batch: GatherCopy) -> dict[str, str]:
    """The types Triton's launcher gives the arguments `GatherCopy.run` passes (an int that fits
    32 bits is i32, as the JIT specializes it)."""
    dsts, srcs, sizes = batch.tables
    kind = {name: f"*{_TRITON_TYPES[t.dtype]}" for name, t in (("dsts", dsts), ("srcs", srcs), ("sizes", sizes))}
    return {**kind, "count": "i32", "chunks": "i32", "like": f"*{_TRITON_TYPES[batch.like.dtype]}",
            "ROWS": "constexpr", "CHUNK": "constexpr"}


def _source(ast_source, kernel, batch: GatherCopy):
    """The kernel's source for Triton's compiler in the form the installed Triton takes: 3.3 and
    later name the constexprs in the signature and pass their values as ``constexprs``; 3.2 (the
    test extra's floor, torch 2.6's Triton) leaves them out of it and passes ``constants``."""
    import inspect

    signature, values = _signature(batch), {"ROWS": ROWS, "CHUNK": batch.chunk}
    if "constexprs" in inspect.signature(ast_source).parameters:
        return ast_source(fn=kernel, signature=signature, constexprs=values)
    return ast_source(fn=kernel, signature={k: v for k, v in signature.items() if v != "constexpr"}, constants=values)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("arch", sorted(ARCHS), ids=lambda a: f"sm_{a}-{ARCHS[a]}")
def test_the_gather_kernel_compiles_for_each_gpu_in_every_word_size(arch, tmp_path, monkeypatch):
    """Triton's compiler (not its interpreter) builds the kernel GatherCopy launches into a cubin
    for this GPU generation in each word size, keeping the pieces in registers (no local memory)
    and moving them with global loads and stores of that word's width."""
    if not triton_ready():
        pytest.fail("triton is in the test extra (pyproject.toml): reinstall with make test")
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path))  # compiled here, not found in a cache
    monkeypatch.setenv("TRITON_DEFAULT_FP_FUSION", "1")  # Triton 3.9 warns when it is unset; no float math here
    kernel = _kernel(False)  # the very JITFunction a GPU launches, its specialization settings included
    for word in (8, 4, 2, 1):
        batch = _batch(word)
        source = _source(ASTSource, kernel, batch)
        try:
            compiled = triton.compile(source, target=GPUTarget("cuda", arch, 32))
        except RuntimeError as error:
            if f"'sm_{arch}' is not defined" not in str(error):
                raise
            # a Triton older than the GPU (3.2's ptxas predates sm_100; so does the torch that pins it)
            pytest.skip(f"Triton {triton.__version__}'s ptxas cannot target sm_{arch} ({ARCHS[arch]})")
        assert compiled.asm["cubin"], f"no cubin for sm_{arch}, {word}-byte words"
        ptx = compiled.asm["ptx"]
        assert f".target sm_{arch}" in ptx
        assert not re.search(r"\b(ld|st)\.local\b", ptx), f"sm_{arch}, {word}-byte words: pieces go through local memory"
        bits = 8 * word
        assert re.search(rf"\bld\.global(\.\w+)*\.[bu]{bits}\b", ptx), f"sm_{arch}: no {bits}-bit global load"
        assert re.search(rf"\bst\.global(\.\w+)*\.[bu]{bits}\b", ptx), f"sm_{arch}: no {bits}-bit global store"
