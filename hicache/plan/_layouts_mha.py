"""The layout descriptor of plain multi-head attention (family mha): K and V in one buffer.

Owns its fields and buffers (its K/V-split variants are `_layouts_kv_split`'s); the shape
tables and shared checks are `_layouts`'. Loaded on first use (`_layouts.LAYOUT_CLASSES`), so a
plan of one family builds only its classes.
Pure: attrs, the standard library and hicache.errors only.
"""

from __future__ import annotations

from hicache.plan._layouts import MAX_LAYERS, BufferSpec, _dim, _layout_name, _LayoutBase
from hicache.plan._value import value_class


@value_class
class MHALayout(_LayoutBase):
    """Multi-head attention, K and V in one buffer with a leading axis of 2."""

    family = "mha"
    layout: str = _layout_name()
    layer_num: int = _dim("layer_num", maximum=MAX_LAYERS)
    head_num: int = _dim("head_num")
    head_dim: int = _dim("head_dim")
    page_size: int = _dim("page_size")
    page_num: int = _dim("page_num")
    itemsize: int = _dim("itemsize")

    def _dims(self) -> dict[str, int]:
        return {
            "L": self.layer_num, "H": self.head_num, "D": self.head_dim, "P": self.page_size,
            "N": self.page_num, "S": self.page_num * self.page_size,
        }

    def size_per_token_bytes(self) -> int:
        """Bytes one token takes across all layers, K and V."""
        return 2 * self.layer_num * self.head_num * self.head_dim * self.itemsize

    def buffers(self) -> tuple[BufferSpec, ...]:
        return (self._spec("kv", self._dims(), self.itemsize),)
