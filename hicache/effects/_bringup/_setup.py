"""`HostSetup`: the host's pieces a bring-up uses, as one value (issue #34 item 5).

A bring-up needs a runtime (the CUDA calls), the machine's facts and limits, the host-wide budget
lock and the room it grants (a stated host figure, ranks, the reserve), the ledger of what this
process holds, the registration turnstile, a copy engine and the allocator the memory comes from. They travel together: pools,
`hicache apply` and the SGLang seam hand one `HostSetup` to `bring_up(host=)` instead of one
keyword each, so a new piece adds a field here, not a keyword to every signature. ``None``
means "the process's own" (probed, or the default) when the bring-up runs; `HostSetup.probe()`
fills them now, `hicache.testing.fake_host_setup()` builds one with nothing of the machine's.
"""

from __future__ import annotations

import attrs

from hicache.errors import PlanError
from hicache.plan import DEFAULT_RESERVE_BYTES
from hicache.plan.checks import as_int, check_int


def _figure(minimum: int):
    """attrs validator of a budget figure: an integer >= ``minimum`` (None: unset, except the
    reserve); with `as_int` as converter, numpy integers arrive as plain ints."""
    def check(setup, attribute, value) -> None:
        if value is not None or attribute.name == "reserve_bytes":
            check_int(PlanError, "HostSetup", attribute.name, value, minimum=minimum)
    return check


@attrs.frozen(kw_only=True)
class HostSetup:
    """The host's pieces: ``runtime`` (a `HostRuntime`; None: `default_runtime()`), ``machine``
    (`MachineFacts`; None: `probe_machine()` at the budget check), ``limits`` (`Limits`; None:
    `probe_limits()`), ``lock`` (a `BudgetLock`; None: `budget_lock()`), ``ledger`` (a
    `HostLedger`; None: the process's), ``turnstile`` (``"auto"``: HICACHE_PIN_CONCURRENCY's;
    None: off; a `Turnstile`), ``copy_engine`` (a `CopyEngine`; None: one with the probed host
    copy mode), and the budget's figures: ``host_memory_bytes`` (a stated figure instead of the
    machine's available memory), ``ranks_per_host`` (instead of the machine's), ``reserve_bytes``
    (left to the OS). Where the buffers' memory comes from: ``allocator`` (a `HostAllocator`, or
    any object with SGLang's ``allocate(dims, dtype, device)``; None: a new `HostTensorAllocator()`;
    a pool's is its own ``allocator_type``'s), ``device`` (where it places them, ``"cpu"``) and
    ``owns_memory`` (False: the tensors' owner frees the memory, after a failed bring-up too).
    ``server``: the serving process a host pool asks - its own chunk setting,
    io backend, pipeline-parallel size sync, storage allocators and host-memory budget scope
    (`hicache.pools.NoServer`'s questions; the bring-up itself never asks it); None: the pool
    class's (`hicache.pools.with_host`: the plug-in's, SGLang's process), else none."""

    runtime: object = None
    machine: object = None
    limits: object = None
    lock: object = None
    ledger: object = None
    turnstile: object = "auto"
    copy_engine: object = None
    host_memory_bytes: int | None = attrs.field(default=None, converter=as_int, validator=_figure(1))
    ranks_per_host: int | None = attrs.field(default=None, converter=as_int, validator=_figure(1))
    reserve_bytes: int = attrs.field(default=DEFAULT_RESERVE_BYTES, converter=as_int, validator=_figure(0))
    allocator: object = None
    device: str = "cpu"
    owns_memory: bool = True
    server: object = None

    @classmethod
    def probe(cls, **given) -> "HostSetup":
        """A setup with every piece not ``given`` made now: the default runtime, the machine's
        facts and limits, the host-wide budget lock, a copy engine (the ledger stays the
        process's, the turnstile ``"auto"``, the allocator None: a new `HostTensorAllocator` per
        bring-up, as a handle frees what its allocator holds)."""
        from hicache.effects._copy._engine import CopyEngine
        from hicache.effects._cuda._runtime import default_runtime
        from hicache.effects._host._probes import probe_limits, probe_machine
        from hicache.effects._hostwide._lock import budget_lock

        setup = cls(**given)
        made = {"runtime": default_runtime, "machine": probe_machine, "limits": probe_limits, "lock": budget_lock,
                "copy_engine": CopyEngine}
        return attrs.evolve(setup, **{name: make() for name, make in made.items() if getattr(setup, name) is None})
