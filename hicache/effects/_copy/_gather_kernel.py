"""The gather engine's Triton kernel (imported only where Triton is: hicache.effects._copy._gather
decides, and wraps it compiled for a GPU or interpreted for CPU tensors)."""

import triton.language as tl


def copy_pieces(dsts, srcs, sizes, count, chunks, like, ROWS: tl.constexpr, CHUNK: tl.constexpr):  # noqa: N803
    """Piece i: ``sizes[i]`` words from address ``srcs[i]`` to ``dsts[i]`` (absolute, word-aligned);
    ``chunks``: steps of CHUNK words covering the longest piece; ``like``: a tensor of the word type."""
    program = tl.program_id(0)
    programs = tl.num_programs(0)
    for start in range(program * ROWS, count, programs * ROWS):
        rows = start + tl.arange(0, ROWS)
        live = rows < count
        dst = tl.load(dsts + rows, mask=live, other=0).to(like.dtype)
        src = tl.load(srcs + rows, mask=live, other=0).to(like.dtype)
        size = tl.load(sizes + rows, mask=live, other=0)
        for step in range(0, chunks):
            words = step * CHUNK + tl.arange(0, CHUNK)
            inside = words[None, :] < size[:, None]
            values = tl.load(src[:, None] + words[None, :], mask=inside)
            tl.store(dst[:, None] + words[None, :], values, mask=inside)
