"""A pool's bring-up under the server's own host-memory budget, where the server has one in force:
SGLang 0.5.23's `host_memory_budget_scope` (its auto-sizing, its tests) books every pool built
inside against one snapshot instead of a fresh sample of the machine, and SGLang's callers expect
a pool built there to be admitted by that snapshot - as SGLang's own pools are (through the
plug-in's admission hook, which also claims them on the host-wide lock until resident). Outside
one, hicache's host-wide budget decides in the bring-up, as everywhere else.
"""

from __future__ import annotations

import contextlib

from hicache.errors import CapacityError
from hicache.plan import format_gb


@contextlib.contextmanager
def server_budget(nbytes: int, owner: str, server):
    """Yields whether the bring-up of ``nbytes`` checks hicache's own budget (True: the server
    has none in force; ``server``: the pool's, `HostSetup.server`). Otherwise the bytes are booked against the server's budget first -
    `CapacityError` before any memory when they do not fit - and what the server keeps for the
    admitted request is settled when the bring-up returns or fails."""
    allowance = server.book_host_memory(nbytes)
    if allowance is None:
        yield True
        return
    if nbytes > allowance:
        raise CapacityError(f"host memory budget refused: {owner} needs {format_gb(nbytes)}; the {server.name} "
                            f"process's budget in force has {format_gb(allowance)} left (SGLang's "
                            "host_memory_budget_scope). Hint: lower the host pool size (--hicache-size / --hicache-ratio)")
    try:
        yield False
    except BaseException:
        server.host_memory_settled(nbytes, up=False)
        raise
    server.host_memory_settled(nbytes, up=True)
