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
    two = _sysfs(tmp_path / "a", "0-1", 1)
    assert resolve_numa_node("auto", cuda_binding=FakeCudaBinding(), root=two) == (1, None)
    unknown = _sysfs(tmp_path / "b", "0-1", None)
    node, note = resolve_numa_node("auto", cuda_binding=FakeCudaBinding(), root=unknown)
    assert node is None and "not bound" in note
    one = _sysfs(tmp_path / "c", "0", 0)
    assert resolve_numa_node("auto", root=one) == (None, None)  # one node: nothing to choose
    assert resolve_numa_node("off", root=two) == (None, None)


def test_a_node_that_is_not_online_is_refused_naming_the_online_ones(tmp_path):
    root = _sysfs(tmp_path, "0,2-3", None)
    assert online_nodes(root=root) == (0, 2, 3)
    assert resolve_numa_node(2, root=root) == (2, None)
    with pytest.raises(PlanError, match="numa_node 1 is not online; online nodes: 0, 2, 3"):
        resolve_numa_node(1, root=root)
    with pytest.raises(PlanError, match="'auto', 'off' or a node number"):
        resolve_numa_node("near", root=root)


def test_a_pool_binds_its_buffers_to_the_node_asked():
    from hicache.plan import Limits
    from hicache.pools import MHATokenToKVPoolHost
    from hicache.testing import MHADevicePool

    _bound_or_skip(2**20, 0).free()
    device = MHADevicePool(size=64, layer_num=2, head_num=2, head_dim=8, page_size=4)
    pool = MHATokenToKVPoolHost(device, 2.0, 0, 4, "page_first", False, "cpu", limits=Limits(chunk_limit_bytes=8192),
                                machine=ROOMY, numa_node=0)
    assert pool.numa_node == 0 and bound_node(pool.kv_buffer.data_ptr()) == 0
    pool.destroy()
