"""`PoolOptions`: how a host pool is brought up, apart from what it is (issue #34 items 1 and 5).

A constructor call's keywords part into a `Sizing` (what SGLang's arguments say of the pool's
size: `_geometry`) and these options - SGLang's own (``pin_memory``, ``device``,
``allocator_type``, ``pool_label``, ``is_dummy``) and hicache's two keyword-only values: its
settings (``options=``, a `HostPoolOptions`) and the host's pieces (``host=``, a `HostSetup`) -
one door each (issue #55 item 2). One table of the names, so a
misspelt keyword is Python's TypeError naming the pool and the word. Also what the options say
of the pool's host: its `HostSetup` resolved (``host=``, else its class's: `with_host`), the
server's chunk setting over its limits, ``is_dummy`` against its form. No effect of its own:
imports attrs, the effects' `HostSetup` value, errors and the geometry's `Sizing`.
"""

from __future__ import annotations

import attrs

from hicache.effects import HostSetup
from hicache.errors import LayoutError, PlanError
from hicache.plan.checks import check_bool
from hicache.pools._geometry import Sizing
from hicache.pools._server import server

#: the `Sizing` fields a constructor may take by keyword (the rest are its positional arguments)
SIZING_KEYWORDS = ("page_num", "device_capacity_tokens", "start_layer", "end_layer", "host_token_capacity",
                   "dcp_size", "dcp_rank")


@attrs.frozen(kw_only=True)
class HostPoolOptions:
    """hicache's settings of a host pool's bring-up, one value (a pool constructor's keyword-only
    ``options=``; the host's pieces are its ``host=``, a `HostSetup`): ``strict_allocator`` (an
    unknown ``allocator_type`` is an error), ``allocator_fallback`` (an allocator type for unknown
    ones), ``numa_node`` (``"auto"``: the current GPU's node where there are several; ``"off"``;
    N), ``progressive`` (return once the first page of every buffer is registered and register
    the rest in the background; None: ``HICACHE_PROGRESSIVE``, else False), ``max_stall_s``
    (progressive: no call holds the driver longer, by the measured rate; None: one call per
    planned chunk), ``hugepages`` (``"auto"``, ``"off"``, ``"thp"``, ``"prefer"``,
    ``"required"``; None: ``HICACHE_HUGEPAGES``, else ``"auto"``)."""

    strict_allocator: bool = False
    allocator_fallback: str | None = None
    numa_node: object = "auto"
    progressive: bool | None = None
    max_stall_s: float | None = 0.25
    hugepages: str | None = None


def _host_device(device) -> str:
    """A host pool's ``device=`` as its one accepted value, "cpu" (a `torch.device` too): the
    pool's memory is host memory - the GPU's pages are the device pool's. SGLang 0.5.23's call
    sites always pass "cpu"; its own pool takes any device and would register GPU memory as host
    memory. A `PlanError` naming the value, before any memory."""
    if str(device) != "cpu":
        raise PlanError(f"device must be 'cpu' - a host pool's memory is host memory, the GPU's pages are the "
                        f"device pool's - got {str(device)!r}")
    return "cpu"


def _pin_memory(value) -> bool:
    """``pin_memory=`` as a bool (numpy's taken): a string such as "no" is truthy and pinned."""
    return check_bool(PlanError, "", "pin_memory", value)


def _pool_label(value) -> str:
    """``pool_label=`` (the metrics' pool label, SGLang's pool name) as a non-empty string."""
    if isinstance(value, str) and value:
        return value
    raise PlanError(f"pool_label must be a non-empty string, got {value!r}")


@attrs.frozen(kw_only=True)
class PoolOptions:
    """SGLang's options of a host pool, the host's pieces (``host``) and hicache's settings
    (``settings``, the `HostPoolOptions` given as ``options=``); SGLang's are checked here, before
    any memory, each error naming the value."""

    pin_memory: bool = attrs.field(default=True, converter=_pin_memory)
    device: str = attrs.field(default="cpu", converter=_host_device)
    allocator_type: str | None = "default"
    pool_label: str = attrs.field(default="kv", converter=_pool_label)
    is_dummy: bool = False
    host: HostSetup | None = None
    settings: HostPoolOptions = attrs.Factory(HostPoolOptions)

    def host_setup(self, owner: str, default: HostSetup | None = None) -> HostSetup:
        """The pool's `HostSetup`: the one given as ``host=``, else its class's ``default`` (a
        class made by `with_host`: the plug-in's, for the server SGLang runs in), else every piece
        the process's own, probed or default. Its ``server``: that setup's, else the class's
        default's, else - deprecated - the one `serve_in` handed in: the only place the pools read
        the process-wide one (a pool then asks its own setup's server: tests/test_import_rules.py)."""
        if self.host is not None and not isinstance(self.host, HostSetup):
            raise TypeError(f"{owner}() host= takes a hicache.effects.HostSetup, got {type(self.host).__name__}")
        setup = self.host if self.host is not None else default if default is not None else HostSetup()
        check_pool_host(f"{owner}() host=", setup)
        if setup.server is not None:
            return setup
        return attrs.evolve(setup, server=default.server if default is not None and default.server is not None
                            else server())


def check_pool_host(where: str, setup: HostSetup) -> None:
    """A pool's `HostSetup` leaves its memory source alone: a pool's memory comes from its own
    ``allocator_type=`` and ``device=``, so the setup's would otherwise be replaced silently
    (``where``: the message's head, naming who was given it)."""
    for name, default in _POOLS_OWN_MEMORY.items():
        if getattr(setup, name) != default:
            raise ValueError(f"{where}HostSetup({name}={getattr(setup, name)!r}): a pool's memory comes "
                             f"from its own allocator_type= and device=; leave HostSetup.{name} at {default!r}")


def with_host(cls: type, host: HostSetup) -> type:
    """``cls`` (a host pool class) whose pools take ``host`` where their call names no ``host=``,
    and its ``server`` where the one named has none: a subclass of the same name, module and
    signature, so that a caller that cannot pass ``host=`` - SGLang, which builds its pools with
    its own signature - builds pools scoped to ``host``'s server without a process-wide setting.
    The plug-in registers these with SGLang (hicache.compat.sglang_plugin)."""
    if not isinstance(cls, type) or not hasattr(cls, "default_host"):
        raise TypeError(f"with_host() takes a hicache host pool class, got {cls!r}")
    if not isinstance(host, HostSetup):
        raise TypeError(f"with_host() host takes a hicache.effects.HostSetup, got {type(host).__name__}")
    check_pool_host(f"with_host({cls.__name__}) ", host)
    namespace = {"default_host": host, "__module__": cls.__module__, "__qualname__": cls.__qualname__,
                 "__doc__": cls.__doc__}
    return type(cls)(cls.__name__, (cls,), namespace)


def check_dummy(owner: str, form, options: PoolOptions) -> None:
    """``is_dummy`` (an allocator-only pool) comes with a form that maps layers (SGLang 0.5.23's)."""
    if options.is_dummy and not form.mapped_layers:
        raise LayoutError(f"{owner}: dcp_size, is_dummy and host_token_capacity come with SGLang 0.5.23's "
                          "constructor (a device-buffer description first), not a device pool")


def under_server_chunk(limits, server):
    """In a server (the pool's `HostSetup.server`: SGLang's process, through the plug-in's
    classes), a pool built by SGLang 0.5.23's constructor also keeps each call within the
    server's own chunk setting (SGLang: SGLANG_HICACHE_HOST_REGISTER_CHUNK_GB through its `envs`):
    the smaller wins."""
    chunk = server.chunk_limit_bytes()
    if chunk is None:
        return limits
    return attrs.evolve(limits, chunk_limit_bytes=chunk) if chunk < limits.chunk_limit_bytes else limits


#: the `HostSetup` fields a pool sets itself, from SGLang's ``allocator_type`` and ``device``
_POOLS_OWN_MEMORY = {"allocator": None, "device": "cpu", "owns_memory": True}


#: the keywords a pool constructor takes beyond its positional ones: SGLang's own options, and
#: hicache's two values (its settings, the host's pieces)
_SGLANG_OPTIONS = ("pin_memory", "device", "allocator_type", "pool_label", "is_dummy")
_OPTION_NAMES = frozenset((*_SGLANG_OPTIONS, "options", "host"))


def given(**values) -> dict:
    """The keywords a caller gave, from a signature whose default for them is None (None: not
    given, so `Sizing`'s and `PoolOptions`' own defaults stand)."""
    return {name: value for name, value in values.items() if value is not None}


def split_keywords(owner: str, keywords: dict, **sizing) -> tuple[Sizing, PoolOptions]:
    """``keywords`` (a constructor's ``**kwargs`` plus its named options) as a `Sizing` (with
    ``sizing``: the positional facts) and `PoolOptions`; an unknown name is a TypeError."""
    for name in keywords:
        if name not in _OPTION_NAMES and name not in SIZING_KEYWORDS:
            raise TypeError(f"{owner}() got an unexpected keyword argument {name!r}")
    given = {name: keywords[name] for name in SIZING_KEYWORDS if name in keywords}
    sized = Sizing(**{**given, **sizing})  # the form's own facts win over a keyword
    settings = keywords.get("options")
    if settings is None:
        settings = HostPoolOptions()
    elif not isinstance(settings, HostPoolOptions):
        raise TypeError(f"{owner}() options= takes a hicache.pools.HostPoolOptions, got {type(settings).__name__}")
    chosen = {name: keywords[name] for name in _SGLANG_OPTIONS if name in keywords}
    return sized, PoolOptions(**chosen, host=keywords.get("host"), settings=settings)
