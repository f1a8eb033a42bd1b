"""One serving instance for the two-instance L3 test (tests/test_sglang_mooncake.py), run as its
own process: SGLang 0.5.23's real code with the hicache plug-in loaded by SGLang's
`load_plugins()`, its host pool built by SGLang's assembler (`build_kv_host_pool`) under
`hicache.testing.fake_cuda`, and SGLang's real `MooncakeStore` (made by its backend factory)
over a Mooncake master on 127.0.0.1.

    python sglang_instance.py RPC_PORT METADATA_PORT SEED PAGES

With HICACHE_SGLANG_POOLS=1 in its environment the plug-in makes the assembler build hicache's
pool instead of SGLang's (the report names whose it got). The instance fills its device pool
from SEED, backs the pages up to its host pool (SGLang's "direct" backend), stores them
zero-copy through MooncakeStore and says "stored". Then a line "fetch OTHER_SEED" on its stdin
(the other instance stored too) makes it look those pages up, fetch them into its host pool
and load them to its device pool, comparing byte for byte against what OTHER_SEED gives; it
says "fetched" and keeps its Mooncake segment (where its own pages may live) until its stdin
closes. It then destroys the pool and checks nothing stays registered. The last stdout line is
a JSON report.
"""

from __future__ import annotations

import json
import sys
import warnings

PAGE = 16
LAYERS, HEADS, DIM = 3, 2, 64


def _device_contents(seed: int, shape) -> list:
    import torch

    generator = torch.Generator().manual_seed(seed)
    return [torch.randn(shape, generator=generator).to(torch.bfloat16) for _ in range(2 * LAYERS)]


def main(rpc_port: int, metadata_port: int, seed: int, pages: int) -> dict:
    from hicache.testing import fake_cuda, sglang_on_cpu

    sglang_on_cpu()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        import torch

        import sglang.srt.mem_cache.pool_host.base as base
        import sglang.srt.mem_cache.pool_host.common as common
        import sglang.srt.plugins as plugins
        from sglang.srt.mem_cache.hicache_storage import HiCacheStorageConfig
        from sglang.srt.mem_cache.hybrid_cache.hybrid_pool_assembler import build_kv_host_pool
        from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool
        from sglang.srt.mem_cache.pool_host.base import host_memory_budget_scope
        from sglang.srt.mem_cache.storage.backend_factory import StorageBackendFactory
        from sglang.srt.runtime_context import SpawnRanks, publish, reset_context
        from sglang.srt.server_args import ServerArgs

    original = common.alloc_with_host_register
    plugins.load_plugins()
    report = {"seed": seed, "plugged": common.alloc_with_host_register is not original}
    base._is_cuda = True  # SGLang's destroy() unregisters only where it thinks CUDA is
    reset_context()  # what a server publishes at start: the HiCache settings its assembler reads
    publish(
        ServerArgs(model_path="dummy", page_size=PAGE, enable_hierarchical_cache=True, hicache_ratio=2.0,
                   hicache_mem_layout="page_first_direct", hicache_io_backend="direct",
                   hicache_storage_backend="mooncake"),
        role="test", ranks=SpawnRanks(world_rank=0, dp_rank=None),
    )
    device = MHATokenToKVPool(size=256, page_size=PAGE, dtype=torch.bfloat16, head_num=HEADS, head_dim=DIM,
                              layer_num=LAYERS, device="cpu", enable_memory_saver=False)
    tokens = pages * PAGE
    keys = [f"page-{seed}-{i}" for i in range(pages)]
    with fake_cuda() as fake:
        with host_memory_budget_scope(10**12):
            host = build_kv_host_pool(kv_pool=device, page_size=PAGE)
        report["pool"] = [type(host).__name__, host.layout, type(host.allocator).__name__,
                          type(host).__module__.split(".")[0]]
        ranges = {tuple(r) for r in host.kv_buffer._sglang_cuda_host_registered_ranges}
        report["ranges_exact"] = bool(ranges) and ranges == fake.held()
        config = HiCacheStorageConfig(
            tp_rank=0, tp_size=1, pp_rank=0, pp_size=1, attn_cp_rank=0, attn_cp_size=1, is_mla_model=False,
            enable_storage_metrics=False, is_page_first_layout=True, model_name="hicache/l3-test",
            extra_config={
                "master_server_address": f"127.0.0.1:{rpc_port}", "local_hostname": "127.0.0.1",
                "metadata_server": f"http://127.0.0.1:{metadata_port}/metadata", "protocol": "tcp",
                "device_name": "", "global_segment_size": 64 << 20, "check_server": False,
            },
        )
        store = StorageBackendFactory.create_backend("mooncake", config, host)
        store.register_mem_pool_host(host)
        rows = (tokens, HEADS, DIM)
        expected = _device_contents(seed, rows)
        device_indices = torch.arange(PAGE, PAGE + tokens)  # row 0 is the device pool's padding
        for layer in range(LAYERS):
            device.k_buffer[layer][device_indices] = expected[layer]
            device.v_buffer[layer][device_indices] = expected[LAYERS + layer]
        host_indices = host.alloc(tokens)
        host.backup_from_device_all_layer(device, host_indices, device_indices, "direct")
        report["stored"] = store.batch_set_v1(keys, host_indices)
        print("stored", flush=True)
        command, other = sys.stdin.readline().split()  # "fetch OTHER_SEED": the other stored too
        assert command == "fetch", command
        theirs = [f"page-{other}-{i}" for i in range(pages)]
        wanted = _device_contents(int(other), rows)
        host.alloc(3 * PAGE)  # other requests' pages: this instance's slots differ from the store's
        host_indices = host.alloc(tokens)
        report["exists"] = store.batch_exists(theirs)
        report["fetched"] = store.batch_get_v1(theirs, host_indices)
        device_indices = torch.arange(5 * PAGE, 5 * PAGE + tokens)
        for layer in range(LAYERS):
            host.load_to_device_per_layer(device, host_indices, device_indices, layer, "direct")
        got = [device.k_buffer[layer][device_indices] for layer in range(LAYERS)]
        got += [device.v_buffer[layer][device_indices] for layer in range(LAYERS)]
        report["byte_exact"] = all(torch.equal(a.view(torch.int16), b.view(torch.int16)) for a, b in zip(got, wanted))
        report["missing_is_a_miss"] = store.batch_exists([f"never-stored-{seed}"]) == 0
        print("fetched", flush=True)
        sys.stdin.read()  # keep this instance's Mooncake segment until the other fetched too
        host.destroy()
        report["held_after_destroy"] = sorted(fake.held())
        fake.check_valid()
    reset_context()
    return report


if __name__ == "__main__":
    print(json.dumps(main(*map(int, sys.argv[1:5]))), flush=True)
