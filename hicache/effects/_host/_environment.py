"""The environment as hicache's bring-ups read it (issue #34: out of the machine probes): every
``HICACHE_*`` row checked (`environment_problems`, for the doctor and apply), the pools' settings
(`pool_settings`), the rank count (`ranks_per_host`), the plug-in switch and SGLang's own chunk
setting outside SGLang. Each variable is parsed by the one table's reader
(`hicache.plan._env.env_value`); a bad value is an `EnvError` naming it.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

import attrs

from hicache.errors import EnvError
from hicache.plan import SGLANG_CHUNK_ENV
from hicache.plan.settings import SETTINGS, env_value




def _env_int(env, name: str):
    raw = env.get(name)
    if raw is None or raw == "":
        return None
    if not re.fullmatch(r"\s*[1-9][0-9]*\s*", raw, re.ASCII):
        raise EnvError(f"environment variable {name}={raw!r} must be a positive integer")
    return int(raw)


def ranks_per_host(env=None) -> int:
    """HICACHE_RANKS_PER_HOST, else LOCAL_WORLD_SIZE, else 1 (strictly parsed)."""
    env = os.environ if env is None else env
    return env_value(env, "HICACHE_RANKS_PER_HOST") or _env_int(env, "LOCAL_WORLD_SIZE") or 1


@attrs.frozen
class EnvProblem:
    """One ``HICACHE_*`` variable whose value hicache cannot use: its ``name``, the ``value`` as
    set and the ``reason`` (which names both)."""

    name: str
    value: str
    reason: str


def environment_problems(env=None, *, paths: bool = True) -> list[EnvProblem]:
    """Every row of the environment table checked against ``env`` - as its readers parse it,
    and (``paths``) a path as it will be used (HICACHE_TRACE writable as a trace,
    HICACHE_RUNTIME_DIR a private directory; one not there yet is made and removed again, the
    only true answer to whether it can be) - leaving nothing changed. Empty: every bring-up can
    read it."""
    from hicache.effects._hostwide._rundir import runtime_dir, runtime_dir_problem
    from hicache.effects._trace import check_path
    from hicache.errors import TraceOutputError

    env = os.environ if env is None else env
    problems = []
    for setting in SETTINGS:
        try:
            value = env_value(env, setting.name)
        except EnvError as error:
            problems.append(EnvProblem(setting.name, env[setting.name], str(error)))
            continue
        reason = None
        if value is None or not paths:
            continue
        if setting.name == "HICACHE_TRACE":
            try:
                check_path(value)
            except TraceOutputError as error:
                reason = str(error)
        elif setting.name == "HICACHE_RUNTIME_DIR":
            reason = runtime_dir_problem(Path(value))
        if reason is not None:
            problems.append(EnvProblem(setting.name, env[setting.name],
                                       f"environment variable {setting.name}={env[setting.name]!r}: {reason}"))
    if paths and not any(p.name == "HICACHE_RUNTIME_DIR" for p in problems) and \
            env_value(env, "HICACHE_RUNTIME_DIR") is None:  # unset: the default every bring-up will use
        default = runtime_dir(env)
        if (reason := runtime_dir_problem(default)) is not None:
            problems.append(EnvProblem("HICACHE_RUNTIME_DIR", "", f"HICACHE_RUNTIME_DIR is unset and its default "
                                                                  f"cannot be used: {reason}"))
    return problems


#: SGLang's own setting for its registration helpers (hicache.compat.sglang reads it here).


def sglang_register_chunk_bytes(env=None, *, default_gib: int = 256) -> int:
    """SGLANG_HICACHE_HOST_REGISTER_CHUNK_GB as SGLang reads it: GiB, at least 1, default 256.

    A value that is not an integer is a ValueError naming the variable (SGLang's env reader
    would fail too); zero or negative is raised to 1, as SGLang's ``max(value, 1)`` does.
    """
    env = os.environ if env is None else env
    raw = env.get(SGLANG_CHUNK_ENV)
    if raw is None or raw.strip() == "":
        gib = default_gib
    else:
        try:
            gib = int(raw)
        except ValueError:
            raise ValueError(f"environment variable {SGLANG_CHUNK_ENV}={raw!r} must be an integer number of GiB") from None
    return max(gib, 1) * 2**30


def sglang_plugin_enabled(env=None) -> bool:
    """HICACHE_SGLANG: whether the `hicache` SGLang plug-in patches anything (default on; off,
    0, false, no turn it off). Another value is an `EnvError` naming it."""
    value = env_value(os.environ if env is None else env, "HICACHE_SGLANG")
    return True if value is None else value


@attrs.frozen
class PoolSettings:
    """What a host pool does when its constructor was not told (SGLang's call sites pass no
    hicache keywords): from HICACHE_PROGRESSIVE and HICACHE_HUGEPAGES; and whether the SGLang
    plug-in puts hicache's host-pool classes in place of SGLang's (HICACHE_SGLANG_POOLS)."""

    progressive: bool = False
    hugepages: str = "auto"
    sglang_pools: bool = False


def pool_settings(env=None) -> PoolSettings:
    """`PoolSettings` from the environment; a value hicache cannot read is an `EnvError`
    naming the variable and the value (never a silent default)."""
    env = os.environ if env is None else env
    return PoolSettings(bool(env_value(env, "HICACHE_PROGRESSIVE")), env_value(env, "HICACHE_HUGEPAGES") or "auto",
                        bool(env_value(env, "HICACHE_SGLANG_POOLS")))
