"""Layout descriptors of the latent-attention families: mla and its DSA indexer (dsa_indexer).

Owns their fields and buffers; the shape tables and shared checks are `_layouts`'.
Loaded on first use (`_layouts.LAYOUT_CLASSES`), so a plan of one family builds only its classes.
Pure: attrs, the standard library and hicache.errors only.
"""

from __future__ import annotations

import attrs

from hicache.errors import LayoutError
from hicache.plan._layouts import MAX_LAYERS, BufferSpec, _dim, _layout_name, _LayoutBase
from hicache.plan.checks import check_int
from hicache.plan._value import value_class


@value_class
class MLALayout(_LayoutBase):
    """Multi-head latent attention: one ``kv_cache_dim`` vector per token per layer."""

    family = "mla"
    layout: str = _layout_name()
    layer_num: int = _dim("layer_num", maximum=MAX_LAYERS)
    kv_cache_dim: int = _dim("kv_cache_dim")
    page_size: int = _dim("page_size")
    page_num: int = _dim("page_num")
    itemsize: int = _dim("itemsize")

    def size_per_token_bytes(self) -> int:
        return self.kv_cache_dim * self.itemsize * self.layer_num

    def buffers(self) -> tuple[BufferSpec, ...]:
        dims = {
            "L": self.layer_num, "C": self.kv_cache_dim, "P": self.page_size,
            "N": self.page_num, "S": self.page_num * self.page_size,
        }
        return (self._spec("kv", dims, self.itemsize),)


@value_class
class DSAIndexerLayout(_LayoutBase):
    """DeepSeek sparse-attention index keys (uint8): FP8 keys plus an fp32 scale per block.

    ``page_num`` is the number of index pages in the buffer (`dsa_indexer_pages` of an anchor pool).
    """

    family = "dsa_indexer"
    layout: str = _layout_name()
    layer_num: int = _dim("layer_num", maximum=MAX_LAYERS)
    index_head_dim: int = _dim("index_head_dim")
    page_size: int = _dim("page_size")
    page_num: int = _dim("page_num")
    quant_block_size: int = attrs.field(
        default=128,
        kw_only=True,
        validator=lambda i, a, v: check_int(LayoutError, "DSAIndexerLayout", "quant_block_size", v),
    )

    def bytes_per_token_per_layer(self) -> int:
        """FP8 key bytes plus 4 bytes of fp32 scale per quantisation block (128 + 4 for V3.2)."""
        return self.index_head_dim + self.index_head_dim // self.quant_block_size * 4

    def size_per_token_bytes(self) -> int:
        return self.bytes_per_token_per_layer() * self.layer_num

    def buffers(self) -> tuple[BufferSpec, ...]:
        dims = {
            "L": self.layer_num, "N": self.page_num,
            "T": self.page_size * self.bytes_per_token_per_layer(),
        }
        return (self._spec("index_k", dims, 1),)
