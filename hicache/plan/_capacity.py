"""Capacity math: how many tokens a host pool holds.

Owns the one pool-sizing rule (``--hicache-size`` in decimal GB per rank, or device tokens x
ratio; issue #34: it was written twice) in its two forms - SGLang 0.5.23's (its float
arithmetic, then whole pages plus its padding page) and the older ceiling (exact decimals,
pages by ceil division, no extra page) - used by `hicache plan` and by the pools alike; the
budget check against available memory is `_budget`'s. Machine figures come in as arguments.
Pure: attrs, the standard library and hicache.errors only.
"""

from __future__ import annotations

import numbers
from decimal import Decimal, InvalidOperation

from hicache.errors import PlanError, PoolTooSmallError
from hicache.plan.checks import check_int
from hicache.plan._units import format_gb
from hicache.plan._value import value_class

#: SGLang keeps 10 GiB of host memory back for everything else (memory_pool_host.py).
DEFAULT_RESERVE_BYTES = 10 * 2**30


def _positive_number(owner: str, field: str, value) -> Decimal:
    if isinstance(value, bool) or not isinstance(value, (numbers.Real, Decimal, str)):  # numpy's floats too
        raise PlanError(f"{owner}.{field} must be a number, got {value!r}")
    try:
        number = Decimal(str(value))
    except InvalidOperation:
        raise PlanError(f"{owner}.{field} must be a number, got {value!r}") from None
    if not number.is_finite() or number <= 0:
        raise PlanError(f"{owner}.{field} must be a positive finite number, got {value!r}")
    return number


#: The sizing rules: SGLang 0.5.23's (``tokens // page_size + 1``: its padding page for an
#: independent pool, what its constructor allocates) and the older ceiling (``ceil(tokens /
#: page_size)``, page-aligned counts get no extra page).
SGLANG_0_5_23, CEIL = "sglang-0.5.23", "ceil"
SIZING_RULES = (SGLANG_0_5_23, CEIL)


def host_tokens(*, size_per_token_bytes: int, host_gb=None, device_tokens=None, host_to_device_ratio=None,
                rule: str = CEIL) -> int:
    """Tokens a host pool is sized for before pages: ``host_gb`` decimal GB over the bytes per
    token, else ``device_tokens x host_to_device_ratio``. SGLang 0.5.23's rule does SGLang's own
    float arithmetic (``int(host_size * 1e9 // size_per_token)``, ``int(tokens * ratio)``) so the
    count is exactly the one its constructor reaches; the ceiling's is exact (decimals)."""
    owner = "size_pool"
    if rule not in SIZING_RULES:
        raise PlanError(f"{owner}.rule must be one of {', '.join(SIZING_RULES)}, got {rule!r}")
    per_token = check_int(PlanError, owner, "size_per_token_bytes", size_per_token_bytes)
    if host_gb is not None:
        gb = _positive_number(owner, "host_gb", host_gb)
        if rule == SGLANG_0_5_23:
            return int(float(gb) * 1e9 // per_token)
        return int(gb * 10**9) // per_token
    if device_tokens is not None and host_to_device_ratio is not None:
        ratio = _positive_number(owner, "host_to_device_ratio", host_to_device_ratio)
        tokens = check_int(PlanError, owner, "device_tokens", device_tokens)
        return int(tokens * float(ratio)) if rule == SGLANG_0_5_23 else int(tokens * ratio)
    raise PlanError("size_pool needs host_gb, or device_tokens together with host_to_device_ratio")


def pages_for(tokens: int, page_size: int, rule: str = CEIL) -> int:
    """Pages for ``tokens`` under ``rule``: 0.5.23's whole pages plus its padding page, or the
    ceiling (no extra page for a page-aligned count)."""
    if rule == SGLANG_0_5_23:
        return tokens // page_size + 1
    return -(-tokens // page_size)


@value_class
class PoolSize:
    """Tokens and pages a pool holds; ``notes`` carry warnings (host smaller than device)."""

    tokens: int
    page_size: int
    page_num: int
    size_per_token_bytes: int
    notes: tuple[str, ...] = ()

    @property
    def total_bytes(self) -> int:
        """Bytes for ``page_num * page_size`` tokens."""
        return self.page_num * self.page_size * self.size_per_token_bytes


def size_pool(
    *,
    size_per_token_bytes: int,
    page_size: int,
    host_gb: float | int | None = None,
    device_tokens: int | None = None,
    host_to_device_ratio: float | int | None = None,
    rule: str = CEIL,
) -> PoolSize:
    """Size a host pool by ``rule`` (`SIZING_RULES`; default the ceiling: SGLang's sizing minus
    its extra page; ``"sglang-0.5.23"``: what 0.5.23's constructor allocates, padding page included).

    ``host_gb`` (decimal GB per rank, SGLang's ``--hicache-size``) takes precedence; otherwise
    ``device_tokens * host_to_device_ratio``. A host pool smaller than the device pool is a
    note, not an error. Raises ``PlanError``/``CapacityError`` for bad or empty sizes.
    """
    owner = "size_pool"
    per_token = check_int(PlanError, owner, "size_per_token_bytes", size_per_token_bytes)
    page = check_int(PlanError, owner, "page_size", page_size)
    if device_tokens is not None:
        device_tokens = check_int(PlanError, owner, "device_tokens", device_tokens)
    notes: list[str] = []
    if host_gb is not None:
        tokens = host_tokens(size_per_token_bytes=per_token, host_gb=host_gb, rule=rule)
        if tokens == 0:
            host_bytes = int(_positive_number(owner, "host_gb", host_gb) * 10**9)
            raise PoolTooSmallError(
                f"host_gb={host_gb} ({format_gb(host_bytes)}) holds no token of "
                f"{per_token} bytes"
            )
    else:
        tokens = host_tokens(size_per_token_bytes=per_token, device_tokens=device_tokens,
                             host_to_device_ratio=host_to_device_ratio, rule=rule)
        if tokens == 0:
            raise PoolTooSmallError(
                f"{device_tokens} device tokens x ratio {host_to_device_ratio} is no token"
            )
    if device_tokens is not None and tokens < device_tokens:
        notes.append(
            f"host pool ({tokens} tokens) is smaller than the device pool ({device_tokens} "
            "tokens): pages evicted from the device may not fit on the host"
        )
    page_num = pages_for(tokens, page, rule)
    return PoolSize(page_num * page, page, page_num, per_token, tuple(notes))
