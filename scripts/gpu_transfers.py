#!/usr/bin/env python3
"""The transfer table on a real GPU (issue #52): hicache's MHA host pool in each layout, SGLang's
per-layer load and all-layer backup with each engine (the copy engine's batch, the GPU's
gather), GB/s each way against one contiguous pinned copy of the same bytes (the link),
bit-exact round trips. Prints one JSON object; `scripts/gpu_check.py` includes it.

Llama-3.1-8B-like pages (32 layers x 8 KV heads x 128 x bf16, 64 tokens: a 2 KiB row per token
and layer, page_first's piece), 256 random pages of a 512-page pool, median of 3 rounds. Then
every other family x layout (`family_rows`: K-only, asymmetric MHA, MLA, the DSA indexer,
Mamba, DeepSeek-V4's paged and state pools, at model-like row sizes) with each engine: a
bit-exact round trip and GB/s each way. First, with Triton's cache cold, what the gather's
compile costs and that a pool's build has paid it before its first transfer (`first_transfer`);
page_first's gather also at 16/32/128 programs and at the other kernel tiles in `TILES`.
"""

from __future__ import annotations

import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

LAYERS, HEADS, DIM, PAGE, PAGES, MOVED, ROUNDS = 32, 8, 128, 64, 512, 256, 3
LAYOUTS = ("page_first", "layer_first", "page_first_direct")
ENGINES = ("dma", "gather")


def _timed(torch, run) -> float:
    sync = torch.cuda.synchronize if torch.cuda.is_available() else (lambda: None)  # CPU: a dry run
    sync()
    start = time.perf_counter()
    run()
    sync()
    return time.perf_counter() - start


def link(torch, nbytes: int) -> dict:
    """One contiguous copy each way between pinned host memory and the GPU: the link's GB/s."""
    host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    device = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    load = [_timed(torch, lambda: device.copy_(host, non_blocking=True)) for _ in range(ROUNDS)]
    back = [_timed(torch, lambda: host.copy_(device, non_blocking=True)) for _ in range(ROUNDS)]
    return {"load_gbps": round(nbytes / statistics.median(load) / 1e9, 1),
            "backup_gbps": round(nbytes / statistics.median(back) / 1e9, 1)}


def _family_devices():
    """Device pools with model-like rows: family -> (host pool class, device pool maker, pages moved)."""
    from hicache.pools import (AsymmetricMHATokenToKVPoolHost, DeepSeekV4PagedHostPool, DeepSeekV4StateHostPool,
                               DSAIndexerPoolHost, MambaPoolHost, MHATokenToKOnlyPoolHost, MHATokenToKVPoolHost,
                               MLATokenToKVPoolHost)
    from hicache.testing import (AsymmetricMHADevicePool, DeepSeekV4DevicePool, DSAIndexerDevicePool,
                                 MambaDevicePool, MHADevicePool, MLADevicePool)

    size = 128 * PAGE
    return {
        "mha": (MHATokenToKVPoolHost, lambda: MHADevicePool(  # the table's own rows: a 512-page pool, 256 moved
            size=PAGES * PAGE, layer_num=LAYERS, head_num=HEADS, head_dim=DIM, page_size=PAGE), MOVED),
        "mha_k_only": (MHATokenToKOnlyPoolHost, lambda: MHADevicePool(
            size=size, layer_num=LAYERS, head_num=HEADS, head_dim=DIM, page_size=PAGE, k_only=True), 64),
        "asymmetric": (AsymmetricMHATokenToKVPoolHost, lambda: AsymmetricMHADevicePool(
            size=size, layer_num=LAYERS, head_num=HEADS, k_head_dim=192, v_head_dim=128, page_size=PAGE), 64),
        "mla": (MLATokenToKVPoolHost, lambda: MLADevicePool(  # DeepSeek-V3: 512 + 64, 61 layers
            size=size, layer_num=61, kv_lora_rank=512, qk_rope_head_dim=64, page_size=PAGE), 64),
        "dsa": (DSAIndexerPoolHost, lambda: DSAIndexerDevicePool(
            size=size, layer_num=61, index_head_dim=128, quant_block_size=128, page_size=PAGE), 64),
        "mamba": (MambaPoolHost, lambda: MambaDevicePool(  # 16 heads x 128 x 128 fp32 state, one conv
            size=64, layer_num=24, temporal_shape=(16, 128, 128), conv_shapes=((3, 8192),), page_size=1), 16),
        "v4_paged": (DeepSeekV4PagedHostPool, lambda: DeepSeekV4DevicePool(
            size=size, layer_num=61, item_bytes=64 * 584, page_size=PAGE), 64),
        "v4_state": (DeepSeekV4StateHostPool, lambda: DeepSeekV4DevicePool(
            size=size, layer_num=61, state_page_bytes=32768, page_size=PAGE), 64),
    }


def _device_pool(torch, family: str, target: str):
    """``family``'s host pool class, its device pool made on ``target`` and the pages a row moves."""
    cls, make_device, moved = _family_devices()[family]
    torch.set_default_device(target)  # the stand-ins allocate with torch's default device
    try:
        device = make_device()
    finally:
        torch.set_default_device(None)
    device.device = target
    return cls, device, moved


def family_row(torch, family: str, layout: str, engine: str, target: str = "cuda", programs: int | None = None) -> dict:
    """One family x layout x engine: backup then per-layer load of random pages, timed (median of
    ROUNDS), bit-exact against the rows before (compared as bytes: a NaN pattern is still equal)."""
    from hicache.effects import CopyEngine, HostSetup
    from hicache.pools import MambaPoolHost

    cls, device, moved = _device_pool(torch, family, target)
    for t in device.tensors():
        t.view(torch.uint8).random_(0, 256) if t.dtype != torch.uint8 else t.random_(0, 256)
    engine_kw = {"host": HostSetup(copy_engine=CopyEngine(transfer=engine, programs=programs))}
    if cls is MambaPoolHost:
        pool = cls(device, 1.0, 0, True, "cpu", layout=layout, **engine_kw)
    else:
        pool = cls(device, 1.0, 0, PAGE, layout, True, "cpu", **engine_kw)
    try:
        page = pool.page_size
        pages = torch.randperm(device.slots // page - 1, generator=torch.Generator().manual_seed(3))[:moved] + 1
        didx = (pages[:, None] * page + torch.arange(page)).reshape(-1).to(target)
        hidx = pool.alloc(didx.numel()) if pool.has_allocator else torch.arange(didx.numel())  # V4 state: shadows
        axis = 1 if cls is MambaPoolHost else 0
        rows = (pages if any(s.rows for s in pool.streams()) else didx.cpu()).to(target)
        original = [t.index_select(axis, rows) for t in device.tensors()]
        nbytes = sum(o.numel() * o.element_size() for o in original)
        backup = [_timed(torch, lambda: pool.backup_from_device_all_layer(device, hidx, didx, "kernel"))
                  for _ in range(ROUNDS)]
        chosen = {"backup": pool.copy_engine.last_choice.engine}
        device.zero()

        def load():
            for layer in range(pool.start_layer, pool.end_layer):
                pool.load_to_device_per_layer(device, hidx, didx, layer, "kernel")

        loads = [_timed(torch, load) for _ in range(ROUNDS)]
        chosen["load"] = pool.copy_engine.last_choice.engine
        exact = all(torch.equal(a.view(torch.uint8), t.index_select(axis, rows).view(torch.uint8))
                    for a, t in zip(original, device.tensors()))
        return {"family": family, "layout": layout, "asked": engine, "engines": chosen, "bit_exact": exact,
                "moved_bytes": nbytes, "load_gbps": round(nbytes / statistics.median(loads) / 1e9, 1),
                "backup_gbps": round(nbytes / statistics.median(backup) / 1e9, 1)}
    finally:
        pool.destroy()


#: (pieces in flight per program, bytes per step) beside the default (16, 1024): the gather's two
#: tile constants, measured on page_first's 2 KiB rows so one GPU run says which way the link is
TILES = ((8, 1024), (32, 1024), (16, 512), (16, 2048))


def tile_row(torch, rows_per_program: int, chunk_bytes: int, target: str = "cuda") -> dict:
    """MHA page_first through the gather with the kernel's tile constants set to these (a new
    compile each: Triton specializes on them), restored after."""
    from hicache.effects._copy import _gather

    saved = _gather.ROWS, _gather.CHUNK_BYTES
    _gather.ROWS, _gather.CHUNK_BYTES = rows_per_program, chunk_bytes
    try:
        row = family_row(torch, "mha", "page_first", "gather", target=target)
    finally:
        _gather.ROWS, _gather.CHUNK_BYTES = saved
    return dict(row, rows_per_program=rows_per_program, chunk_bytes=chunk_bytes)


def family_rows(torch, emit=None) -> list:
    """Every family but MHA (the table's own rows) x each layout it serves x each engine; a row
    that raises is reported with its error (and counts as not bit-exact). ``emit(row)``: each row
    as it ends."""
    rows = []
    for family, (cls, _, _) in _family_devices().items():
        if family == "mha":
            continue
        for layout in cls.descriptor_class().supported():
            for engine in ENGINES:
                try:
                    rows.append(family_row(torch, family, layout, engine))
                except Exception as error:  # noqa: BLE001 - reported in the table
                    rows.append({"family": family, "layout": layout, "asked": engine, "bit_exact": False,
                                 "error": f"{type(error).__name__}: {error}"[:300]})
                if emit is not None:
                    emit(rows[-1])
                torch.cuda.empty_cache()
    return rows


def first_transfer(torch, target: str = "cuda") -> dict:
    """The gather's compile moved to the build: an MHA page_first pool built for the gather with
    Triton's cache cold (a fresh TRITON_CACHE_DIR, set before this process's first compile):
    seconds for the constructor, for its warm-up thread to end after it (the compile a first
    transfer used to pay), for the first backup after that and for the next ones (median)."""
    import os
    import tempfile

    from hicache.effects import CopyEngine, HostSetup
    from hicache.effects._copy._gather import WARMTH

    os.environ["TRITON_CACHE_DIR"] = tempfile.mkdtemp(prefix="hicache-triton-")
    cls, device, moved = _device_pool(torch, "mha", target)
    start = time.perf_counter()
    pool = cls(device, 1.0, 0, PAGE, "page_first", target == "cuda", "cpu",
               host=HostSetup(copy_engine=CopyEngine(transfer="gather")))
    built = time.perf_counter()
    try:
        WARMTH.settle(300)
        warmed = time.perf_counter()
        didx = (torch.arange(moved // 8)[:, None] * PAGE + PAGE + torch.arange(PAGE)).reshape(-1).to(target)
        hidx = pool.alloc(didx.numel())
        backups = [_timed(torch, lambda: pool.backup_from_device_all_layer(device, hidx, didx, "kernel"))
                   for _ in range(ROUNDS + 1)]
        return {"constructor_s": round(built - start, 3), "warm_after_constructor_s": round(warmed - built, 3),
                "first_backup_s": round(backups[0], 4), "next_backups_median_s": round(statistics.median(backups[1:]), 4),
                "engine": pool.copy_engine.last_choice.engine}
    finally:
        pool.destroy()


def transfer_table(emit=None) -> dict:
    """The whole table; ``emit(row)`` gets each row as it ends (a run cut short by its time limit
    still shows what it measured), the link's figures last (the ratios need them)."""
    import torch

    emit = emit if emit is not None else (lambda row: None)
    first = first_transfer(torch)  # before any other gather: its compile is this process's first
    emit({"first_transfer": first})
    rows = []
    for layout in LAYOUTS:
        for engine in ENGINES:
            rows.append(family_row(torch, "mha", layout, engine))
            emit(rows[-1])
    for programs in (16, 32, 128):
        rows.append(dict(family_row(torch, "mha", "page_first", "gather", programs=programs), programs=programs))
        emit(rows[-1])
    for rows_per_program, chunk_bytes in TILES:
        rows.append(tile_row(torch, rows_per_program, chunk_bytes))
        emit(rows[-1])
    base = link(torch, MOVED * PAGE * HEADS * DIM * 2 * 2 * LAYERS)
    emit({"link": base})
    families = family_rows(torch, emit)
    for row in rows + families:
        if "load_gbps" in row:
            row["load_vs_link"] = round(row["load_gbps"] / base["load_gbps"], 2)
            row["backup_vs_link"] = round(row["backup_gbps"] / base["backup_gbps"], 2)
    return {"link": base, "first_transfer": first, "rows": rows, "families": families,
            "ok": all(row["bit_exact"] for row in rows + families)}


if __name__ == "__main__":
    import torch

    if not torch.cuda.is_available():
        print(json.dumps({"ok": False, "reason": "CUDA unavailable to torch (a CPU build, or no GPU)"}))
        raise SystemExit(2)
    table = transfer_table(emit=lambda row: print(json.dumps(row, sort_keys=True, default=str), file=sys.stderr,
                                                  flush=True))
    print(json.dumps(table))
    raise SystemExit(0 if table["ok"] else 1)
