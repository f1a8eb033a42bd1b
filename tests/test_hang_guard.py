"""Every test has a hang guard (issue #54): pytest-timeout is configured for the whole suite, and
a test that hangs past it fails with its stack printed instead of stalling the run; a test that
takes its worker process down fails instead of stalling the parallel run."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import pytest


def test_the_suite_gives_every_test_a_timeout(pytestconfig):
    """The suite's configuration sets one timeout for every test (pyproject.toml), and the plugin
    that enforces it is loaded."""
    assert pytestconfig.pluginmanager.hasplugin("timeout")
    assert float(pytestconfig.getini("timeout")) == 240


@pytest.mark.concurrency
def test_a_hung_test_fails_at_its_timeout_and_the_run_goes_on(tmp_path):
    """A test waiting on an event nobody sets (a lock never let go) fails at the timeout with
    its stack shown, and the next test still runs - under this suite's own configuration."""
    (tmp_path / "test_hangs.py").write_text(textwrap.dedent("""
        import threading

        def test_waits_for_ever():
            threading.Event().wait()

        def test_after():
            assert True
    """))
    result = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-o", "timeout=2",
                             "-o", "addopts=", str(tmp_path)], capture_output=True, text=True, timeout=120)
    assert result.returncode == 1, result.stdout + result.stderr
    assert "Timeout" in result.stdout and "1 failed, 1 passed" in result.stdout, result.stdout


@pytest.mark.concurrency
def test_a_test_that_takes_its_worker_down_fails_and_the_run_ends(tmp_path):
    """A test that ends its worker process (as a C helper's bad access would) is reported failed,
    every other test still runs once, and the run ends - under the suite's own scheduler
    (tests/worker_groups.py), where xdist 3.8's load-by-scope requeued the crashed worker's
    finished tests and the run hung at its end."""
    (tmp_path / "conftest.py").write_text(textwrap.dedent(f"""
        import sys
        sys.path.insert(0, {str(Path(__file__).parent)!r})

        def pytest_xdist_make_scheduler(config, log):
            from worker_groups import scheduler
            return scheduler(config, log)
    """))
    (tmp_path / "test_crashes.py").write_text(textwrap.dedent("""
        import os
        import pytest

        @pytest.mark.parametrize("i", range(30))
        def test_before(i):
            pass

        def test_ends_its_worker():
            os._exit(1)

        @pytest.mark.parametrize("i", range(30))
        def test_after(i):
            pass
    """))
    command = [sys.executable, "-m", "pytest", "-q", "-n", "2", "-p", "no:cacheprovider", "-o", "addopts=",
               str(tmp_path)]
    result = subprocess.run(command, capture_output=True, text=True, timeout=180, cwd=tmp_path)
    assert result.returncode == 1, result.stdout + result.stderr
    assert "1 failed, 60 passed" in result.stdout and "test_ends_its_worker" in result.stdout, result.stdout
