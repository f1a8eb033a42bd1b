"""The suite's fork server (tests/forked.py, tests/fork_server.py) answers as `subprocess`
does for the child scripts it stands in for: exit codes, the signal that ended a child, the
environment and working directory given, the output written, a timeout."""

from __future__ import annotations

import signal
import subprocess
import sys

import pytest

pytestmark = pytest.mark.concurrency  # forked processes and signals


def test_a_child_gets_exactly_the_environment_argv_and_directory_given(fork_server, tmp_path):
    """argv after -c, only the environment passed (none of the server's own), the cwd given,
    stdout and stderr apart; exit code 0."""
    code = "import os, sys; print(sys.argv[1:], os.environ.get('ONLY'), os.environ.get('HOME')); " \
           "print(os.getcwd(), file=sys.stderr)"
    result = fork_server.run([sys.executable, "-c", code, "a", "b"], env={"ONLY": "yes"}, cwd=tmp_path, timeout=60)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "['a', 'b'] yes None"
    assert result.stderr.strip() == str(tmp_path)


@pytest.mark.parametrize("body, code", [("raise SystemExit(3)", 3), ("raise ValueError('no')", 1),
                                        ("import sys; sys.exit('bad')", 1), ("pass", 0)])
def test_exit_codes_are_what_a_fresh_interpreter_exits_with(fork_server, body, code):
    """SystemExit's code, 1 for an uncaught exception (its traceback on stderr) and for a
    SystemExit with a message (on stderr), 0 at the end."""
    result = fork_server.run([sys.executable, "-c", body], timeout=60)
    assert result.returncode == code, result.stderr
    if code == 1:
        assert ("ValueError: no" in result.stderr) or ("bad" in result.stderr)


def test_a_signal_ends_a_child_as_subprocess_reports_it(fork_server):
    """SIGKILL: -9; SIGINT (default handling: KeyboardInterrupt uncaught): -2, as for a fresh
    interpreter; a child still running answers poll() with None and wait(timeout) with
    TimeoutExpired."""
    looping = "import time\nprint('up', flush=True)\nwhile True: time.sleep(0.01)\n"
    for number, expected in ((signal.SIGKILL, -9), (signal.SIGINT, -2)):
        child = fork_server.spawn([sys.executable, "-c", looping])
        while "up" not in child.output()[0]:  # a hang guard below: wait()
            assert child.poll() is None, child.communicate()
        with pytest.raises(subprocess.TimeoutExpired):
            child.wait(timeout=0.05)
        child.send_signal(number)
        assert child.wait(timeout=60) == expected
        if number == signal.SIGINT:
            assert "KeyboardInterrupt" in child.communicate()[1]


def test_a_timeout_kills_the_child_and_raises(fork_server):
    """`run` with a timeout the child outlives: TimeoutExpired, and the child is gone."""
    with pytest.raises(subprocess.TimeoutExpired):
        fork_server.run([sys.executable, "-c", "import time; time.sleep(600)"], timeout=0.2)


def test_only_this_interpreter_is_forked(fork_server):
    """Another program is refused, named: the server runs Python scripts of this interpreter."""
    with pytest.raises(ValueError, match="'/bin/true'"):
        fork_server.spawn(["/bin/true"])
