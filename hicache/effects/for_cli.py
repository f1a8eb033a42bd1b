"""hicache.effects.for_cli: a sub-face for one audience, the CLI's `doctor`, `plan` and `apply`
(issue #34 item 6, #55 item 5): the check of every HICACHE_* variable, the host copy's mode and
helper, whether the gather's kernel runs, the GPUs and their NUMA nodes, a node's free memory and each rank's pre-fault share of
its node's CPUs, the kernel release. Each name lives in its own room; this module names them."""

from hicache.effects._copy import _gather
from hicache.effects._copy._host_copy import host_copy_info
from hicache.effects._host._environment import environment_problems
from hicache.effects._host._numa import fault_share, node_free_bytes
from hicache.effects._host._probes import probe_gpus, probe_kernel_release

warm_gather_kernel = _gather.WARMTH.warm  # (device, word) -> None where the gather's kernel runs, else why not

__all__ = ["environment_problems", "fault_share", "host_copy_info", "node_free_bytes", "probe_gpus",
           "probe_kernel_release", "warm_gather_kernel"]
