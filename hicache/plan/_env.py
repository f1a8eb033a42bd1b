"""The one table of hicache's environment: every ``HICACHE_*`` variable, its type, range,
default and who reads it - and the one strict reader of each.

Every reader of a ``HICACHE_*`` variable calls `env_value` (the settings code, the pools, the
plug-in, the turnstile, the lock, the trace), `hicache doctor` checks every row, and
docs/environment.md is `environment_markdown()` of this table (a test keeps them equal).
Numbers are ASCII: Python's int() and float() read "١٢" as 12, which no operator meant.
Pure: the environment comes in as a mapping; a value that cannot be read is an `EnvError`
naming the variable and the value, never a silent default. Whether a path can be written is
the effects' question (`hicache.effects.check_environment`).
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping
from decimal import Decimal, InvalidOperation
from typing import NamedTuple

from hicache.errors import EnvError, PlanError
from hicache.plan._transfer import DEFAULT_PROGRAMS, MAX_PROGRAMS, TRANSFER_MODES
from hicache.plan._units import format_bytes, parse_size

_TRUE, _FALSE = ("1", "true", "yes", "on"), ("0", "false", "no", "off")
#: Host page sizes a pool may ask for (`hicache.effects` maps them; these are the words): the one
#: tuple the variable, apply's --hugepages, the pools and the allocator check against.
HUGEPAGE_MODES = ("off", "thp", "prefer", "required", "auto")
# compiled on first use (re caches them): regexes compiled at import cost `hicache plan`'s start
_ASCII_INT = r"[0-9]+"
_ASCII_NUMBER = r"[0-9]+(?:\.[0-9]*)?(?:[eE][+-]?[0-9]+)?|\.[0-9]+(?:[eE][+-]?[0-9]+)?"


def _number(value: float) -> str:
    """2592000.0 -> "2,592,000"; 0.25 -> "0.25"."""
    return f"{int(value):,}" if value == int(value) else f"{value:g}"


class Setting(NamedTuple):
    """One row. ``kind``: size, bool, choice, count, concurrency, seconds, path. ``minimum`` /
    ``maximum``: the range of sizes, counts and seconds; ``choices`` the words of a choice;
    ``default`` as the docs say it; ``readers`` what reads it; ``none_word`` a size's word for
    "no cap"; ``power_of_two`` a size that must be one."""

    name: str
    kind: str
    default: str
    readers: tuple
    meaning: str
    minimum: float | None = None
    maximum: float | None = None
    choices: tuple = ()
    none_word: str | None = None
    power_of_two: bool = False

    @property
    def range(self) -> str:
        """The values it takes, in words (the docs' and the doctor's)."""
        if self.kind == "bool":
            return "on/off (1/0, true/false, yes/no)"
        if self.kind == "choice":
            return ", ".join(self.choices)
        if self.kind == "size":
            text = (f"{format_bytes(int(self.minimum))} to {format_bytes(int(self.maximum))}" if self.maximum
                    else f"at least {format_bytes(int(self.minimum))}")
            text = ("a power of two, " if self.power_of_two else "") + text
            return text + (f", or {self.none_word}" if self.none_word else "")
        if self.kind == "count":
            return f"a whole number {int(self.minimum)} to {int(self.maximum)}"
        if self.kind == "concurrency":
            return f"auto, off (or 0), or a whole number 1 to {int(self.maximum)}"
        if self.kind == "seconds":
            return f"seconds, over 0 and at most {_number(self.maximum)}"
        return "a path"


#: Why hugetlbfs pages stop at 2 GiB: mmap's flags are a C int and the page size rides in them
#: as log2 << MAP_HUGE_SHIFT (26): 4 GiB (32 << 26) overflows it (Python's mmap raises
#: OverflowError), so x86's 1 GiB and arm64's 64 KiB-1 GiB fit; Power's 16 GiB does not.
HUGEPAGE_MAX_NOTE = "mmap flags are a C int: log2(page) << 26 must fit"

_ALL = ("plan", "apply", "pools", "SGLang plug-in", "doctor")
_BRING_UPS = ("apply", "pools", "SGLang plug-in")
_HOST_WIDE = _BRING_UPS + ("node store", "doctor")  # the budget lock's directory and wait

#: Every HICACHE_* variable hicache reads, in the order the docs list them.
SETTINGS = (
    Setting("HICACHE_REGISTER_CHUNK", "size", "64 GiB", _ALL,
            "largest cudaHostRegister call (a flag such as --chunk-limit wins)",
            minimum=4096),
    Setting("HICACHE_CALL_CAP", "size", "4 GiB", _ALL,
            "largest cudaHostRegister call so registration overlaps the pre-fault and no call holds the driver "
            "past the stall budget (none: no such cap; --call-cap wins)",
            minimum=4096, none_word="none"),
    Setting("HICACHE_KERNEL_PIN_CAP", "size", "by the running kernel's release", _ALL,
            "the kernel's per-pin cap (none: no cap; --kernel-release wins)",
            minimum=4096, none_word="none"),
    Setting("HICACHE_DRIVER_CEILING", "size", "511 GiB", _ALL,
            "largest single registration the driver accepts (it refuses 512 GiB)",
            minimum=4096),
    Setting("HICACHE_HUGEPAGE_SIZE", "size", "2 MiB (when hugetlbfs pages are asked for)", _ALL,
            "hugetlbfs page size of hugepage-backed pools (--hugepage-size wins)",
            minimum=64 * 2**10, maximum=2 * 2**30, power_of_two=True),  # see HUGEPAGE_MAX_NOTE
    Setting("HICACHE_HUGEPAGES", "choice", "auto", ("apply", "pools", "SGLang plug-in", "doctor"),
            "host pools' page size: 4 KiB (off), transparent huge pages (thp), hugetlbfs when free (prefer) or only "
            "hugetlbfs (required), or THP for each pre-fault piece the node's free 2 MiB blocks cover, braked off when "
            "it faults slower than 4 KiB pages (auto); apply's --hugepages wins", choices=HUGEPAGE_MODES),
    Setting("HICACHE_PROGRESSIVE", "bool", "0", ("apply", "pools", "SGLang plug-in", "doctor"),
            "host pools register in the background, serving from the first registered page "
            "(apply's --progressive/--no-progressive wins)"),
    Setting("HICACHE_HOST_COPY", "choice", "auto", ("apply", "pools", "doctor"),
            "host page copies: the native helper when built (auto), only it (native), or ctypes memmove (python); "
            "flat L3 pages of at most 64 KiB are copied into and out of a pool by the helper, larger ones (and "
            "every one in python mode) by torch",
            choices=("auto", "native", "python")),
    Setting("HICACHE_TRANSFER", "choice", "auto", ("pools", "SGLang plug-in", "doctor"),
            "host<->GPU transfers: by the table of measured rules (auto: the GPU gathers pieces under 64 KiB "
            "and every backup, the copy engine loads larger pieces), only the copy engine (dma), or only "
            "the GPU's gather (gather)", choices=TRANSFER_MODES),
    Setting("HICACHE_TRANSFER_PROGRAMS", "count", str(DEFAULT_PROGRAMS), ("pools", "SGLang plug-in", "doctor"),
            "programs (about one SM each) a gather transfer takes at most", minimum=1, maximum=MAX_PROGRAMS),
    Setting("HICACHE_RANKS_PER_HOST", "count", "LOCAL_WORLD_SIZE, else 1", _BRING_UPS + ("doctor",),
            "ranks sharing this host's memory: the budget splits the free memory between them, and each "
            "rank's pre-fault takes an equal share of its NUMA node's CPUs (apply's --ranks-per-host wins)",
            minimum=1, maximum=4096),
    Setting("HICACHE_PIN_CONCURRENCY", "concurrency", "auto", _BRING_UPS + ("doctor",),
            "the host's registration turnstile: auto (one call at a time while another process brings up "
            "pools), off, or N calls in flight across the host", maximum=1024),
    Setting("HICACHE_PIN_MAX_STALL_S", "seconds", "0.25", _BRING_UPS + ("doctor",),
            "the turnstile's stall budget: how long one register call may hold up another process's",
            minimum=0, maximum=3600),
    Setting("HICACHE_LOCK_TIMEOUT", "seconds", "unset: wait as long as it takes", _HOST_WIDE,
            "seconds to wait for the host-wide budget lock before a clean error naming its holder",
            minimum=0, maximum=30 * 86400),
    Setting("HICACHE_RUNTIME_DIR", "path", "$XDG_RUNTIME_DIR/hicache, else /tmp/hicache-<uid>", _HOST_WIDE,
            "private directory (mode 0700, yours) of the host-wide budget lock, ledger and turnstile: processes "
            "share the budget through it, so servers in separate containers of one host bind-mount one directory here"),
    Setting("HICACHE_TRACE", "path", "unset: no trace", _BRING_UPS,
            "write a Chrome trace-event JSON of every bring-up of the process to this file (a new or regular file)"),
    Setting("HICACHE_SGLANG", "bool", "on", ("SGLang plug-in", "doctor"),
            "the sglang.srt.plugins entry point patches SGLang's host-memory registration (off: SGLang's own stays)"),
    Setting("HICACHE_SGLANG_POOLS", "bool", "0", ("SGLang plug-in", "doctor"),
            "the plug-in also puts hicache's host-pool classes in place of SGLang's"),
)
BY_NAME = {setting.name: setting for setting in SETTINGS}
#: The prefix every hicache variable has: a set one not in the table is a typo (the doctor warns).
PREFIX = "HICACHE_"


def env_value(env: Mapping, name: str):
    """The value of ``name`` in ``env`` as its row reads it, None when unset or blank: a size in
    bytes (or the row's ``none_word``), a bool, a choice's word, an int, seconds, a path;
    a concurrency is ``"auto"``, ``"off"`` or an int. Anything else: an `EnvError` naming the
    variable, the value and what it takes."""
    setting = BY_NAME[name]
    raw = env.get(name)
    if raw is None or not raw.strip():
        return None
    text = raw.strip()
    word = text.lower()

    def refuse(reason: str):
        return EnvError(f"environment variable {name}={raw!r} {reason}")

    kind = setting.kind
    if kind == "bool":
        if word in _TRUE:
            return True
        if word in _FALSE:
            return False
        raise refuse("must be on or off (1/0, true/false, yes/no)")
    if kind == "choice":
        if word in setting.choices:
            return word
        raise refuse(f"must be one of {', '.join(setting.choices)}")
    if kind == "size":
        if setting.none_word and word == setting.none_word:
            return setting.none_word
        try:
            value = parse_size(text, what=name)
        except PlanError as error:
            raise refuse(f"is invalid: {error}") from None
        if not size_in_range(name, value):
            raise refuse(f"is invalid: must be {setting.range}")
        return value
    if kind in ("count", "concurrency"):
        if kind == "concurrency" and word in ("auto", "off", "0", "false", "no"):
            return "auto" if word == "auto" else "off"
        minimum = 1 if setting.minimum is None else setting.minimum
        if not re.fullmatch(_ASCII_INT, text, re.ASCII) or not minimum <= int(text) <= setting.maximum:
            raise refuse(f"must be {setting.range}" if kind == "concurrency" else f"must be a positive integer "
                         f"({setting.range})")
        return int(text)
    if kind == "seconds":
        try:
            seconds = float(Decimal(text)) if re.fullmatch(_ASCII_NUMBER, text, re.ASCII) else math.nan
        except InvalidOperation:
            seconds = math.nan
        if not (math.isfinite(seconds) and setting.minimum < seconds <= setting.maximum):
            raise refuse(f"must be a positive number of seconds (over 0, at most {_number(setting.maximum)})")
        return seconds
    if "\x00" in raw:
        raise refuse("must be a path (it holds a NUL byte)")
    return text


def size_in_range(name: str, value: int) -> bool:
    """Whether ``value`` bytes is within the size row ``name``'s range (a flag that sets the
    same thing, such as --hugepage-size, is held to it too)."""
    setting = BY_NAME[name]
    if value < setting.minimum or (setting.maximum and value > setting.maximum):
        return False
    return not (setting.power_of_two and value & (value - 1))


def unknown_variables(env: Mapping) -> list[str]:
    """``HICACHE_*`` variables set in ``env`` that no row names (a typo reads as unset)."""
    return sorted(name for name in env if name.startswith(PREFIX) and name not in BY_NAME)


def environment_markdown() -> str:
    """docs/environment.md: the table, as the docs print it."""
    lines = [
        "# Environment variables",
        "",
        "Generated from `hicache/plan/_env.py` (`make docs`; a test keeps this file equal to the table).",
        "Every variable is read strictly: a value hicache cannot read is an error naming the variable and",
        "the value (`error[bad-environment]` from the commands, `EnvError` from the library) before any",
        "memory is taken, never a silent default. `hicache doctor` checks every row and FAILs a bad value;",
        "a set `HICACHE_*` variable that is not in the table is a warning (a typo reads as unset).",
        "A command's flag beats the variable (said in each command's `--help`).",
        "",
        "| variable | takes | default | read by | what it does |",
        "|---|---|---|---|---|",
    ]
    for s in SETTINGS:
        lines.append(f"| `{s.name}` | {s.range} | {s.default} | {', '.join(s.readers)} | {s.meaning} |")
    lines += [
        "",
        "SGLang's own `SGLANG_HICACHE_HOST_REGISTER_CHUNK_GB` is read through SGLang's `envs` inside SGLang",
        "(see [sglang.md](sglang.md)); `LOCAL_WORLD_SIZE` stands in for `HICACHE_RANKS_PER_HOST` when it is unset.",
        "",
    ]
    return "\n".join(lines)
