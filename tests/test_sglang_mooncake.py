"""A real distributed L3 between two serving instances (issue #24): Mooncake's own
`mooncake_master` on 127.0.0.1 (the non-CUDA wheel), and two processes, each SGLang 0.5.23's
host pool brought up by hicache's plug-in with SGLang's real `MooncakeStore` over it
(tests/sglang_instance.py). Instance A backs pages up from its device pool and stores them
zero-copy (SGLang's `get_page_buffer_meta` pointers into the pool hicache registered); instance B
fetches them into its pool and loads them into its device pool, byte for byte. Then the master
stops and neither instance holds anything registered.

Needs `make sglang` (SGLang's code and mooncake-transfer-engine-non-cuda, whose binaries need
Debian's libibverbs1/librdmacm1/libnuma1); skips naming it where absent, fails under
HICACHE_REQUIRE_SGLANG=1 (CI)."""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

# Not in `make test-loaded`: its two instances take strict turns (B looks up only after A said
# "stored"), so load changes how long it takes, never what it sees - and its four SGLang
# imports cost minutes on a loaded box.

INSTANCE = Path(__file__).with_name("sglang_instance.py")


def _need(what: str, why: str):
    if os.environ.get("HICACHE_REQUIRE_SGLANG") == "1":
        pytest.fail(f"{what} is required here (HICACHE_REQUIRE_SGLANG=1): {why}")
    pytest.skip(f"{what} is not installed: {why}")


def _master_binary() -> str:
    from hicache.effects import package_version

    if package_version("sglang") is None:
        _need("SGLang 0.5.23", "`make sglang` installs its real code for these tests")
    found = shutil.which("mooncake_master", path=os.path.dirname(sys.executable)) or shutil.which("mooncake_master")
    if package_version("mooncake-transfer-engine-non-cuda") is None or found is None:
        _need("Mooncake (mooncake-transfer-engine-non-cuda)", "`make sglang` installs it")
    try:
        from mooncake.store import MooncakeDistributedStore  # noqa: F401 - loads its native libraries
    except ImportError as error:
        _need("Mooncake's native libraries", f"apt-get install libibverbs1 librdmacm1 libnuma1 ({error})")
    return found


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def _wait_for_port(port: int, process, log: Path, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise AssertionError(f"mooncake_master exited with {process.returncode}: {log.read_text()[-4000:]}")
        try:
            socket.create_connection(("127.0.0.1", port), timeout=0.2).close()
            return
        except OSError:
            time.sleep(0.1)
    raise AssertionError(f"mooncake_master did not listen on 127.0.0.1:{port} within {timeout} s")


@pytest.fixture
def master(tmp_path):
    """Mooncake's master on 127.0.0.1 with its HTTP metadata server: (rpc port, metadata port,
    the process); its log goes to a file (a pipe nobody reads could stall it)."""
    binary = _master_binary()
    rpc, metadata, metrics = _free_port(), _free_port(), _free_port()
    log = tmp_path / "mooncake_master.log"
    with log.open("w") as sink:
        process = subprocess.Popen(
            [binary, f"--rpc_port={rpc}", "--rpc_address=127.0.0.1", "--enable_http_metadata_server=true",
             "--http_metadata_server_host=127.0.0.1", f"--http_metadata_server_port={metadata}",
             f"--metrics_port={metrics}"],
            stdout=sink, stderr=subprocess.STDOUT,
        )
    try:
        _wait_for_port(rpc, process, log)
        _wait_for_port(metadata, process, log)
        yield rpc, metadata, process
    finally:
        if process.poll() is None:
            process.terminate()
            try:
                process.wait(10)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()


def _instance(name: str, rpc: int, metadata: int, seed: int, pages: int, logs: Path, pools: str):
    env = dict(os.environ, PYTHONWARNINGS="ignore", GLOG_minloglevel="2")
    env.pop("HICACHE_SGLANG_POOLS", None)
    if pools == "hicache":  # the plug-in's class REPLACE: SGLang's assembler builds hicache's pool
        env["HICACHE_SGLANG_POOLS"] = "1"
    log = logs / f"{name}.log"  # Mooncake's client logs to stderr: a file, never a full pipe
    with log.open("w") as sink:
        process = subprocess.Popen(
            [sys.executable, str(INSTANCE), str(rpc), str(metadata), str(seed), str(pages)],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=sink, text=True, env=env,
        )
    process.log = log
    return process


def _said(process, word: str) -> None:
    said = process.stdout.readline()
    if said.strip() != word:
        _report(process)  # names why it failed
        raise AssertionError(f"the instance said {said!r}, not {word!r}")


def _let_go(process) -> None:
    """Close the instance's stdin, which lets it finish: it drops its Mooncake segment, destroys
    its pool and exits (Mooncake's client takes seconds to leave)."""
    if process.stdin is not None and not process.stdin.closed:
        process.stdin.close()
    process.stdin = None  # communicate() then only reads what is left


def _report(process, timeout: float = 240.0) -> dict:
    _let_go(process)
    out, _ = process.communicate(timeout=timeout)
    lines = [line for line in out.splitlines() if line.startswith("{")]
    assert process.returncode == 0 and lines, (
        f"instance failed ({process.returncode}):\n{out}\n{process.log.read_text()[-4000:]}")
    return json.loads(lines[-1])


def test_two_instances_share_pages_each_way_through_sglangs_mooncake_store_byte_exact(master, tmp_path):
    """One instance with SGLang's own pool (hicache's registration under it), the other with
    hicache's pool (HICACHE_SGLANG_POOLS=1): each stores its pages in Mooncake, then fetches the
    other's byte for byte - SGLang's pool reads what hicache's stored and hicache's what
    SGLang's stored: servers on SGLang's pools and on hicache's share a store."""
    rpc, metadata, master_process = master
    pages = 8
    instances = {"sglang": (7, _instance("sglang", rpc, metadata, 7, pages, tmp_path, "sglang")),
                 "hicache": (8, _instance("hicache", rpc, metadata, 8, pages, tmp_path, "hicache"))}
    try:
        for _, process in instances.values():
            _said(process, "stored")  # both stored: each may now fetch the other's
        for (_, process), (other, _) in zip(instances.values(), reversed(list(instances.values()))):
            process.stdin.write(f"fetch {other}\n")
            process.stdin.flush()
        for _, process in instances.values():
            _said(process, "fetched")
        for _, process in instances.values():  # both fetched: their segments may go now, and their
            _let_go(process)                     # exits (seconds of Mooncake's teardown each) overlap
        reports = {pools: _report(process) for pools, (_, process) in instances.items()}
    except BaseException:
        for _, process in instances.values():
            process.kill()
            process.communicate()
        raise
    for pools, report in reports.items():
        assert report["plugged"], "SGLang's load_plugins() did not put hicache in"
        assert report["pool"][:2] == ["MHATokenToKVPoolHost", "page_first_direct"]
        assert report["pool"][3] == pools, report["pool"]
        assert report["pool"][2] == "MooncakeHostTensorAllocator"  # the back end's memory, hicache's registration
        assert report["ranges_exact"], "the ranges SGLang records are not what was registered"
        assert report["held_after_destroy"] == []
        assert report["stored"] == [True] * pages
        assert report["exists"] == pages and report["missing_is_a_miss"]
        assert report["fetched"] == [True] * pages
        assert report["byte_exact"], pools
    master_process.terminate()  # the master outlived both clients and stops when told
    assert master_process.wait(10) is not None
