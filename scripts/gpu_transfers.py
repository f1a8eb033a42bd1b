#!/usr/bin/env python3
"""The transfer table on a real GPU (issue #52): hicache's MHA host pool in each layout, SGLang's
per-layer load and all-layer backup with each engine (the copy engine's batch, the GPU's
gather), GB/s each way against one contiguous pinned copy of the same bytes (the link),
bit-exact round trips. Prints one JSON object; `scripts/gpu_check.py` includes it.

Llama-3.1-8B-like pages (32 layers x 8 KV heads x 128 x bf16, 64 tokens: a 2 KiB row per token
and layer, page_first's piece), 256 random pages of a 512-page pool, median of 3 rounds.
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
    torch.cuda.synchronize()
    start = time.perf_counter()
    run()
    torch.cuda.synchronize()
    return time.perf_counter() - start


def link(torch, nbytes: int) -> dict:
    """One contiguous copy each way between pinned host memory and the GPU: the link's GB/s."""
    host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    device = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    load = [_timed(torch, lambda: device.copy_(host, non_blocking=True)) for _ in range(ROUNDS)]
    back = [_timed(torch, lambda: host.copy_(device, non_blocking=True)) for _ in range(ROUNDS)]
    return {"load_gbps": round(nbytes / statistics.median(load) / 1e9, 1),
            "backup_gbps": round(nbytes / statistics.median(back) / 1e9, 1)}


def one(torch, layout: str, engine: str, programs: int | None = None) -> dict:
    from hicache.effects import CopyEngine
    from hicache.pools import MHATokenToKVPoolHost
    from hicache.testing import MHADevicePool

    device = MHADevicePool(size=PAGES * PAGE, layer_num=LAYERS, head_num=HEADS, head_dim=DIM, page_size=PAGE)
    device.k_buffer = [torch.randn(t.shape, device="cuda").to(t.dtype) for t in device.k_buffer]
    device.v_buffer = [torch.randn(t.shape, device="cuda").to(t.dtype) for t in device.v_buffer]
    device.device = "cuda"
    pool = MHATokenToKVPoolHost(device, 1.0, 0, PAGE, layout, True, "cpu",
                                copy_engine=CopyEngine(transfer=engine, programs=programs))
    try:
        pages = torch.randperm(PAGES - 1, generator=torch.Generator().manual_seed(3))[:MOVED] + 1
        didx = (pages[:, None] * PAGE + torch.arange(PAGE)).reshape(-1).cuda()
        hidx = pool.alloc(didx.numel())
        original = [t[didx].clone() for t in device.tensors()]
        nbytes = didx.numel() * HEADS * DIM * 2 * 2 * LAYERS  # K and V, every layer
        backup = [_timed(torch, lambda: pool.backup_from_device_all_layer(device, hidx, didx, "kernel"))
                  for _ in range(ROUNDS)]
        chosen = {"backup": pool.copy_engine.last_choice.engine}
        for t in device.tensors():
            t[didx] = 0

        def load():
            for layer in range(LAYERS):
                pool.load_to_device_per_layer(device, hidx, didx, layer, "kernel")

        loads = [_timed(torch, load) for _ in range(ROUNDS)]
        chosen["load"] = pool.copy_engine.last_choice.engine
        exact = all(torch.equal(a, t[didx]) for a, t in zip(original, device.tensors()))
        return {"layout": layout, "asked": engine, "engines": chosen, "bit_exact": exact,
                "load_gbps": round(nbytes / statistics.median(loads) / 1e9, 1),
                "backup_gbps": round(nbytes / statistics.median(backup) / 1e9, 1)}
    finally:
        pool.destroy()


def transfer_table() -> dict:
    import torch

    rows = [one(torch, layout, engine) for layout in LAYOUTS for engine in ENGINES]
    rows += [dict(one(torch, "page_first", "gather", programs), programs=programs) for programs in (16, 32, 128)]
    base = link(torch, MOVED * PAGE * HEADS * DIM * 2 * 2 * LAYERS)
    for row in rows:
        row["load_vs_link"] = round(row["load_gbps"] / base["load_gbps"], 2)
        row["backup_vs_link"] = round(row["backup_gbps"] / base["backup_gbps"], 2)
    return {"link": base, "rows": rows, "ok": all(row["bit_exact"] for row in rows)}


if __name__ == "__main__":
    table = transfer_table()
    print(json.dumps(table))
    raise SystemExit(0 if table["ok"] else 1)
