"""The server process as the host pools see it (issue #34 item 3): the serving engine's own
chunk setting, its pipeline-parallel size sync, a storage back end's own allocator and the host
memory budget it has in force, asked of one object that comes with the pool's `HostSetup`
(``server``) - a null one where none does.

The pools never look the live server up themselves (no ``sys.modules`` read in pools/, which
once gave an import-order bug): ``hicache.compat`` knows the SGLang process, and its plug-in
registers with SGLang the pool classes of `hicache.pools.with_host`, whose default setup names a
`hicache.compat.sglang_process.SGLangProcess` (issue #55 item 3: no process-wide setting).
`serve_in` - the process-wide one the plug-in used before - stays as a deprecated shim for
outside callers. Imports nothing."""

from __future__ import annotations

import threading
import warnings


class NoServer:
    """Outside a server: no chunk setting of its own, sizes as computed, hicache's allocators."""

    name = "none"

    def chunk_limit_bytes(self) -> int | None:
        """The server's own per-call cap (None: it has none)."""
        return None

    def synced_size(self, size: int, host_size: float) -> int:
        """``size`` after the server's pipeline-parallel group agreed on it (unchanged here)."""
        return size

    def io_backend(self) -> str | None:
        """The io backend the server will pass to every transfer (None: not known before the
        first transfer names it)."""
        return None

    def storage_allocator(self, name: str):
        """The allocator the server gives storage back end ``name`` (None: hicache's default)."""
        return None

    def book_host_memory(self, nbytes: int) -> int | None:
        """Where the server has a host-memory budget in force for the pools built now: book
        ``nbytes`` against it (when they fit) and return what it allowed before; None where it
        has none (hicache's host-wide budget decides)."""
        return None

    def host_memory_settled(self, nbytes: int, *, up: bool) -> None:
        """A pool `book_host_memory` admitted is up (``up``) or failed: whatever the server keeps
        for an admitted request until it is resident can go."""


NO_SERVER = NoServer()
_LOCK = threading.Lock()
_current = NO_SERVER


def serve_in(server) -> object:
    """Deprecated (a shim kept for outside callers; CHANGELOG says when it goes): make ``server``
    (None: `NO_SERVER`) what every pool built from now on asks where neither its ``host=`` nor
    its class (`hicache.pools.with_host`) names one; returns the one before. A pool's server comes
    with its `HostSetup` instead: ``host=HostSetup(server=...)``, or the classes of `with_host`."""
    warnings.warn("hicache.pools.serve_in() is deprecated: give a pool host=HostSetup(server=...) or build it "
                  "from hicache.pools.with_host(cls, HostSetup(server=...))", DeprecationWarning, stacklevel=2)
    global _current
    with _LOCK:
        previous, _current = _current, NO_SERVER if server is None else server
    return previous


def server():
    """What `serve_in` handed in (deprecated with it): what a pool asks whose ``host=`` and class
    name no server."""
    return _current
