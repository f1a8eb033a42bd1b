"""`PoolOptions`: how a host pool is brought up, apart from what it is (issue #34 items 1 and 5).

A constructor call's keywords part into a `Sizing` (what SGLang's arguments say of the pool's
size: `_geometry`) and these options - SGLang's own (``pin_memory``, ``device``,
``allocator_type``, ``pool_label``, ``is_dummy``) and hicache's keyword-only ones (the host's
pieces and the bring-up's settings, documented on `HostKVCache`). One table of the names, so a
misspelt keyword is Python's TypeError naming the pool and the word. Pure data: no import
beyond attrs and the geometry's `Sizing`.
"""

from __future__ import annotations

import attrs

from hicache.effects import HostSetup
from hicache.pools._geometry import Sizing

#: the `Sizing` fields a constructor may take by keyword (the rest are its positional arguments)
SIZING_KEYWORDS = ("page_num", "device_capacity_tokens", "start_layer", "end_layer", "host_token_capacity",
                   "dcp_size", "dcp_rank")


@attrs.frozen(kw_only=True)
class PoolOptions:
    """SGLang's options of a host pool and hicache's keyword-only ones (see `HostKVCache`)."""

    pin_memory: bool = True
    device: str = "cpu"
    allocator_type: str | None = "default"
    pool_label: str = "kv"
    is_dummy: bool = False
    strict_allocator: bool = False
    allocator_fallback: str | None = None
    # the host's pieces (None: probed, or the process's own): one HostSetup, or a keyword each
    host: HostSetup | None = None
    runtime: object = None
    limits: object = None
    machine: object = None
    host_memory_bytes: int | None = None
    budget_lock: object = None
    ledger: object = None
    copy_engine: object = None
    # the bring-up's settings
    numa_node: object = "auto"
    progressive: bool | None = None
    max_stall_s: float | None = 0.25
    hugepages: str | None = None


    def host_setup(self, owner: str) -> HostSetup:
        """The pool's `HostSetup`: ``host`` with the pieces given by keyword applied (a piece
        given both ways is a TypeError naming it); the device the bring-up pins for is the pool's."""
        pieces = {name: getattr(self, name) for name in _PIECES if getattr(self, name) is not None}
        pieces = {_PIECES[name]: value for name, value in pieces.items()}
        host = self.host if self.host is not None else HostSetup()
        clashes = [name for name in pieces if getattr(host, name) is not None]
        if self.host is not None and clashes:
            raise TypeError(f"{owner}() got {clashes[0]!r} both in host= and as a keyword")
        return attrs.evolve(host, **pieces)


#: the keywords that are pieces of the pool's HostSetup (the pool's name -> the setup's)
_PIECES = {"runtime": "runtime", "limits": "limits", "machine": "machine", "host_memory_bytes": "host_memory_bytes",
           "budget_lock": "lock", "ledger": "ledger", "copy_engine": "copy_engine"}
_OPTION_NAMES = frozenset(field.name for field in attrs.fields(PoolOptions))


def split_keywords(owner: str, keywords: dict, **sizing) -> tuple[Sizing, PoolOptions]:
    """``keywords`` (a constructor's ``**kwargs`` plus its named options) as a `Sizing` (with
    ``sizing``: the positional facts) and `PoolOptions`; an unknown name is a TypeError."""
    for name in keywords:
        if name not in _OPTION_NAMES and name not in SIZING_KEYWORDS:
            raise TypeError(f"{owner}() got an unexpected keyword argument {name!r}")
    given = {name: keywords[name] for name in SIZING_KEYWORDS if name in keywords}
    sized = Sizing(**{**given, **sizing})  # the form's own facts win over a keyword
    return sized, PoolOptions(**{name: value for name, value in keywords.items() if name in _OPTION_NAMES})
