"""hicache.effects: the shell. The only layer that touches CUDA, mmap/madvise, /proc, /sys,
environment variables, psutil, locks and clocks. Heavy imports (torch, cuda-python, psutil)
are lazy: importing this package costs little."""

from hicache.effects._executor import (
    ProgressEvent,
    apply_plan,
    apply_pool_plan,
    apply_pool_plans,
)
from hicache.effects._registration import (
    RegisteredRange,
    Registration,
    RegistrationStatus,
    unregister_ranges,
)
from hicache.effects._host_memory import (
    QUARANTINE,
    HostBuffer,
    PrefaultReport,
    allocate_host,
    free_hugepages,
    os_page_bytes,
    prefault,
    quarantine,
)
from hicache.effects._ledger import PROCESS_LEDGER, HostLedger
from hicache.effects._lock import BudgetLock, budget_lock, runtime_dir
from hicache.effects._probes import (
    DEFAULT_CHUNK_LIMIT_BYTES,
    ENV_VARS,
    CudaFacts,
    EnvError,
    HugepagePool,
    MachineFacts,
    kernel_pin_cap,
    probe_cuda,
    probe_limits,
    probe_machine,
    GpuFacts,
    package_version,
    probe_gpus,
    probe_kernel_release,
    probe_resolved_limits,
    ranks_per_host,
    sglang_register_chunk_bytes,
)
from hicache.effects._runtime import (
    CudaPythonRuntime,
    HostRuntime,
    TorchCudartRuntime,
    default_binding,
    default_runtime,
    torch_runtime,
)
from hicache.effects._allocators import (
    FrameworkPinnedAllocator,
    HostTensorAllocator,
    TorchHostTensorAllocator,
)
from hicache.effects._bringup import (
    BufferRequest,
    HostPools,
    bring_up,
    bring_up_buffers,
    pool_requests,
)
from hicache.effects._interrupts import deferred_interrupts
from hicache.effects._copy_engine import CopyEngine
from hicache.effects._background import BackgroundBringUp, ProgressiveBringUp
from hicache.effects._progressive import Chunk, ProgressiveRegistration
from hicache.effects._numa import bound_node, node_free_bytes, online_nodes, resolve_numa_node

__all__ = [
    "BackgroundBringUp",
    "ProgressiveBringUp",
    "Chunk",
    "ProgressiveRegistration",
    "bound_node",
    "node_free_bytes",
    "online_nodes",
    "resolve_numa_node",
    "GpuFacts",
    "package_version",
    "probe_gpus",
    "sglang_register_chunk_bytes",
    "CopyEngine",
    "FrameworkPinnedAllocator",
    "HostTensorAllocator",
    "TorchHostTensorAllocator",
    "BufferRequest",
    "HostPools",
    "bring_up",
    "bring_up_buffers",
    "pool_requests",
    "deferred_interrupts",
    "default_binding",
    "default_runtime",
    "torch_runtime",
    "probe_resolved_limits",
    "probe_kernel_release",

    "BudgetLock",
    "CudaFacts",
    "CudaPythonRuntime",
    "DEFAULT_CHUNK_LIMIT_BYTES",
    "ENV_VARS",
    "EnvError",
    "HostBuffer",
    "HostLedger",
    "HostRuntime",
    "HugepagePool",
    "MachineFacts",
    "PROCESS_LEDGER",
    "QUARANTINE",
    "PrefaultReport",
    "ProgressEvent",
    "RegisteredRange",
    "Registration",
    "RegistrationStatus",
    "TorchCudartRuntime",
    "allocate_host",
    "apply_plan",
    "apply_pool_plan",
    "apply_pool_plans",
    "budget_lock",
    "free_hugepages",
    "kernel_pin_cap",
    "os_page_bytes",
    "prefault",
    "probe_cuda",
    "quarantine",
    "probe_limits",
    "probe_machine",
    "ranks_per_host",
    "runtime_dir",
    "unregister_ranges",
]
