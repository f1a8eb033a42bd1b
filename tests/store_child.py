"""A zygote for the multi-process tests of the node store and of SGLang's ranks: imports hicache's
store and torch (with
``--sglang``, SGLang 0.5.23's real modules on CPU too) once, then forks one fresh process per
task it reads on stdin, so a test can run many processes - and kill -9 them - without paying an
interpreter and SGLang's imports for each (seconds each on a busy box).

    python store_child.py [--sglang]
    stdin:  {"id": "a", "role": "writer", "args": {...}}   one JSON task per line
    stdout: "<id> pid <pid>" once forked, "<id> <event words>" as the role says them, and
            "<id> done <json>" (or "<id> error <traceback as JSON>") when it returns

Roles are the functions in ROLES (tests/store_roles.py); a role gets ``say(words)`` to report
events, which tests wait for (barriers by message, never by time). The zygote forks before any
torch operation ran (no thread pools to inherit) and exits when its stdin closes.
"""

from __future__ import annotations

import json
import os
import select
import signal
import sys
import traceback
import warnings

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))


def main() -> None:
    if "--sglang" in sys.argv:
        from hicache.testing import sglang_on_cpu

        sglang_on_cpu()
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            import importlib

            for name in ("sglang.srt.mem_cache.memory_pool", "sglang.srt.mem_cache.pool_host.mha",
                         "sglang.srt.mem_cache.pool_host.mla", "sglang.srt.mem_cache.hicache_storage",
                         "sglang.srt.mem_cache.storage.backend_factory", "sglang.srt.managers.cache_controller",
                         "sglang.srt.mem_cache.hybrid_cache.hybrid_cache_controller",
                         "sglang.srt.mem_cache.hybrid_cache.hybrid_pool_assembler", "sglang.srt.server_args",
                         "sglang.srt.runtime_context", "sglang.srt.plugins", "sglang.srt.mem_cache.allocator.paged",
                         "sglang.srt.mem_cache.base_prefix_cache", "sglang.srt.mem_cache.pool_host",
                         "sglang.srt.mem_cache.utils", "sglang.srt.observability.metrics_collector",
                         "hicache.compat.sglang_store", "hicache.compat.sglang_plugin"):
                importlib.import_module(name)
    import torch  # noqa: F401 - imported once here, for every task

    import store_roles
    import hicache.store  # noqa: F401

    signal.signal(signal.SIGCHLD, signal.SIG_IGN)  # forked tasks are reaped by the kernel
    _line("ready")
    for line in sys.stdin:
        task = json.loads(line)
        pid = os.fork()
        if pid:
            _line(f"{task['id']} pid {pid}")
            continue
        signal.signal(signal.SIGCHLD, signal.SIG_DFL)

        def say(*words, _id=task["id"]) -> None:
            _line(" ".join([_id, *map(str, words)]))

        code = 0
        try:
            result = store_roles.ROLES[task["role"]](say=say, **task.get("args", {}))
            say("done", json.dumps(result))
        except BaseException:  # the test reads what went wrong (the end of it: a line fits a pipe's atomic write)
            say("error", json.dumps(traceback.format_exc()[-3000:]))
            code = 1
        finally:
            os._exit(code)


def _line(text: str) -> None:
    """One line to stdout in one write(2) of at most PIPE_BUF bytes, which POSIX keeps whole
    beside the other processes' lines on the same pipe (print() writes the text and the newline
    apart when Python runs unbuffered, and a task's line then landed inside the zygote's)."""
    data = (text + "\n").encode()
    assert len(data) <= select.PIPE_BUF, f"a line of {len(data)} bytes would not be written whole"
    os.write(1, data)


if __name__ == "__main__":
    main()
