"""`Limits`: the caps and alignments one `cudaHostRegister` call must respect.

Owns the per-call caps (chunk limit, driver ceiling, kernel cap) and the alignments the planner
may assume. Values come in as arguments (the effects layer probes them); this module never reads
the machine. Pure: imports attrs and hicache.errors only.
"""

from __future__ import annotations

import re

import attrs

from hicache.errors import PlanError
from hicache.plan.checks import as_int, check_int, check_power_of_two
from hicache.plan._value import value_class

GiB = 2**30
MiB = 2**20

#: NVIDIA r580+ drivers fail one registration of 2**39 bytes (512 GiB) or more: the flat page
#: table (16 B per 4 KiB page, kvzalloc) passes INT_MAX ("NVRM: failed to allocate page table";
#: vLLM #51080, open-gpu-kernel-modules PR #1234). 511 GiB stays below it and is a multiple of
#: every OS and hugepage size, so it never costs alignment.
DRIVER_CEILING_BYTES = 2**39 - GiB

#: Linux 6.11-6.13 pin at most ~2 GB per call (MAX_RW_COUNT = INT_MAX & PAGE_MASK); TensorRT-LLM
#: registers 2 GiB chunks on those kernels. 2 GiB - 2 MiB stays under it and keeps 2 MiB pages.
KERNEL_PIN_CAP_BYTES = 2**31 - 2 * MiB

#: The call cap when none is given (issue #53; ../shared/reference/h200-measured.md): calls small
#: enough that registration runs beside the pre-fault (a 64 GiB call waits for all 64 GiB to be
#: resident first) and that none holds the driver-wide lock past the turnstile's 0.25 s stall
#: budget at the slowest rate measured for one call (19 GB/s, 4 KiB pages: 4 GiB takes 0.23 s;
#: 39 GB/s with THP). On an H200 4 GiB calls took a 37.5 GiB pool to usable in 2.3-2.4 s (1.0-1.1
#: with THP) against 2.3-4.1 s for one 64 GiB call.
DEFAULT_CALL_CAP_BYTES = 4 * GiB

#: The chunk limit when none is given: vLLM's and LMCache's 64 GiB - each call then holds the
#: driver lock for seconds, not minutes (TensorRT-LLM #17429). SGLang defaults to 256 GiB.
DEFAULT_CHUNK_LIMIT_BYTES = 64 * GiB


#: compiled on first use (re caches it): a regex compiled at import costs `hicache plan`'s start
_RELEASE = r"^\s*(?:linux\s+)?v?(\d+)[.,](\d+)(?:\D.*)?$"


def parse_kernel_release(release: str) -> tuple[int, int] | None:
    """``(major, minor)`` of a Linux release as people write it - ``6.12``, ``6.12.0-31-generic``
    (``uname -r``), ``v6.12``, ``6,12``, ``Linux 6.12``, surrounding spaces - or None."""
    match = re.match(_RELEASE, release, re.IGNORECASE | re.DOTALL) if isinstance(release, str) else None
    return (int(match[1]), int(match[2])) if match else None


def kernel_pin_cap(release: str) -> int | None:
    """The per-pin cap of a Linux release string: 6.11-6.13 pin at most ~2 GB per call (None
    for other releases, and for a string that is not a release: see `parse_kernel_release`)."""
    version = parse_kernel_release(release)
    if version is not None and (6, 11) <= version < (6, 14):
        return KERNEL_PIN_CAP_BYTES
    return None


def _positive_or_none(field: str):
    def check(instance, attribute, value):
        if value is not None:
            check_int(PlanError, "Limits", field, value)

    return check


def _power_of_two_or_none(field: str):
    def check(instance, attribute, value):
        if value is not None:
            check_power_of_two(PlanError, "Limits", field, value)

    return check


def _default_base_alignment(limits: "Limits") -> int:
    # hicache's own mmap allocator returns OS-page aligned bases, hugepage aligned when the
    # buffer is hugepage-backed.
    return limits.hugepage_bytes or limits.os_page_bytes


@value_class(kw_only=True)
class Limits:
    """Caps on one registration call and alignments the plan may assume.

    ``chunk_limit_bytes``: the operator's cap per call (SGLang's 256 GiB, vLLM's 64 GiB, ...).
    ``hard_ceiling_bytes``: what the driver refuses at or above (default just under 2**39).
    ``kernel_cap_bytes``: a kernel's per-pin cap, or None (see ``KERNEL_PIN_CAP_BYTES``).
    ``os_page_bytes``: the base page size. ``hugepage_bytes``: the page size of a
    hugepage-backed buffer, or None. ``base_alignment_bytes``: what the buffer's base address is
    known to be aligned to (default: the hugepage or OS page, as hicache's mmap guarantees).
    ``call_cap_bytes``: calls sized to overlap the pre-fault and to hold the driver no longer
    than the stall budget (see ``DEFAULT_CALL_CAP_BYTES``), or None (no such cap: a bare
    `Limits` has none; `resolve_limits` gives 4 GiB unless told otherwise).
    """

    chunk_limit_bytes: int = attrs.field(
        converter=as_int,
        validator=lambda i, a, v: check_int(PlanError, "Limits", "chunk_limit_bytes", v)
    )
    os_page_bytes: int = attrs.field(
        default=4096,
        converter=as_int,
        validator=lambda i, a, v: check_power_of_two(PlanError, "Limits", "os_page_bytes", v),
    )
    hard_ceiling_bytes: int = attrs.field(
        default=DRIVER_CEILING_BYTES,
        converter=as_int,
        validator=lambda i, a, v: check_int(PlanError, "Limits", "hard_ceiling_bytes", v),
    )
    kernel_cap_bytes: int | None = attrs.field(
        default=None, converter=as_int, validator=_positive_or_none("kernel_cap_bytes")
    )
    hugepage_bytes: int | None = attrs.field(
        default=None, converter=as_int, validator=_power_of_two_or_none("hugepage_bytes")
    )
    call_cap_bytes: int | None = attrs.field(
        default=None, converter=as_int, validator=_positive_or_none("call_cap_bytes")
    )
    base_alignment_bytes: int = attrs.field(
        default=attrs.Factory(_default_base_alignment, takes_self=True),
        converter=as_int,
        validator=lambda i, a, v: check_power_of_two(PlanError, "Limits", "base_alignment_bytes", v),
    )

    def __attrs_post_init__(self) -> None:
        if self.hugepage_bytes is not None and self.hugepage_bytes % self.os_page_bytes:
            raise PlanError(
                f"Limits.hugepage_bytes ({self.hugepage_bytes}) must be a multiple of "
                f"os_page_bytes ({self.os_page_bytes})"
            )

    def caps(self) -> dict[str, int]:
        """Every per-call cap that is set, by name (``chunk_limit``, ``driver_ceiling``, ...)."""
        caps = {"chunk_limit": self.chunk_limit_bytes, "driver_ceiling": self.hard_ceiling_bytes}
        if self.kernel_cap_bytes is not None:
            caps["kernel_cap"] = self.kernel_cap_bytes
        if self.call_cap_bytes is not None:
            caps["call_cap"] = self.call_cap_bytes
        return caps

    @property
    def effective_cap_bytes(self) -> int:
        """The largest size one call may have: the minimum of every cap."""
        return min(self.caps().values())

    @property
    def hard_cap_bytes(self) -> int:
        """The largest call the machine accepts at all (driver ceiling and kernel cap; the
        chunk limit and the call cap are choices, not the machine's)."""
        caps = self.caps()
        del caps["chunk_limit"]
        caps.pop("call_cap", None)
        return min(caps.values())

    def binding_caps(self) -> tuple[str, ...]:
        """Names of the caps equal to the effective cap (the ones that decide the chunk size)."""
        cap = self.effective_cap_bytes
        return tuple(name for name, value in self.caps().items() if value == cap)
