"""NUMA placement: a mapping bound to the requested node before anything faults it, the GPU's
node found for "auto", a node that is not online refused with the online ones named."""

from __future__ import annotations

import pytest
from machine import ROOMY

from hicache.effects._host._memory import allocate_host, prefault
from hicache.effects._host._numa import bound_node, online_nodes
from hicache.effects import resolve_numa_node
from hicache.errors import HostOutOfMemoryError, PlanError
from hicache.testing import FakeCudaBinding

pytest.importorskip("torch")


def _bound_or_skip(nbytes, node):
    try:
        return allocate_host(nbytes, numa_node=node)
    except HostOutOfMemoryError as error:  # a kernel or container without mbind
        pytest.skip(f"mbind unavailable here: {error}")


def test_a_buffer_is_bound_to_node_0_before_it_is_faulted():
    """A buffer asked for node 0 is bound there (first and last page) before its pre-fault, and the
    note says so."""
    buffer = _bound_or_skip(8 * 2**20, 0)
    try:
        assert bound_node(buffer.ptr) == 0 and any("NUMA node 0" in n for n in buffer.notes)
        from pathlib import Path

        maps = Path("/proc/self/numa_maps").read_text().splitlines()
        line = next(m for m in maps if m.startswith(format(buffer.ptr, "x")))
        assert "bind:0" in line
        prefault(buffer)  # faulted where it is bound
        assert bound_node(buffer.ptr + buffer.nbytes - 1) == 0
    finally:
        buffer.free()
    plain = allocate_host(2**20)
    assert bound_node(plain.ptr) is None  # no binding unless asked
    plain.free()


def _sysfs(tmp_path, online: str, gpu_node: int | None):
    (tmp_path / "sys/devices/system/node").mkdir(parents=True)
    (tmp_path / "sys/devices/system/node/online").write_text(online + "\n")
    if gpu_node is not None:
        device = tmp_path / "sys/bus/pci/devices/0000:3b:00.0"
        device.mkdir(parents=True)
        (device / "numa_node").write_text(f"{gpu_node}\n")
    return str(tmp_path)


def test_auto_picks_the_gpus_node_and_says_when_it_cannot(tmp_path):
    """numa auto picks the current GPU's node, binds nothing with one node, and says why when it
    cannot bind."""
    two = _sysfs(tmp_path / "a", "0-1", 1)
    assert resolve_numa_node("auto", cuda_binding=FakeCudaBinding(), root=two) == (1, None)
    unknown = _sysfs(tmp_path / "b", "0-1", None)
    node, note = resolve_numa_node("auto", cuda_binding=FakeCudaBinding(), root=unknown)
    assert node is None and "not bound" in note
    one = _sysfs(tmp_path / "c", "0", 0)
    assert resolve_numa_node("auto", root=one) == (None, None)  # one node: nothing to choose
    assert resolve_numa_node("off", root=two) == (None, None)


def test_a_node_that_is_not_online_is_refused_naming_the_online_ones(tmp_path):
    """An offline NUMA node is refused naming the online ones; an online one is accepted."""
    root = _sysfs(tmp_path, "0,2-3", None)
    assert online_nodes(root=root) == (0, 2, 3)
    assert resolve_numa_node(2, root=root) == (2, None)
    with pytest.raises(PlanError, match="numa_node 1 is not online; online nodes: 0, 2, 3"):
        resolve_numa_node(1, root=root)
    with pytest.raises(PlanError, match="'auto', 'off' or a node number"):
        resolve_numa_node("near", root=root)


def test_a_pool_binds_its_buffers_to_the_node_asked():
    """A pool built with numa_node=0 has its buffers bound to node 0."""
    from hicache.plan import Limits
    from hicache.pools import MHATokenToKVPoolHost
    from hicache.testing import MHADevicePool

    _bound_or_skip(2**20, 0).free()
    device = MHADevicePool(size=64, layer_num=2, head_num=2, head_dim=8, page_size=4)
    pool = MHATokenToKVPoolHost(device, 2.0, 0, 4, "page_first", False, "cpu", limits=Limits(chunk_limit_bytes=8192),
                                machine=ROOMY, numa_node=0)
    assert pool.numa_node == 0 and bound_node(pool.kv_buffer.data_ptr()) == 0
    pool.destroy()


def _cpuset(root: str, mems: str | None, cpus: dict) -> str:
    """A fake /proc/self/status with ``Mems_allowed_list`` (None: no such line) and each node's
    cpulist (an empty string: a memory-only node)."""
    from pathlib import Path

    (Path(root) / "proc/self").mkdir(parents=True, exist_ok=True)
    lines = ["Name:\tpython", "Cpus_allowed_list:\t0-7"] + ([f"Mems_allowed_list:\t{mems}"] if mems is not None else [])
    (Path(root) / "proc/self/status").write_text("\n".join(lines) + "\n")
    for node, cpulist in cpus.items():
        directory = Path(root) / f"sys/devices/system/node/node{node}"
        directory.mkdir(parents=True, exist_ok=True)
        (directory / "cpulist").write_text(cpulist + "\n")
        (directory / "meminfo").write_text(f"Node {node} MemFree:  {1024 * (node + 1)} kB\n")
    return root


def test_auto_and_explicit_nodes_stay_inside_the_cpuset_and_off_memory_only_nodes(tmp_path):
    """The process may use nodes 0 and 2 (its cpuset); node 2 has no CPUs. auto never binds to
    the GPU's node when it is outside the cpuset or memory-only (a note says why); an explicit
    node outside the cpuset is refused naming the allowed ones; an explicit memory-only node is
    bound as asked, with a note. doctor reports only the usable nodes and flags node 2."""
    from hicache.cli._doctor import _numa, Context
    from hicache.effects import probe_machine
    from hicache.effects._host._numa import allowed_nodes, memory_only_nodes, node_free_bytes

    root = _cpuset(_sysfs(tmp_path / "a", "0-2", 1), "0,2", {0: "0-3", 1: "4-7", 2: ""})
    assert allowed_nodes(root=root) == (0, 2) and memory_only_nodes(root=root) == (2,)
    assert set(node_free_bytes(root=root)) == {0, 2}
    node, note = resolve_numa_node("auto", cuda_binding=FakeCudaBinding(), root=root)
    assert node is None and "node 1 is outside this process's cpuset (mems 0,2)" in note
    with pytest.raises(PlanError, match="numa_node 1 is outside this process's cpuset; it may use nodes 0, 2"):
        resolve_numa_node(1, root=root)
    assert resolve_numa_node(0, root=root) == (0, None)
    node, note = resolve_numa_node(2, root=root)
    assert node == 2 and "memory-only" in note
    memory_only_gpu = _cpuset(_sysfs(tmp_path / "b", "0-1", 1), "0-1", {0: "0-3", 1: ""})
    node, note = resolve_numa_node("auto", cuda_binding=FakeCudaBinding(), root=memory_only_gpu)
    assert node is None and "has no CPUs (memory-only)" in note
    no_line = _cpuset(_sysfs(tmp_path / "c", "0-1", 1), None, {0: "0-3", 1: "4-7"})
    assert allowed_nodes(root=no_line) == (0, 1)  # unreadable cpuset: every online node
    assert resolve_numa_node("auto", cuda_binding=FakeCudaBinding(), root=no_line) == (1, None)

    facts = probe_machine(root=root, env={})
    assert facts.numa_allowed_nodes == (0, 2) and facts.numa_memory_only_nodes == (2,)
    check = _numa(Context(plan=None, facts=facts, resolved=None, env={}, cuda_binding=None, total=0, calls=0,
                          largest=0, ranks=1, limits=None, root=root))
    assert "node 2 3 MiB (memory-only: no CPUs)" in check.finding and "node 1 " not in check.finding
    assert "may use node(s) 0,2 only (its cpuset)" in check.finding
