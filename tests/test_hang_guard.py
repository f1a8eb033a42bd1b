"""Every test has a hang guard (issue #54): pytest-timeout is configured for the whole suite, and
a test that hangs past it fails with its stack printed instead of stalling the run."""

from __future__ import annotations

import subprocess
import sys
import textwrap

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
