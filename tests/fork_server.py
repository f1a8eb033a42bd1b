"""A fork server for the suite's child scripts (tests/rank_child.py, fill_child.py,
turnstile_child.py, `python -m hicache`): imports torch, psutil and hicache once, then forks one
process per request it reads on stdin and runs the script there as ``__main__`` - what
``python SCRIPT ARGS`` (``-m MODULE``, ``-c CODE``) would do, without paying an interpreter and torch's import for each
(seconds each on a loaded 2-core box, where CI runs these tests again beside six busy processes).

    python fork_server.py
    stdin:  {"id": "a", "script": PATH | "module": NAME | "code": TEXT, "argv": [...], "env": {...},
             "cwd": PATH, "stdout": PATH, "stderr": PATH}          one JSON request per line
    stdout: "ready" once; "<id> pid <pid>" once forked; "<id> exit <status>" once it ended
            (its exit code, or minus the signal that killed it, as subprocess reports it)

The child gets exactly ``env`` as its environment, /dev/null as stdin, the two files as stdout and
stderr, default signal handling (SIGINT raises KeyboardInterrupt, as in a fresh interpreter), and
a fresh random state. The server is single-threaded (no thread's lock is ever copied into a
child), forks before any torch operation ran (no thread pools to inherit), reaps its children
and, when its stdin closes, SIGKILLs the ones still running and exits.
"""

from __future__ import annotations

import json
import os
import select
import signal
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)  # the scripts import each other (fill_child imports rank_child)


def main() -> None:
    import psutil  # noqa: F401 - imported once here, for every child
    import torch  # noqa: F401

    import hicache.cli  # noqa: F401
    import hicache.effects  # noqa: F401
    import hicache.pools  # noqa: F401
    import hicache.testing  # noqa: F401

    children: dict[int, str] = {}
    pending = b""
    _line("ready")
    while True:
        readable, _, _ = select.select([0], [], [], 0.02)
        _reap(children)
        if not readable:
            continue
        data = os.read(0, 65536)
        if not data:
            break
        pending += data
        while b"\n" in pending:
            line, pending = pending.split(b"\n", 1)
            request = json.loads(line)
            pid = os.fork()
            if pid == 0:
                _run(request)  # never returns
            children[pid] = request["id"]
            _line(f"{request['id']} pid {pid}")
    for pid in list(children):
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    while children:
        _reap(children, block=True)


def _reap(children: dict, block: bool = False) -> None:
    while children:
        try:
            pid, status = os.waitpid(-1, 0 if block else os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return
        code = -os.WTERMSIG(status) if os.WIFSIGNALED(status) else os.WEXITSTATUS(status)
        _line(f"{children.pop(pid, '?')} exit {code}")
        if block:
            return


def _run(request: dict) -> None:
    """In the child: become ``python SCRIPT ARGV`` (``-m MODULE``, ``-c CODE``) and exit as it would."""
    import random
    import runpy
    import traceback

    code = 1
    try:
        null = os.open(os.devnull, os.O_RDONLY)
        os.dup2(null, 0)
        for fd, path in ((1, request["stdout"]), (2, request["stderr"])):
            out = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
            os.dup2(out, fd)
            os.close(out)
        os.close(null)
        for number in (signal.SIGTERM, signal.SIGCHLD, signal.SIGHUP):
            signal.signal(number, signal.SIG_DFL)
        signal.signal(signal.SIGINT, signal.default_int_handler)
        os.environ.clear()
        os.environ.update(request["env"])
        os.chdir(request["cwd"])
        random.seed()
        target = request.get("script") or request.get("module") or "-c"
        sys.argv = [target, *request["argv"]]
        try:
            if request.get("script"):
                runpy.run_path(target, run_name="__main__")
            elif request.get("module"):
                runpy.run_module(target, run_name="__main__", alter_sys=True)
            else:
                exec(compile(request["code"], "<string>", "exec"), {"__name__": "__main__", "__builtins__": __builtins__})
            code = 0
        except SystemExit as done:
            code = done.code if isinstance(done.code, int) else (0 if done.code is None else 1)
            if done.code is not None and not isinstance(done.code, int):
                print(done.code, file=sys.stderr)
        except KeyboardInterrupt:  # as a fresh interpreter ends on it: killed by SIGINT
            traceback.print_exc()
            code = -signal.SIGINT
        except BaseException:
            traceback.print_exc()
            code = 1
        _shut_down()
    finally:
        if code < 0:
            signal.signal(-code, signal.SIG_DFL)
            os.kill(os.getpid(), -code)
        os._exit(code)


def _shut_down() -> None:
    """What an interpreter does at its end: join the non-daemon threads, run atexit, flush."""
    import atexit
    import threading

    try:
        threading._shutdown()
        atexit._run_exitfuncs()
    finally:
        sys.stdout.flush()
        sys.stderr.flush()


def _line(text: str) -> None:
    """One line to stdout in one write(2) of at most PIPE_BUF bytes (kept whole on the pipe)."""
    data = (text + "\n").encode()
    assert len(data) <= select.PIPE_BUF, f"a line of {len(data)} bytes would not be written whole"
    os.write(1, data)


if __name__ == "__main__":
    main()
