"""Pool bring-up end to end, ours vs the plain steps done by hand, one run.

- ours: `MHATokenToKVPoolHost(..., pin_memory=True)` then `destroy()`: budget under the host
  lock, allocate, pre-fault, register (fake CUDA: the registration itself costs nothing here),
  then release and free - everything the pool does to come up and go down.
- baseline: the fastest plain way to the same state: `allocate_host` + `prefault` +
  `apply_pool_plan` with the same fake runtime, then release and free (no budget, no lock).
Size: HICACHE_BENCH_GIB (default 2). Medians of HICACHE_BENCH_ROUNDS (7) interleaved rounds.
"""

from __future__ import annotations

import os
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))

from _timing import interleaved, median_line  # noqa: E402

import torch  # noqa: E402

from hicache.effects._host._memory import allocate_host, prefault  # noqa: E402
from hicache.effects import apply_pool_plan  # noqa: E402
from hicache.plan import Limits  # noqa: E402
from hicache.pools import MHATokenToKVPoolHost  # noqa: E402
from hicache.testing import FakeRuntime, MHADevicePool  # noqa: E402
from hicache.effects import HostSetup

LIMITS = Limits(chunk_limit_bytes=256 * 2**20)


def main() -> None:
    gib = float(os.environ.get("HICACHE_BENCH_GIB", "2"))
    runtime_dir = tempfile.mkdtemp(prefix="hicache-bench-")
    os.chmod(runtime_dir, 0o700)
    os.environ["HICACHE_RUNTIME_DIR"] = runtime_dir
    device = MHADevicePool(size=64, layer_num=8, head_num=8, head_dim=128, page_size=64, dtype=torch.bfloat16)
    host_gb = gib * 2**30 / 1e9

    def ours():
        pool = MHATokenToKVPoolHost(device, 1.0, host_gb, 64, "page_first_direct", True, "cpu",
                                    host=HostSetup(runtime=FakeRuntime(), limits=LIMITS, host_memory_bytes=10**15))
        pool.destroy()

    probe = MHATokenToKVPoolHost(device, 1.0, host_gb, 64, "page_first_direct", False, "cpu",
                                 host=HostSetup(limits=LIMITS, host_memory_bytes=10**15))
    plan = probe.pool_plan
    probe.destroy()

    def plain():
        buffers = [allocate_host(b.spec.nbytes) for b in plan.buffers]
        for buffer in buffers:
            prefault(buffer)
        registration = apply_pool_plan(plan, base_ptrs=[b.ptr for b in buffers], runtime=FakeRuntime())
        registration.release()
        for buffer in buffers:
            buffer.free()

    plain()  # warm-up: first large mappings in a process pay for reclaim
    times = interleaved({"ours": ours, "plain": plain}, rounds=int(os.environ.get("HICACHE_BENCH_ROUNDS", "7")))
    label = f"pool bring-up + teardown, {gib:g} GiB ({plan.call_count} calls, fake CUDA)"
    print(median_line(label, times["ours"], "allocate_host + prefault + apply_pool_plan by hand", times["plain"]))


if __name__ == "__main__":
    main()
