"""One scheduler-like process for tests/test_metrics_multiprocess.py: SGLang 0.5.23's real code
with the hicache plug-in loaded by SGLang's `load_plugins()`, one host pool built by SGLang's
assembler (`build_kv_host_pool`) under `hicache.testing.fake_cuda` - SGLang's own pool class
(the plug-in's seam mode) or, with HICACHE_SGLANG_POOLS=1, hicache's (pools mode).

Run with PROMETHEUS_MULTIPROC_DIR set (as SGLang's launcher sets it for every process): its
metrics reach the parent only through the value files. The one stdout line is a JSON report
of what the fake driver recorded (bytes held, register calls) and of what this process's own
collector says (the samples the parent must find under this pid). The pool is left up.
"""

from __future__ import annotations

import json
import os
import sys
import warnings

PAGE = 16


def main(tokens: int) -> dict:
    from hicache.testing import fake_cuda, sglang_on_cpu

    sglang_on_cpu()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        import torch

        import sglang.srt.mem_cache.pool_host.base as base
        import sglang.srt.plugins as plugins
        from sglang.srt.mem_cache.hybrid_cache.hybrid_pool_assembler import build_kv_host_pool
        from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool
        from sglang.srt.mem_cache.pool_host.base import host_memory_budget_scope
        from sglang.srt.runtime_context import SpawnRanks, publish, reset_context
        from sglang.srt.server_args import ServerArgs

    plugins.load_plugins()
    base._is_cuda = True
    reset_context()
    publish(ServerArgs(model_path="dummy", page_size=PAGE, enable_hierarchical_cache=True, hicache_ratio=2.0,
                       hicache_mem_layout="page_first_direct", hicache_io_backend="direct"),
            role="test", ranks=SpawnRanks(world_rank=0, dp_rank=None))
    device = MHATokenToKVPool(size=tokens, page_size=PAGE, dtype=torch.bfloat16, head_num=2, head_dim=64,
                              layer_num=3, device="cpu", enable_memory_saver=False)
    fake_cm = fake_cuda()
    fake = fake_cm.__enter__()  # left open: the pool stays registered while the parent reads
    with host_memory_budget_scope(10**12):
        host = build_kv_host_pool(kv_pool=device, page_size=PAGE)
    from prometheus_client import values
    from prometheus_client.core import REGISTRY

    from hicache import metrics

    samples = [(s.name, s.labels, s.value) for family in metrics._Collector().collect() for s in family.samples
               if s.name in ("hicache_registered_bytes", "hicache_registration_calls_total", "hicache_bringup_seconds",
                             "hicache_pages", "hicache_ready_pages")]
    report = {
        "pid": os.getpid(), "pool_class": type(host).__name__, "pool_module": type(host).__module__.split(".")[0],
        "held_bytes": sum(size for _, size in fake.held()), "register_calls": fake.cudart.register_calls,
        "multiprocess": bool(getattr(values.ValueClass, "_multiprocess", False)), "samples": samples,
        "in_default_registry": any(type(c).__name__ == "_Collector" for c in REGISTRY._collector_to_names),
    }
    host.keep = (fake_cm, device)  # nothing is released before the process ends
    return report


if __name__ == "__main__":
    print(json.dumps(main(int(sys.argv[1]))), flush=True)
    os._exit(0)  # no teardown: a release would write 0s; the files keep what a scrape saw while it ran
