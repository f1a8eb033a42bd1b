"""`hicache.testing`'s fake host: machine facts of no real machine and a `HostSetup` with nothing
of this machine's or this host's (issue #34 item 5), over the fake CUDA driver by default."""

from __future__ import annotations

from pathlib import Path
import tempfile

import attrs

from hicache.effects import BudgetLock, CopyEngine, HostLedger, HostSetup, MachineFacts
from hicache.plan import Limits
from hicache.testing._fake_cuda import FakeRuntime


def fake_machine(**changes) -> MachineFacts:
    """Machine facts of no real machine: 2,000 GB total, 1,900 GB available, one NUMA node, one
    rank, no hugepages, no pin cap, no memlock limit (``changes`` replace any field)."""
    facts = dict(kernel_release="6.8.0", kernel_pin_cap_bytes=None, os_page_bytes=4096, thp_enabled="madvise",
                 thp_defrag="madvise", hugepages=(), memlock_soft=None, memlock_hard=None, max_map_count=65530,
                 total_bytes=2000 * 10**9, available_bytes=1900 * 10**9, cgroup_limit_bytes=None,
                 cgroup_usage_bytes=None, numa_nodes=1, ranks_per_host=1)
    return MachineFacts(**{**facts, **changes})


def fake_host_setup(directory=None, *, runtime=None, machine=None, **changes) -> HostSetup:
    """A `HostSetup` with nothing of this machine's or this host's: a `FakeRuntime` (or
    ``runtime``), `fake_machine()` (or ``machine``), 1 GiB chunks on 4 KiB pages, a budget lock in
    ``directory`` (None: a new private temporary directory - peers elsewhere never see it), a
    ledger of its own, no turnstile, the python host copy (no C helper); ``changes`` replace any
    field (``host_memory_bytes=``, ``ranks_per_host=``, ...)."""
    lock = BudgetLock(Path(directory if directory is not None else tempfile.mkdtemp(prefix="hicache-fake-host-")))
    setup = HostSetup(runtime=FakeRuntime() if runtime is None else runtime,
                      machine=fake_machine() if machine is None else machine,
                      limits=Limits(chunk_limit_bytes=1 << 30, os_page_bytes=4096), lock=lock, ledger=HostLedger(),
                      turnstile=None, copy_engine=CopyEngine(host_copy_mode="python"))
    return attrs.evolve(setup, **changes)
