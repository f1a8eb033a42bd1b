"""`plan_pool`: a layout descriptor and `Limits` -> a `PoolPlan`, one plan per buffer.

Owns the pairing of each buffer spec with its registration plan, so the effects layer can apply
a whole pool as one transaction. Pure: attrs and the rest of hicache.plan only.
"""

from __future__ import annotations

import attrs

from hicache.errors import LayoutError, PlanError
from hicache.plan.checks import as_tuple
from hicache.plan._layouts import LAYOUT_CLASSES, BufferSpec, is_layout
from hicache.plan._limits import Limits
from hicache.plan._planner import RegistrationPlan, plan_registration
from hicache.plan._value import value_class


@value_class
class BufferPlan:
    """One buffer of a pool and how to register it."""

    spec: BufferSpec
    plan: RegistrationPlan

    def __attrs_post_init__(self) -> None:
        if self.plan.total_bytes != self.spec.nbytes:
            raise PlanError(
                f"buffer {self.spec.name!r}: plan covers {self.plan.total_bytes} bytes but the "
                f"buffer has {self.spec.nbytes}"
            )
        if self.plan.granularity_bytes != self.spec.copy_unit_bytes:
            raise PlanError(
                f"buffer {self.spec.name!r}: plan granularity {self.plan.granularity_bytes} is "
                f"not the buffer's copy unit {self.spec.copy_unit_bytes}"
            )


@value_class
class PoolPlan:
    """Every buffer of a pool with its registration plan; applied as one transaction."""

    layout: object
    limits: Limits
    buffers: tuple[BufferPlan, ...] = attrs.field(converter=as_tuple)

    @property
    def total_bytes(self) -> int:
        """Bytes of all buffers."""
        return sum(b.spec.nbytes for b in self.buffers)

    @property
    def call_count(self) -> int:
        """``cudaHostRegister`` calls for the whole pool."""
        return sum(b.plan.call_count for b in self.buffers)

    @property
    def largest_call_bytes(self) -> int:
        """The largest single call across the pool."""
        return max((b.plan.largest_call_bytes for b in self.buffers), default=0)


def plan_pool(layout, limits: Limits) -> PoolPlan:
    """Plan every buffer of ``layout`` (a descriptor such as ``MHALayout``) under ``limits``.

    Each buffer is split on its own page-copy unit. Raises ``LayoutError`` for something that
    is not a layout descriptor and ``PlanError`` when a buffer cannot be planned.
    """
    if not is_layout(layout):
        raise LayoutError(
            f"plan_pool: layout must be one of {', '.join(c.__name__ for c in LAYOUT_CLASSES.values())}, "
            f"got {layout!r}"
        )
    buffers = []
    for spec in layout.buffers():
        try:
            plan = plan_registration(
                spec.nbytes, granularity_bytes=spec.copy_unit_bytes, limits=limits
            )
        except PlanError as error:  # named by its buffer, its kind and data kept (CopyUnitOverCapError's caps)
            error.args = (f"buffer {spec.name!r} ({spec.layout}): {error}",)
            raise
        buffers.append(BufferPlan(spec, plan))
    return PoolPlan(layout, limits, tuple(buffers))
