"""Child processes forked from one fork server (tests/fork_server.py) instead of started as
fresh interpreters: `ForkServer.spawn(argv, env=..., cwd=...)` takes what `subprocess.Popen` would
(``[sys.executable, SCRIPT | -m MODULE | -c CODE, *args]``) and returns a
`Forked`, which answers as a Popen does (pid, poll, wait, communicate, send_signal, kill,
returncode: an exit code, or minus the signal that ended it). The child's stdout and stderr go to
files that `communicate` reads once it has ended; `run` answers as `subprocess.run` does. The conftest's session fixture `fork_server`
starts one server per test process, on first use."""

from __future__ import annotations

import json
import os
import queue
import signal
import subprocess
import sys
import tempfile
import threading
from pathlib import Path

SERVER = Path(__file__).with_name("fork_server.py")


class ForkServer:
    def __init__(self) -> None:
        self.process = subprocess.Popen([sys.executable, str(SERVER)], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                        text=True, cwd=SERVER.parent.parent)
        self.outputs = Path(tempfile.mkdtemp(prefix="hicache-forked-"))
        self._events: dict[str, queue.Queue] = {}
        self._lock = threading.Lock()
        self._seq = 0
        self._ready = threading.Event()
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()
        if not self._ready.wait(600):  # a hang guard: torch's import on a loaded box
            raise AssertionError("hang guard: the fork server never said ready")

    def _queue(self, ident: str) -> queue.Queue:
        with self._lock:
            return self._events.setdefault(ident, queue.Queue())

    def _read(self) -> None:
        for line in self.process.stdout:
            words = line.split()
            if words == ["ready"]:
                self._ready.set()
            elif len(words) == 3:
                self._queue(words[0]).put((words[1], int(words[2])))
        with self._lock:
            queues = list(self._events.values())
        for waiting in queues:  # the server ended: nobody waits for ever
            waiting.put(("gone", 0))

    def spawn(self, argv, *, env=None, cwd=None, text: bool = True) -> "Forked":
        argv = [str(a) for a in argv]
        if argv[0] != sys.executable:
            raise ValueError(f"the fork server runs this interpreter's scripts, not {argv[0]!r}")
        flag = {"-m": "module", "-c": "code"}.get(argv[1])
        request = {flag: argv[2]} if flag else {"script": argv[1]}
        rest = argv[3:] if flag else argv[2:]
        with self._lock:
            self._seq += 1
            ident = f"c{self._seq}"
        out, err = self.outputs / f"{ident}.out", self.outputs / f"{ident}.err"
        out.touch()  # `output` may read them before the child has opened them
        err.touch()
        request.update(id=ident, argv=rest, env=dict(os.environ if env is None else env), stdout=str(out),
                       stderr=str(err), cwd=str(cwd or os.getcwd()))
        events = self._queue(ident)
        self.process.stdin.write(json.dumps(request) + "\n")
        self.process.stdin.flush()
        kind, pid = events.get(timeout=120)  # a hang guard
        if kind != "pid":
            raise AssertionError(f"the fork server did not fork {argv}: {kind}")
        return Forked(pid, events, out, err, text)

    def run(self, argv, *, env=None, cwd=None, timeout=None) -> subprocess.CompletedProcess:
        """As `subprocess.run(argv, capture_output=True, text=True, timeout=...)`: a child that
        outlives ``timeout`` is killed and TimeoutExpired raised."""
        child = self.spawn(argv, env=env, cwd=cwd)
        try:
            out, err = child.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            child.kill()
            child.wait()
            raise
        return subprocess.CompletedProcess(argv, child.returncode, out, err)

    def close(self) -> None:
        import shutil

        try:
            end_server(self.process, self._reader)  # the server kills what still runs and exits
        finally:
            shutil.rmtree(self.outputs, ignore_errors=True)


def end_server(process: subprocess.Popen, reader: threading.Thread) -> None:
    """End a server that exits when its stdin closes (this fork server, tests/store_child.py's
    zygote): close its stdin, wait (killed after a minute), and close its stdout once the
    thread reading it saw the end (closing it under a blocked read would wait forever)."""
    try:
        process.stdin.close()
    except OSError:
        pass
    try:
        process.wait(timeout=60)
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()
        reader.join(timeout=60)  # EOF once the server and its children are gone
        if not reader.is_alive():
            process.stdout.close()


class Forked:
    """One forked child, as `subprocess.Popen` answers for one."""

    def __init__(self, pid: int, events: queue.Queue, out: Path, err: Path, text: bool) -> None:
        self.pid, self._events, self._out, self._err, self._text = pid, events, out, err, text
        self.returncode = None

    def poll(self):
        if self.returncode is None:
            try:
                self._ended(self._events.get_nowait())
            except queue.Empty:
                pass
        return self.returncode

    def wait(self, timeout=None):
        if self.returncode is None:
            try:
                self._ended(self._events.get(timeout=timeout))
            except queue.Empty:
                raise subprocess.TimeoutExpired(f"forked {self.pid}", timeout) from None
        return self.returncode

    def _ended(self, event) -> None:
        kind, code = event
        if kind == "gone":
            raise AssertionError(f"the fork server ended before child {self.pid} did")
        self.returncode = code

    def communicate(self, input=None, timeout=None):
        """(stdout, stderr) once it has ended (``input`` is refused: its stdin is /dev/null)."""
        if input:
            raise ValueError("a forked child reads nothing: its stdin is /dev/null")
        self.wait(timeout)
        return self.output()

    def output(self):
        """(stdout, stderr) as written so far - it may still be running."""
        read = (lambda p: p.read_text(errors="replace")) if self._text else (lambda p: p.read_bytes())
        return read(self._out), read(self._err)

    def send_signal(self, number: int) -> None:
        if self.poll() is None:  # not to a child the server has reaped already
            os.kill(self.pid, number)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)
