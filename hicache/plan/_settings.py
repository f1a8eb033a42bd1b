"""The one place registration caps are resolved: flags, ``HICACHE_*`` settings, machine facts.

Owns the precedence (a flag beats the environment, which beats a machine fact, which beats
the default; the driver ceiling and any kernel cap always hold, as `Limits` takes the
minimum) and the record of which source decided each cap. Pure: the environment comes in as a
mapping and the machine's kernel release as a string - `hicache.effects.probe_limits` passes
the real ones, `hicache plan` passes the environment but no machine unless asked.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import NamedTuple

from hicache.errors import EnvError, PlanError
from hicache.plan._env import BY_NAME, HUGEPAGE_MODES, env_value
from hicache.plan._limits import (
    DEFAULT_CALL_CAP_BYTES,
    DEFAULT_CHUNK_LIMIT_BYTES,
    DRIVER_CEILING_BYTES,
    Limits,
    kernel_pin_cap,
    parse_kernel_release,
)
from hicache.plan._units import parse_size

#: The caps read from the environment, and what each sets (rows of the one table, `_env`).
SETTINGS_ENV = {name: BY_NAME[name].meaning for name in (
    "HICACHE_REGISTER_CHUNK", "HICACHE_KERNEL_PIN_CAP", "HICACHE_DRIVER_CEILING", "HICACHE_HUGEPAGE_SIZE")}


def env_size(env: Mapping, name: str, *, allow_none: bool = False):
    """The size in ``env[name]`` (None when unset or empty; ``"none"`` when allowed and given):
    the table's row when it has one (its range holds), else any size."""
    if name in BY_NAME:
        value = env_value(env, name)
        if value == "none" and not allow_none:
            raise EnvError(f"environment variable {name}={env.get(name)!r} must be a size here")
        return value
    raw = env.get(name)
    if raw is None or raw == "":
        return None
    if allow_none and raw.strip().lower() == "none":
        return "none"
    try:
        return parse_size(raw, what=name)
    except PlanError as error:
        raise EnvError(f"environment variable {name}={raw!r} is invalid: {error}") from None


def check_hugepages(error: type[Exception], owner: str, value) -> str:
    """``value`` if it is one of `HUGEPAGE_MODES`, else ``error`` naming ``owner.hugepages``
    (the pools' and the allocator's one check)."""
    if value not in HUGEPAGE_MODES:
        raise error(f"{owner}.hugepages must be one of {HUGEPAGE_MODES}, got {value!r}")
    return value
HUGETLBFS_MODES = ("prefer", "required")  # the modes that map hugetlbfs pages
#: hugetlbfs page size when none is named: 2 MiB, the x86-64 default (Hugepagesize).
DEFAULT_HUGEPAGE_BYTES = 2 * 2**20
#: SGLang's own chunk setting (GiB per cudaHostRegister call), read by compat.sglang.
SGLANG_CHUNK_ENV = "SGLANG_HICACHE_HOST_REGISTER_CHUNK_GB"


class ResolvedLimits(NamedTuple):
    """`Limits` and, per cap (``chunk_limit``, ``driver_ceiling``, ``kernel_cap``,
    ``hugepage``), the source that decided it: a flag, a variable, the machine or the default.
    (A NamedTuple, not an attrs class: `hicache plan` imports this on every start.)"""

    limits: Limits
    sources: dict


def resolve_limits(
    *,
    env: Mapping | None = None,
    chunk_limit_bytes: int | None = None,
    kernel_release: str | None = None,
    hugepage_bytes: int | None = None,
    machine_kernel_release: str | None = None,
    os_page_bytes: int = 4096,
    flag_names: Mapping | None = None,
    call_cap_bytes: int | str | None = None,
) -> ResolvedLimits:
    """Merge explicit values (flags), ``env`` (``HICACHE_*``) and the machine into `Limits`.

    ``kernel_release`` (a flag) applies that release's per-pin cap; ``machine_kernel_release``
    is the running kernel's, used only when neither the flag nor ``HICACHE_KERNEL_PIN_CAP``
    says otherwise. ``flag_names`` names the flags in ``sources`` (default ``--chunk-limit``,
    ``--kernel-release``, ``--hugepage-size``, ``--call-cap``). ``call_cap_bytes`` (a flag: bytes,
    or ``"none"`` for no call cap) beats ``HICACHE_CALL_CAP``, which beats the 4 GiB default.
    Raises `EnvError` naming a bad variable.
    """
    env = {} if env is None else env
    flags = {"chunk_limit": "--chunk-limit", "kernel_release": "--kernel-release", "hugepage": "--hugepage-size",
             "call_cap": "--call-cap"}
    flags.update(flag_names or {})
    sources: dict[str, str] = {}

    if chunk_limit_bytes is not None:
        chunk, sources["chunk_limit"] = chunk_limit_bytes, flags["chunk_limit"]
    elif (value := env_size(env, "HICACHE_REGISTER_CHUNK")) is not None:
        chunk, sources["chunk_limit"] = value, "HICACHE_REGISTER_CHUNK"
    else:
        chunk, sources["chunk_limit"] = DEFAULT_CHUNK_LIMIT_BYTES, "default"

    if call_cap_bytes is not None:
        call_cap, sources["call_cap"] = (None if call_cap_bytes == "none" else call_cap_bytes), flags["call_cap"]
    elif (value := env_size(env, "HICACHE_CALL_CAP", allow_none=True)) is not None:
        call_cap, sources["call_cap"] = (None if value == "none" else value), "HICACHE_CALL_CAP"
    else:
        call_cap, sources["call_cap"] = DEFAULT_CALL_CAP_BYTES, "default"

    env_cap = env_size(env, "HICACHE_KERNEL_PIN_CAP", allow_none=True)
    if kernel_release is not None:
        if parse_kernel_release(kernel_release) is None:  # never a silent "no cap" for a typo
            raise PlanError(f"kernel release {kernel_release!r} is not a Linux release (e.g. 6.12 or 6.12.0-31-generic)")
        cap = kernel_pin_cap(kernel_release)
        sources["kernel_cap"] = f"{flags['kernel_release']} {kernel_release}"
    elif env_cap is not None:
        cap = None if env_cap == "none" else env_cap
        sources["kernel_cap"] = "HICACHE_KERNEL_PIN_CAP"
    elif machine_kernel_release is not None:
        cap = kernel_pin_cap(machine_kernel_release)
        sources["kernel_cap"] = f"this machine (Linux {machine_kernel_release})"
    else:
        cap, sources["kernel_cap"] = None, "not checked"

    if (ceiling := env_size(env, "HICACHE_DRIVER_CEILING")) is not None:
        sources["driver_ceiling"] = "HICACHE_DRIVER_CEILING"
    else:
        ceiling, sources["driver_ceiling"] = DRIVER_CEILING_BYTES, "default"

    if hugepage_bytes is not None:
        hugepage, sources["hugepage"] = hugepage_bytes, flags["hugepage"]
    elif (hugepage := env_size(env, "HICACHE_HUGEPAGE_SIZE")) is not None:
        sources["hugepage"] = "HICACHE_HUGEPAGE_SIZE"
    else:
        sources["hugepage"] = "not set"

    try:
        limits = Limits(
            chunk_limit_bytes=chunk, os_page_bytes=os_page_bytes, hard_ceiling_bytes=ceiling,
            kernel_cap_bytes=cap, hugepage_bytes=hugepage, call_cap_bytes=call_cap,
        )
    except PlanError as error:
        named = ", ".join(f"{k} from {v}" for k, v in sources.items() if v not in ("default", "not set", "not checked"))
        raise EnvError(f"invalid limits ({named or 'defaults'}): {error}") from None
    return ResolvedLimits(limits, sources)
