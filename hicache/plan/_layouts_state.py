"""Layout descriptors of the state families: mamba, deepseek_v4_paged, deepseek_v4_state.

Owns their fields and buffers (shape-valued fields, per-layer buffers); the shape tables and
shared checks are `_layouts`'. Loaded on first use (`_layouts.LAYOUT_CLASSES`).
Pure: attrs, the standard library and hicache.errors only.
"""

from __future__ import annotations

import math

import attrs

from hicache.errors import LayoutError
from hicache.plan._layouts import MAX_LAYERS, BufferSpec, _dim, _layout_name, _LayoutBase
from hicache.plan.checks import check_int
from hicache.plan._value import value_class


def _shape_field(name: str):
    def convert(value):
        return tuple(value) if isinstance(value, (list, tuple)) else value

    def check(instance, attribute, value):
        owner = type(instance).__name__
        if not isinstance(value, tuple):
            raise LayoutError(f"{owner}.{name} must be a tuple of integers, got {value!r}")
        for index, dim in enumerate(value):
            check_int(LayoutError, owner, f"{name}[{index}]", dim, minimum=0)

    return attrs.field(kw_only=True, converter=convert, validator=check)


def _conv_shapes_field():
    def convert(value):
        if isinstance(value, (list, tuple)):
            return tuple(tuple(s) if isinstance(s, (list, tuple)) else s for s in value)
        return value

    def check(instance, attribute, value):
        if not isinstance(value, tuple):
            raise LayoutError(f"MambaLayout.conv_shapes must be a tuple of shapes, got {value!r}")
        for i, shape in enumerate(value):
            if not isinstance(shape, tuple):
                raise LayoutError(f"MambaLayout.conv_shapes[{i}] must be a tuple, got {shape!r}")
            for j, dim in enumerate(shape):
                check_int(LayoutError, "MambaLayout", f"conv_shapes[{i}][{j}]", dim, minimum=0)

    return attrs.field(kw_only=True, converter=convert, validator=check)


@value_class
class MambaLayout(_LayoutBase):
    """Linear-attention state: one slot per request (page size 1), a temporal and conv states.

    Each state is its own buffer ``(slots, layer_num, 1, *state_shape)``; a state with no
    elements (a model without it) has no buffer and is not registered.
    """

    family = "mamba"
    layout: str = _layout_name()
    layer_num: int = _dim("layer_num", maximum=MAX_LAYERS)
    slots: int = _dim("slots")
    temporal_shape: tuple[int, ...] = _shape_field("temporal_shape")
    temporal_itemsize: int = _dim("temporal_itemsize")
    conv_shapes: tuple[tuple[int, ...], ...] = _conv_shapes_field()
    conv_itemsize: int = _dim("conv_itemsize")

    @property
    def page_size(self) -> int:
        return 1

    @property
    def page_num(self) -> int:
        return self.slots

    def _states(self):
        yield "temporal", self.temporal_shape, self.temporal_itemsize
        for index, shape in enumerate(self.conv_shapes):
            yield f"conv{index}", shape, self.conv_itemsize

    def size_per_token_bytes(self) -> int:
        """Bytes of one slot (one request's state) across all layers and states."""
        return sum(self.layer_num * math.prod(s) * it for _, s, it in self._states())

    def buffers(self) -> tuple[BufferSpec, ...]:
        dims = {"L": self.layer_num, "S": self.slots}
        return tuple(
            self._spec(name, dims, itemsize, shape)
            for name, shape, itemsize in self._states()
            if math.prod(shape) > 0
        )


@value_class
class DeepSeekV4PagedLayout(_LayoutBase):
    """DeepSeek-V4 paged pool: ``item_bytes`` uint8 per page row per layer."""

    family = "deepseek_v4_paged"
    layout: str = _layout_name()
    layer_num: int = _dim("layer_num", maximum=MAX_LAYERS)
    page_num: int = _dim("page_num")
    item_bytes: int = _dim("item_bytes")

    def _row_bytes(self) -> int:
        return self.item_bytes

    def size_per_token_bytes(self) -> int:
        """Bytes of one page row across all layers (the pool's unit of allocation)."""
        return self.layer_num * self._row_bytes()

    def buffers(self) -> tuple[BufferSpec, ...]:
        dims = {"L": self.layer_num, "N": self.page_num, "R": self._row_bytes()}
        if self.layout == "layer_first":  # a list of per-layer buffers, each on its own
            return tuple(self._spec(f"layer{i}", dims, 1) for i in range(self.layer_num))
        return (self._spec("kv", dims, 1),)


@value_class
class DeepSeekV4StateLayout(DeepSeekV4PagedLayout):
    """DeepSeek-V4 state pool: ``state_page_bytes`` (ring size x slot bytes) per page per layer."""

    family = "deepseek_v4_state"
    item_bytes: int = attrs.field(init=False, default=0, repr=False)
    state_page_bytes: int = _dim("state_page_bytes")

    def _row_bytes(self) -> int:
        return self.state_page_bytes

    def params(self) -> dict:
        params = super().params()
        del params["item_bytes"]
        return params
