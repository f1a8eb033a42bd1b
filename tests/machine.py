"""Machine facts the tests inject, so no test depends on the free RAM, cores or kernel of the
machine it runs on (conftest also makes psutil report a small machine, to catch any test that
forgets)."""

from __future__ import annotations

import collections

import attrs
import pytest

from hicache.effects import MachineFacts

GB = 10**9

ROOMY = MachineFacts(
    kernel_release="6.8.0", kernel_pin_cap_bytes=None, os_page_bytes=4096, thp_enabled="madvise",
    thp_defrag="madvise", hugepages=(), memlock_soft=None, memlock_hard=None, max_map_count=65530,
    total_bytes=2000 * GB, available_bytes=1900 * GB, cgroup_limit_bytes=None, cgroup_usage_bytes=None,
    numa_nodes=1, ranks_per_host=1,
)


def facts(**changes) -> MachineFacts:
    """ROOMY with ``changes`` (e.g. ``available_bytes=12 * GB, ranks_per_host=4``)."""
    return attrs.evolve(ROOMY, **changes)


#: What the patched psutil reports: a 4 GB box with 3 GB available (CI's smallest).
SMALL_TOTAL, SMALL_AVAILABLE = 4 * GB, 3 * GB


@pytest.fixture
def roomy_psutil(monkeypatch):
    """For code that takes no machine facts (SGLang's call sites pass none): psutil reports a
    roomy machine (ROOMY's total and available memory)."""
    import psutil

    real = getattr(psutil.virtual_memory, "__wrapped__", psutil.virtual_memory)
    Memory = collections.namedtuple("svmem", real()._fields)

    def roomy():
        values = real()._asdict()
        values.update(total=ROOMY.total_bytes, available=ROOMY.available_bytes)
        return Memory(**values)

    monkeypatch.setattr(psutil, "virtual_memory", roomy)
