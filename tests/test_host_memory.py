"""Host memory: page-aligned mmap tensors, parallel pre-fault, and no unmap while registered."""

from __future__ import annotations

import pytest

from hicache.effects import HostLedger, allocate_host, apply_plan, os_page_bytes, prefault
from hicache.errors import HostOutOfMemoryError, PlanError, RegistrationStateError
from hicache.plan import Limits, plan_registration
from hicache.testing import FakeRuntime

torch = pytest.importorskip("torch")


def test_allocation_is_page_aligned_and_backs_a_tensor():
    """The base is OS-page aligned and the tensor has exactly nbytes, mapping rounded up."""
    page = os_page_bytes()
    buffer = allocate_host(3 * page + 5)
    assert buffer.ptr % page == 0 and buffer.tensor.numel() == 3 * page + 5
    assert buffer.mapped_bytes == 4 * page
    buffer.tensor[-1] = 7
    assert buffer.view(torch.uint8, (3 * page + 5,))[-1] == 7
    buffer.free()
    buffer.free()  # idempotent
    assert buffer.freed
    with pytest.raises(RegistrationStateError, match="freed"):
        buffer.tensor


def test_prefault_keeps_contents_and_reports():
    """Pre-faulting from several threads keeps data and reports how it ran."""
    buffer = allocate_host(8 * 2**20)
    buffer.tensor[12345] = 42
    report = prefault(buffer, threads=2, piece_bytes=2**20)
    assert report.pieces == 8 and report.threads == 2
    assert report.method in ("madvise", "touch", "madvise+touch")
    assert int(buffer.tensor[12345]) == 42
    buffer.free()


def test_memory_still_registered_is_never_unmapped():
    """free() refuses while the ledger says any of the buffer is registered, then succeeds."""
    buffer = allocate_host(4 * os_page_bytes())
    ledger = HostLedger()
    plan = plan_registration(buffer.nbytes, granularity_bytes=4096, limits=Limits(chunk_limit_bytes=8192))
    registration = apply_plan(plan, base_ptr=buffer.ptr, runtime=FakeRuntime(), ledger=ledger)
    with pytest.raises(RegistrationStateError, match="still registered"):
        buffer.free(ledger=ledger)
    assert not buffer.freed
    registration.release()
    buffer.free(ledger=ledger)
    assert buffer.freed


def test_views_keep_the_mapping_alive_after_free():
    """A view taken before free() stays valid: the mapping goes when the last view does."""
    buffer = allocate_host(2 * os_page_bytes())
    view = buffer.tensor[:16]
    view.fill_(3)
    buffer.free()
    assert int(view.sum()) == 48


def test_zero_byte_allocation_is_empty():
    """allocate_host(0) maps nothing and frees cleanly."""
    buffer = allocate_host(0)
    assert buffer.nbytes == 0 and buffer.ptr == 0
    assert prefault(buffer).pieces == 0
    buffer.free()


def test_required_hugepages_say_free_versus_needed(tmp_path):
    """With no reserved hugepages, 'required' fails naming pages needed and free."""
    pool = tmp_path / "sys/kernel/mm/hugepages/hugepages-2048kB"
    pool.mkdir(parents=True)
    (pool / "nr_hugepages").write_text("4\n")
    (pool / "free_hugepages").write_text("1\n")
    with pytest.raises(HostOutOfMemoryError, match=r"needs 3 pages of 2 MiB, 1 free of 4 reserved"):
        allocate_host(5 * 2**20, hugepages="required", sysfs_root=str(tmp_path))
    buffer = allocate_host(5 * 2**20, hugepages="prefer", sysfs_root=str(tmp_path))
    assert buffer.hugepage_bytes is None and "using normal pages" in buffer.notes[0]
    buffer.free()


def test_bad_arguments():
    """Negative sizes and unknown hugepage modes are refused by name."""
    with pytest.raises(PlanError, match="allocate_host.nbytes must be >= 0, got -1"):
        allocate_host(-1)
    with pytest.raises(PlanError, match="hugepages must be one of"):
        allocate_host(4096, hugepages="yes")


def _failing_madvise(code):
    import ctypes

    def madvise(addr, length, advice):
        ctypes.set_errno(code)
        return -1

    return lambda: madvise


def test_prefault_falls_back_to_touching_pages(monkeypatch):
    """On a kernel without MADV_POPULATE_WRITE (EINVAL) every page is touched, data kept."""
    import errno

    from hicache.effects import _host_memory

    monkeypatch.setattr(_host_memory, "_madvise", _failing_madvise(errno.EINVAL))
    buffer = allocate_host(4 * 2**20)
    buffer.tensor[4096 * 3] = 9
    report = prefault(buffer, threads=2, piece_bytes=2**20)
    assert report.method == "touch" and int(buffer.tensor[4096 * 3]) == 9
    buffer.free()


def test_prefault_enomem_is_host_out_of_memory(monkeypatch):
    """ENOMEM from MADV_POPULATE_WRITE becomes HostOutOfMemoryError, not the OOM killer."""
    import errno

    from hicache.effects import _host_memory

    monkeypatch.setattr(_host_memory, "_madvise", _failing_madvise(errno.ENOMEM))
    buffer = allocate_host(2 * 2**20)
    with pytest.raises(HostOutOfMemoryError, match="out of memory"):
        prefault(buffer, threads=1)
    buffer.free()
