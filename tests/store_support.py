"""Shared set-up for the node store's tests: a private directory on the machine's real tmpfs
(/dev/shm), removed after the test; small arenas (a container's /dev/shm may be 64 MB); a fake
machine root whose mountinfo and sysfs say what a test needs (disk, hugetlbfs, free hugepages)
while statvfs still reads the real directory."""

from __future__ import annotations

import shutil
import tempfile
from pathlib import Path

import pytest

ARENA_BYTES = 8 << 20


@pytest.fixture
def shm_dir():
    path = Path(tempfile.mkdtemp(prefix="hicache-test-", dir="/dev/shm"))
    try:
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)


def fake_root(tmp_path: Path, directory: Path, fstype: str, options: str = "rw", *, free_hugepages=None,
              hugepage_kb: int = 2048) -> str:
    """A machine root whose /proc/self/mountinfo mounts ``directory`` as ``fstype`` with super
    options ``options`` (and / as ext4), and whose sysfs has ``free_hugepages`` of that size."""
    root = tmp_path / "root"
    (root / "proc/self").mkdir(parents=True)
    (root / "proc/self/mountinfo").write_text(
        "1 0 8:1 / / rw,relatime - ext4 /dev/vda rw\n"
        f"2 1 0:5 / {directory} rw,nosuid - {fstype} {fstype} {options}\n"
    )
    if free_hugepages is not None:
        pages = root / f"sys/kernel/mm/hugepages/hugepages-{hugepage_kb}kB"
        pages.mkdir(parents=True)
        (pages / "nr_hugepages").write_text(f"{free_hugepages}\n")
        (pages / "free_hugepages").write_text(f"{free_hugepages}\n")
    return str(root)
