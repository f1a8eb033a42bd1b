"""A real `hicache apply --fake-cuda` (or `hicache store create`) process that sends itself a
signal at one phase of its work, for tests/test_sigterm.py.

``python signal_child.py PHASE SIGNAL REPORT -- ARGV...``: runs ``hicache ARGV`` with a hook that
calls ``os.kill(os.getpid(), SIGNAL)`` once, when PHASE is reached - as `timeout`, systemd or
Kubernetes would send it, but at a known point instead of a guessed time. On the way out it
writes REPORT (JSON: the phase reached, what the fake driver still holds, its call counts)
and exits with hicache's exit code.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import sys


def main() -> int:
    phase, signame, report = sys.argv[1:4]
    argv = sys.argv[sys.argv.index("--") + 1:]
    signum = getattr(signal, signame)
    reached: list[str] = []

    def stop() -> None:
        if not reached:
            reached.append(phase)
            os.kill(os.getpid(), signum)

    def after(owner, name: str, when=lambda *a, **k: True) -> None:
        """``owner.name`` calls the original, then `stop` where ``when`` says so."""
        original = getattr(owner, name)

        def hooked(*args, **kwargs):
            result = original(*args, **kwargs)
            if when(*args, **kwargs):
                stop()
            return result

        setattr(owner, name, hooked)

    import hicache.testing as testing

    fakes = []
    real_fake_cuda = testing.fake_cuda

    @contextlib.contextmanager
    def recorded_fake_cuda(**faults):  # what apply --fake-cuda opens, kept for the report
        with real_fake_cuda(**faults) as fake:
            fakes.append(fake)
            yield fake

    testing.fake_cuda = recorded_fake_cuda
    if phase == "probe":  # the CUDA probe: before any memory
        import hicache.effects as effects

        after(effects, "probe_cuda")
    elif phase == "budget":  # the claim just written under the host-wide lock
        from hicache.effects import BudgetLock

        after(BudgetLock, "record")
    elif phase == "prefault":  # a pre-fault piece done (from a faulting thread)
        from hicache.cli._progress import BringupProgress

        after(BringupProgress, "__call__", lambda self, event: not hasattr(event, "chunk_index"))
    elif phase == "register":  # the second register call made, more to come
        after(testing.FakeCudart, "cudaHostRegister", lambda self, *a: self.register_calls == 2)
    elif phase == "hold":  # holding the registration (--hold inf)
        import hicache.cli._apply as apply

        original = apply._hold_for

        def hold(seconds, total):
            stop()
            return original(seconds, total)

        apply._hold_for = hold
    elif phase == "release":  # the first unregister call made, more to come
        after(testing.FakeCudart, "cudaHostUnregister", lambda self, *a: self.unregister_calls == 1)
    elif phase == "store-prefault":  # hicache store create, a pre-fault progress line
        import hicache.cli._store as store

        after(store._Progress, "__call__")
    else:
        raise SystemExit(f"unknown phase {phase!r}")

    from hicache.cli._main import main as hicache

    code = hicache(argv)
    with open(report, "w") as handle:
        json.dump({"code": code, "reached": reached, "held": [sorted(f.held()) for f in fakes],
                   "registers": sum(f.cudart.register_calls for f in fakes),
                   "unregisters": sum(f.cudart.unregister_calls for f in fakes)}, handle)
    return code


if __name__ == "__main__":
    sys.exit(main())
