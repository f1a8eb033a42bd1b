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
    # the host's pieces (None: probed, or the process's own)
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
