"""SGLang 0.5.23's own host pool construction, with hicache's plug-in loaded and without (#24).

Both are SGLang's real `MHATokenToKVPoolHost(..., pin_memory=True)` (page_first_direct, 32
layers x 8 heads x 128 dims, bf16) on CPU, its budget given by its own
`host_memory_budget_scope`, timed from the constructor's call to its return (the pool is
usable then), its `destroy()` untimed. With the plug-in its three seam functions are
hicache's (loaded by SGLang's own `load_plugins()`); without, they are SGLang's own, whose
`torch.cuda.cudart()` is a `hicache.testing.FakeCudart` here. Two drivers: one that registers
instantly and one at 10 GB/s (HICACHE_BENCH_DRIVERS: 1, the instant one, by default; 2 both). Sizes:
HICACHE_BENCH_SGLANG_GIB (default "2,4"; "2,4,8" as the README's figures were taken takes this script
alone 4.5 minutes here, and `make bench` must fit in 10); medians of HICACHE_BENCH_ROUNDS (4)
interleaved rounds - a whole balanced cycle of its four arms (`_timing.round_order`): with three
arms and 3 rounds the plug-in's defaults always ran right after its old defaults, and on this VM a
bring-up right after another plug-in bring-up's teardown ran up to 0.2 s slower than one after
SGLang's own (the host taking back the memory just freed), which read as 0.78-0.86x. The
plug-in's defaults (hugepages=auto, 4 GiB calls: issue #53) are also set against its old ones
(4 KiB pages, 64 GiB calls) in the same rounds, beside an A/A - the defaults against themselves,
the row's noise floor on this box.
Needs `make sglang`; says so and exits 0 without.
"""

from __future__ import annotations

import gc
import os
import statistics
import sys
import warnings
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))

from _timing import interleaved, median_line  # noqa: E402

from hicache.effects import package_version  # noqa: E402
from hicache.effects._host._release import wait_for_releases  # noqa: E402
from hicache.testing import FakeCudart, fake_cuda, sglang_on_cpu  # noqa: E402

GiB = 2**30
SEAM = ("alloc_with_host_register", "_cuda_host_register", "_cuda_host_unregister")


def main() -> int:
    if package_version("sglang") is None:
        print("bench_sglang: SGLang is not installed (make sglang); skipped")
        return 0
    sglang_on_cpu()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        import torch
        import sglang.srt.mem_cache.pool_host.base as base
        import sglang.srt.mem_cache.pool_host.common as common
        import sglang.srt.plugins as plugins
        from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool
        from sglang.srt.mem_cache.pool_host.base import host_memory_budget_scope
        from sglang.srt.mem_cache.pool_host.mha import MHATokenToKVPoolHost

    own = {name: getattr(common, name) for name in SEAM}
    plugins.load_plugins()  # SGLang's loader finds hicache's entry point and patches the seam
    ours = {name: getattr(common, name) for name in SEAM}
    assert all(ours[name] is not own[name] for name in SEAM), "the hicache plug-in did not load"
    base._is_cuda = True  # SGLang's destroy() unregisters only where it believes CUDA is

    def use(functions) -> None:
        for name, function in functions.items():
            setattr(common, name, function)
        base._cuda_host_unregister = functions["_cuda_host_unregister"]
        common.ALLOC_MEMORY_FUNCS.pop("cpu", None)  # resolved again from the module's name

    device = MHATokenToKVPool(size=4096, page_size=64, dtype=torch.bfloat16, head_num=8, head_dim=128,
                              layer_num=32, device="cpu", enable_memory_saver=False)
    info = device.get_device_pool_infos()[0].buffer_info
    per_token = 32 * 2 * 8 * 128 * 2

    #: the plug-in's defaults before issue #53: 4 KiB pages, one call per 64 GiB chunk
    old_defaults = {"HICACHE_HUGEPAGES": "off", "HICACHE_CALL_CAP": "none"}

    def build(size: int, rate, plugged: bool, settings=None):
        def run():
            for name in old_defaults:
                os.environ.pop(name, None)
            os.environ.update(settings or {})
            use(ours if plugged else own)
            fake = FakeCudart(register_bytes_per_s=rate)
            torch.cuda.cudart = lambda: fake  # SGLang's own helper asks torch for the driver
            with fake_cuda(register_bytes_per_s=rate), host_memory_budget_scope(10**13):
                host = MHATokenToKVPoolHost(info, 2.0, 0, 64, "page_first_direct", True, "cpu",
                                            device_capacity_tokens=4096, start_layer=0, end_layer=32,
                                            host_token_capacity=size // per_token)

            def teardown():
                with fake_cuda():
                    host.destroy()
                gc.collect()  # SGLang's pool sits in reference cycles: its buffers go with the collector
                # the plug-in's mapping dies with SGLang's tensor: its release thread gives the pages
                # back, and the next bring-up's admission would wait for that - untimed here, as
                # SGLang's own free is (none was pending in the runs here; the 0.78x was the round order)
                wait_for_releases()

            return teardown

        return run

    rounds = int(os.environ.get("HICACHE_BENCH_ROUNDS", "4"))
    sizes = [int(s) for s in os.environ.get("HICACHE_BENCH_SGLANG_GIB", "2,4").split(",")]
    for rate, driver in ((None, "instant fake driver"), (10e9, "fake driver at 10 GB/s"))[: int(os.environ.get("HICACHE_BENCH_DRIVERS", "1"))]:
        for gib in sizes:
            times = interleaved({"plugin": build(gib * GiB, rate, True), "sglang": build(gib * GiB, rate, False),
                                 "old": build(gib * GiB, rate, True, old_defaults),
                                 "plugin again": build(gib * GiB, rate, True)}, rounds=rounds, warmup=1)
            print(median_line(f"SGLang's MHA host pool, {gib} GiB, {driver}, with the hicache plug-in",
                              times["plugin"], "SGLang's own registration", times["sglang"]), flush=True)
            same = statistics.median(times["plugin again"]) / statistics.median(times["plugin"])
            print(median_line(f"SGLang's MHA host pool, {gib} GiB, {driver}, the plug-in's defaults (auto pages, "
                              "4 GiB calls)", times["plugin"], "its old defaults (4 KiB pages, 64 GiB calls)",
                              times["old"]) + f" | A/A (the defaults against themselves) {same:.2f}x", flush=True)
    use(own)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
