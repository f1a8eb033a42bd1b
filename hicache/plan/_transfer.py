"""Which engine moves a batch of copies between a host pool and a GPU: the one table, each row
with the H200 measurement that put it there (issue #52; ../shared/reference/h200-measured.md).

- ``dma``: the copy engines, one cudaMemcpyBatchAsync of the batch's pieces (no SMs taken);
- ``gather``: the GPU itself reads (load) or writes (backup) registered host memory over PCIe,
  many pieces in flight per program (hicache.effects' Triton kernel, torch's index kernels
  where Triton is absent);
- ``host``: both sides in host memory (a CPU device pool): the batched host copy.

Pure: the direction, the batch's mean piece size and the setting come in; an `EngineChoice`
naming its rule goes out.
"""

from __future__ import annotations

from typing import NamedTuple

MiB = 2**20
ENGINES = ("dma", "gather")
#: HICACHE_TRANSFER's words (the settings table reads them from here)
TRANSFER_MODES = ("auto",) + ENGINES
DIRECTIONS = ("load", "backup")
#: programs a gather launches by default: on the H200 16, 32, 64 and 128 programs of 16 rows in
#: flight each moved page_first at the same 50.3-50.7 GB/s (load) and 51.7-52.0 (backup); 32 of
#: its 132 SMs keeps a margin for other row sizes and leaves the rest to the model
DEFAULT_PROGRAMS = 32
#: the most programs a gather may be given (HICACHE_TRANSFER_PROGRAMS, `CopyEngine(programs=)`):
#: more than a GPU runs at once buys nothing - the H200 has 132 SMs
MAX_PROGRAMS = 4096
#: what runs a gather: Triton where it is (auto), Triton, or torch's index kernels
GATHER_RUNNERS = ("auto", "triton", "torch")
#: load pieces from here up go to the copy engine (measured at 2 KiB and at 128 KiB; the split
#: lies between, where neither was measured)
DMA_LOAD_PIECE = 64 * 2**10


class EngineRule(NamedTuple):
    """Pieces of ``direction`` with a mean size in [``min_piece``, ``max_piece``) go to ``engine``."""

    direction: str
    min_piece: int
    max_piece: int | None
    engine: str
    reason: str


ENGINE_TABLE = (  # H200, driver 580, 55.3 / 55.1 GB/s link (one contiguous pinned copy each way)
    EngineRule("load", 0, DMA_LOAD_PIECE, "gather",
               "small pieces: the copy engine moved page_first's 2 KiB rows at 0.9 GB/s (256 random pages, "
               "32 layers); the GPU gathering them from registered host memory 50.3 GB/s (0.91x of the link)"),
    EngineRule("load", DMA_LOAD_PIECE, None, "dma",
               "pieces of 64 KiB and more: the copy engine loaded layer_first's and page_first_direct's 128 KiB "
               "pieces at 53.6-53.8 GB/s (0.97x) without taking SMs; the gather 44.6-50.5 GB/s"),
    EngineRule("backup", 0, None, "gather",
               "device to host the copy engine moved 128 KiB pieces at 37.6-37.7 GB/s (0.68x) and 2 KiB rows at "
               "1.3 GB/s; the GPU scattering into registered host memory 50.9-51.7 GB/s (0.92-0.94x)"),
)


class EngineChoice(NamedTuple):
    engine: str  # "dma", "gather" or "host"
    reason: str


def choose_engine(direction: str, mean_piece: int, *, on_gpu: bool, setting: str = "auto",
                  gather_ready: bool = True) -> EngineChoice:
    """The engine for a batch moving pieces of ``mean_piece`` bytes in ``direction``.

    ``on_gpu``: one side is a CUDA device (else both are host memory); ``setting``:
    HICACHE_TRANSFER (``auto``, ``dma``, ``gather``); ``gather_ready``: the gather can run here
    (Triton or a CUDA torch). ``gather`` asked for on host memory runs the same kernel through
    Triton's interpreter (slow; for tests and checks)."""
    if direction not in DIRECTIONS:
        raise ValueError(f"direction must be one of {DIRECTIONS}, got {direction!r}")
    if setting not in TRANSFER_MODES:
        raise ValueError(f"HICACHE_TRANSFER must be one of {TRANSFER_MODES}, got {setting!r}")
    if setting == "gather":
        return EngineChoice("gather", "HICACHE_TRANSFER=gather")
    if not on_gpu:
        return EngineChoice("host", "both sides are host memory: the batched host copy")
    if setting == "dma":
        return EngineChoice("dma", "HICACHE_TRANSFER=dma")
    for rule in ENGINE_TABLE:
        if rule.direction == direction and rule.min_piece <= mean_piece and (
                rule.max_piece is None or mean_piece < rule.max_piece):
            if rule.engine == "gather" and not gather_ready:
                return EngineChoice("dma", "neither Triton nor a CUDA torch is here to gather; " + rule.reason)
            return EngineChoice(rule.engine, rule.reason)
    raise AssertionError(f"ENGINE_TABLE covers every piece size; not {direction} {mean_piece}")
