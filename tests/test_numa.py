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
from hicache.pools import HostPoolOptions
from hicache.effects import HostSetup

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
    pool = MHATokenToKVPoolHost(device, 2.0, 0, 4, "page_first", False, "cpu", host=HostSetup(limits=Limits(chunk_limit_bytes=8192), machine=ROOMY), options=HostPoolOptions(numa_node=0))
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


@pytest.mark.parametrize("node, pairs, all_cpus, ranks, threads, expected", [
    # (threads, pinned CPUs, ranks on the node): worked by hand from the rule in _numa.fault_share
    (0, ((0, tuple(range(8))), (1, tuple(range(8, 16)))), range(16), 8, None, (2, tuple(range(8)), 4)),
    (1, ((0, tuple(range(8))), (1, tuple(range(8, 16)))), range(16), 8, None, (2, tuple(range(8, 16)), 4)),
    (1, ((0, tuple(range(64))), (1, tuple(range(64, 128)))), range(128), 2, None, (16, tuple(range(64, 128)), 1)),
    (0, ((0, (0, 1, 2, 3)), (1, (4, 5, 6, 7))), range(8), 3, None, (2, (0, 1, 2, 3), 2)),  # ceil(3 / 2) share node 0
    (0, ((0, (0, 1)), (1, (2, 3))), range(4), 8, None, (1, (0, 1), 4)),  # fewer CPUs than ranks: one thread each
    (0, ((0, (0, 1, 2, 3)), (1, (4, 5, 6, 7))), range(8), 2, 6, (6, (0, 1, 2, 3), 1)),  # prefault_threads: the count
    (2, ((0, (0, 1)), (1, (2, 3)), (2, ())), range(4), 4, None, (1, None, 4)),  # memory-only node: unpinned
    (None, ((0, (0, 1)), (1, (2, 3))), range(4), 1, None, (4, None, 1)),  # bound nowhere: the process's CPUs
    (None, (), range(32), 1, None, (16, None, 1)),  # at most MAX_FAULT_THREADS
    (None, (), range(8), 4, None, (2, None, 4)),  # the host's ranks share its CPUs
    (5, ((0, (0, 1)),), range(2), 1, None, (2, None, 1)),  # a node outside the allowed ones: unpinned
])
def test_a_ranks_pre_fault_runs_on_its_nodes_cpus_an_equal_share_per_rank(node, pairs, all_cpus, ranks, threads,
                                                                          expected):
    """fault_share (issue #35 item 2): a pool bound to a node with CPUs pre-faults on that node's
    CPUs, each of the ceil(ranks / nodes with CPUs) ranks it hosts taking an equal share (1 to
    16 threads); unbound or on a memory-only node, unpinned with a share of the process's CPUs;
    prefault_threads sets the count, never the placement."""
    from hicache.effects.for_cli import fault_share

    share = fault_share(node, node_cpus=pairs, all_cpus=tuple(all_cpus), ranks_per_host=ranks, threads=threads)
    assert (share.threads, share.cpus, share.ranks_on_node) == expected and share.node == node


def test_each_nodes_cpus_are_its_cpulist_less_the_cpus_this_process_may_not_use(tmp_path):
    """node_cpus: each allowed node's sysfs cpulist, less the CPUs outside the process's affinity;
    a memory-only node and an unreadable cpulist have none."""
    from hicache.effects._host._numa import node_cpus

    root = _cpuset(_sysfs(tmp_path, "0-3", None), None, {0: "0-3", 1: "4-7", 2: ""})
    (tmp_path / "sys/devices/system/node/node3").mkdir(parents=True)  # no cpulist: unreadable
    assert node_cpus(root=root, allowed_cpus={0, 1, 4, 9}) == ((0, (0, 1)), (1, (4,)), (2, ()), (3, ()))


def test_a_pipelined_bring_up_pre_faults_on_its_nodes_cpus(tmp_path, monkeypatch):
    """bring_up of a pool on node 1 of a two-node machine (CPU 0 | CPU 1): every pre-fault piece
    ran on CPU 1 only (the trace records each piece's CPUs), with the allocator's
    prefault_threads as the count."""
    import json
    import os

    import attrs

    import hicache.effects._host._memory as memory
    from hicache.effects import Report, bring_up
    from hicache.effects import HostSetup
    from hicache.effects import HostTensorAllocator
    from hicache.plan import Limits, MHALayout, plan_pool
    from hicache.testing import FakeCudart, FakeRuntime

    if not hasattr(os, "sched_setaffinity") or 1 not in os.sched_getaffinity(0):
        pytest.skip("needs CPU 1 in this process's affinity (Linux)")
    monkeypatch.setattr(memory, "bind", lambda ptr, length, node: None)  # this box has one node
    machine = attrs.evolve(ROOMY, numa_node_cpus=((0, (0,)), (1, (1,))), cpus=(0, 1))
    plan = plan_pool(MHALayout("page_first", layer_num=2, head_num=2, head_dim=64, page_size=16, page_num=1024,
                               itemsize=2), Limits(chunk_limit_bytes=1 << 20))
    trace = tmp_path / "trace.json"
    handle = bring_up(plan, host=HostSetup(runtime=FakeRuntime(FakeCudart()), machine=machine, ranks_per_host=2,
                                           allocator=HostTensorAllocator(numa_node=1, prefault_threads=2)), budget=False,
                      report=Report("numa", trace=str(trace)))
    handle.release()
    pieces = [e for e in json.loads(trace.read_text())["traceEvents"] if e.get("name") == "pre-fault"]
    assert pieces and {piece["args"]["cpus"] for piece in pieces} == {"1"}
    assert len({piece["tid"] for piece in pieces}) <= 2
