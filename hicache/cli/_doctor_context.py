"""`hicache doctor`'s vocabulary: a `Check` (one finding) and the `Context` every rule reads."""

from __future__ import annotations


import attrs



@attrs.frozen
class Check:
    """One doctor finding."""

    name: str
    status: str  # pass | warn | fail
    finding: str
    hint: str = ""


@attrs.frozen
class Context:
    """Everything the rules read."""

    plan: object
    facts: object
    resolved: object  # ResolvedLimits of this machine, or an EnvError
    env: object
    cuda_binding: object
    total: int
    calls: int
    largest: int
    ranks: int
    limits: object  # the plan's Limits, or None
    root: str = "/"
    store: str | None = None  # a node store arena to check (--store)
