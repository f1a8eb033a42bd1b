"""The pools' two keyword-only doors from a test's loose pieces: ``doors(limits=..., machine=...,
progressive=True, pin_memory=False)`` -> ``{"host": HostSetup(...), "options": HostPoolOptions(...),
"pin_memory": False}`` - the host's pieces into a `HostSetup` (a pool's ``budget_lock`` is the
setup's ``lock``), hicache's settings into a `HostPoolOptions`, anything else passed on as is.
Test helpers that build many pools take their pieces this way; the library takes only the doors."""

from __future__ import annotations

import attrs

from hicache.effects import HostSetup
from hicache.pools import HostPoolOptions

HOST_PIECES = {"runtime": "runtime", "limits": "limits", "machine": "machine", "host_memory_bytes": "host_memory_bytes",
               "budget_lock": "lock", "ledger": "ledger", "copy_engine": "copy_engine"}


def doors(**pieces) -> dict:
    """The keywords a pool constructor takes for ``pieces`` (see the module charter)."""
    settings = {f.name for f in attrs.fields(HostPoolOptions)}
    host = {HOST_PIECES[name]: pieces.pop(name) for name in list(pieces) if name in HOST_PIECES}
    options = {name: pieces.pop(name) for name in list(pieces) if name in settings}
    if host:
        base = pieces.pop("host", None) or HostSetup()
        pieces["host"] = attrs.evolve(base, **host)
    if options:
        base = pieces.pop("options", None) or HostPoolOptions()
        pieces["options"] = attrs.evolve(base, **options)
    return pieces
