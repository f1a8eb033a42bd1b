"""Layout descriptors of MHA whose K and V are apart: keys only (mha_k_only, the index-K of
sparse-attention models) and K and V of different head dims (asymmetric_mha).

Owns their fields and buffers; the shape tables and shared checks are `_layouts`'. Loaded on
first use (`_layouts.LAYOUT_CLASSES`), apart from plain MHA's: a plan of a plain MHA model builds
neither class.
Pure: attrs, the standard library and hicache.errors only.
"""

from __future__ import annotations

from hicache.plan._layouts import MAX_LAYERS, BufferSpec, _dim, _layout_name, _LayoutBase
from hicache.plan._layouts_mha import MHALayout
from hicache.plan._value import value_class


@value_class
class MHAKOnlyLayout(MHALayout):
    """MHA keys only (index-K of sparse-attention models): no V, no leading axis of 2."""

    family = "mha_k_only"

    def size_per_token_bytes(self) -> int:
        return self.layer_num * self.head_num * self.head_dim * self.itemsize

    def buffers(self) -> tuple[BufferSpec, ...]:
        return (self._spec("k", self._dims(), self.itemsize),)


@value_class
class AsymmetricMHALayout(_LayoutBase):
    """MHA whose K and V head dims differ: two buffers, ``k`` and ``v``."""

    family = "asymmetric_mha"
    layout: str = _layout_name()
    layer_num: int = _dim("layer_num", maximum=MAX_LAYERS)
    head_num: int = _dim("head_num")
    k_head_dim: int = _dim("k_head_dim")
    v_head_dim: int = _dim("v_head_dim")
    page_size: int = _dim("page_size")
    page_num: int = _dim("page_num")
    itemsize: int = _dim("itemsize")

    def size_per_token_bytes(self) -> int:
        return (self.k_head_dim + self.v_head_dim) * self.head_num * self.layer_num * self.itemsize

    def buffers(self) -> tuple[BufferSpec, ...]:
        dims = {
            "L": self.layer_num, "H": self.head_num, "P": self.page_size, "N": self.page_num,
            "S": self.page_num * self.page_size,
        }
        return (
            self._spec("k", {**dims, "D": self.k_head_dim}, self.itemsize),
            self._spec("v", {**dims, "D": self.v_head_dim}, self.itemsize),
        )
