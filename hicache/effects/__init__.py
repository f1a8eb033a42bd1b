"""hicache.effects: the shell. The only layer that touches CUDA, mmap/madvise, /proc, /sys,
environment variables, psutil, locks and clocks. Heavy imports (torch, cuda-python, psutil)
are lazy: importing this package costs little.

Rooms imported downward only (a test checks it), over two leaves every room may use -
``_interrupts`` (Ctrl-C, SIGTERM and SIGHUP held while books change) and ``_trace`` (the
bring-up trace, HICACHE_TRACE / ``Report(trace=)``): the leaves <- ``_hostwide`` (what the
processes of a host agree through: the private runtime directory, the budget lock and its
claims, the registration turnstile) <- ``_cuda`` (codes, runtimes, ledger, executor,
registrations) <- ``_host`` (mapping, pre-fault, NUMA, probes, allocators) and ``_copy`` (the
copy engine) <- ``_bringup`` (faulting, admission, the one handle, `bring_up`) and ``_arena``
(the node store's file) <- this face. Nothing outside ``effects`` imports a room; this face is
ARCHITECTURE's stable API plus what pools, the CLI, compat and hicache.testing use, and six
sub-faces, one per audience (issue #55 item 5): ``admission``, ``arena``, ``cuda_codes``,
``for_cli``, ``for_sglang``, ``trace`` - real modules whose public names are exactly their
``__all__`` (a room exported as a name reached everything it held).
"""

from hicache.effects._bringup._bring_up import BufferRequest, Progressive, bring_up
from hicache.effects._bringup._report import Report
from hicache.effects._bringup._setup import HostSetup
from hicache.effects._cuda._ledger import HostLedger
from hicache.effects._hostwide._lock import BudgetLock
from hicache.effects._bringup._handle import HostPools
from hicache.effects._copy._engine import CopyEngine
from hicache.effects._cuda._executor import apply_plan, apply_pool_plan
from hicache.effects._cuda._registration import Registration
from hicache.effects._cuda._runtime import CudaPythonRuntime, TorchCudartRuntime, stand_in_runtime
from hicache.effects._interrupts import terminate_as_interrupt
from hicache.effects._host._allocators import (
    FrameworkPinnedAllocator,
    HostAllocator,
    HostTensorAllocator,
    TorchHostTensorAllocator,
)
from hicache.effects._host._memory import os_page_bytes
from hicache.effects._host._environment import pool_settings
from hicache.effects._host._probes import (
    MachineFacts,
    package_version,
    probe_cuda,
    probe_limits,
    probe_machine,
    probe_resolved_limits,
    resolve_numa_node,
)
from hicache.effects import admission, arena, cuda_codes, for_cli, for_sglang, trace  # sub-faces, one per audience

__all__ = [
    # ARCHITECTURE's stable API
    "CudaPythonRuntime",
    "Registration",
    "apply_plan",
    "apply_pool_plan",
    # the one bring-up and its handle
    "BufferRequest",
    "HostPools",
    "Progressive",
    "bring_up",
    "Report",  # how a bring-up shows in the metrics (bring_up(report=))
    # the host's pieces a bring-up takes (bring_up(host=), pools' host=), and the types of its
    # fields (a Turnstile comes through `admission`, where the turnstile's callers find it)
    "HostSetup",
    "BudgetLock",
    "HostLedger",
    "admission",
    # the node store's arena room (hicache.store); the bring-up trace (the CLI's checks, merge)
    "arena",
    "trace",
    # host memory and allocators
    "FrameworkPinnedAllocator",
    "HostAllocator",
    "HostTensorAllocator",
    "TorchHostTensorAllocator",
    "os_page_bytes",
    # machine probes
    "MachineFacts",
    # SIGTERM / SIGHUP undone as Ctrl-C is (the commands that hold memory)
    "terminate_as_interrupt",
    "package_version",
    "pool_settings",
    "probe_cuda",
    "probe_limits",
    "probe_machine",
    "probe_resolved_limits",
    "resolve_numa_node",
    # copies
    "CopyEngine",
    # compat.sglang and hicache.testing
    "TorchCudartRuntime",
    "cuda_codes",
    "stand_in_runtime",
    # what only the CLI and only compat ask (issue #34 item 6), as one module each
    "for_cli",
    "for_sglang",
]
