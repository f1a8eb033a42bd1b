"""Layout descriptors: one per SGLang host-pool family -> the buffers it allocates.

Owns the shape and page-copy-unit rules of every family x layout (as data tables, from
../shared/reference/host-pool-layouts.md) and validation of the descriptors' fields. It knows
nothing of limits or chunking. Pure: attrs, the standard library and hicache.errors only.
"""

from __future__ import annotations

import math

import attrs

from hicache.errors import LayoutError
from hicache.plan.checks import MAX_BYTES, as_int, as_tuple, check_int, check_name

# The copy unit of a layout is the largest contiguous byte run one page copy touches; every such
# run starts a whole number of units from the base. Tables: layout -> (shape, unit), both as
# symbol tuples over the descriptor's dimensions ("2" is the K/V axis, "1" a unit axis).
_MHA = {
    "layer_first": (("2", "L", "S", "H", "D"), ("P", "H", "D")),
    "page_first": (("2", "S", "L", "H", "D"), ("P", "L", "H", "D")),
    "page_first_direct": (("2", "N", "L", "P", "H", "D"), ("P", "L", "H", "D")),
    "page_head": (("2", "N", "H", "P", "L", "D"), ("H", "P", "L", "D")),
}
_K_ONLY = {name: (shape[1:], unit) for name, (shape, unit) in _MHA.items() if name != "page_head"}
_ASYMMETRIC = {name: _K_ONLY[name] for name in ("page_first", "page_first_direct")}
_MLA = {
    "layer_first": (("L", "S", "1", "C"), ("P", "C")),
    "page_first": (("S", "L", "1", "C"), ("P", "L", "C")),
    "page_first_direct": (("N", "L", "P", "1", "C"), ("P", "L", "C")),
}
_DSA = {
    "layer_first": (("L", "N", "T"), ("T",)),
    "page_first": (("N", "L", "1", "T"), ("L", "T")),
    "page_first_direct": (("N", "L", "1", "T"), ("L", "T")),
}
_MAMBA = {name: (("S", "L", "1", "*"), ("L", "*")) for name in ("page_first", "page_first_direct")}
_DEEPSEEK_V4 = {
    "layer_first": (("N", "R"), ("R",)),  # one buffer per layer
    "page_first": (("N", "L", "R"), ("L", "R")),
    "page_first_direct": (("N", "L", "1", "R"), ("L", "R")),
}

#: family -> layout -> (shape symbols, copy-unit symbols); what SGLang supports, nothing more.
LAYOUT_RULES = {
    "mha": _MHA,
    "mha_k_only": _K_ONLY,
    "asymmetric_mha": _ASYMMETRIC,
    "mla": _MLA,
    "dsa_indexer": _DSA,
    "mamba": _MAMBA,
    "deepseek_v4_paged": _DEEPSEEK_V4,
    "deepseek_v4_state": _DEEPSEEK_V4,
}


@attrs.frozen
class BufferSpec:
    """One host buffer of a pool: ``shape`` elements of ``itemsize`` bytes, split on units."""

    name: str
    layout: str
    shape: tuple[int, ...] = attrs.field(converter=as_tuple)
    itemsize: int
    copy_unit_bytes: int

    @property
    def nbytes(self) -> int:
        """Total bytes: the product of the shape times the itemsize."""
        return math.prod(self.shape) * self.itemsize


def _evaluate(symbols, dims: dict[str, int], state_shape=()) -> tuple[int, ...]:
    out: list[int] = []
    for symbol in symbols:
        if symbol == "*":
            out.extend(state_shape)
        else:
            out.append(int(symbol) if symbol.isdigit() else dims[symbol])
    return tuple(out)


#: Far above any model (the largest have ~100-200 layers), low enough that a tampered plan or
#: config cannot make hicache build millions of per-layer buffers before refusing it.
MAX_LAYERS = 10_000


def _dim(name: str, *, minimum: int = 1, maximum: int = MAX_BYTES):
    def check(instance, attribute, value):
        check_int(LayoutError, type(instance).__name__, name, value, minimum=minimum, maximum=maximum)

    return attrs.field(kw_only=True, converter=as_int, validator=check)


def _layout_name():
    def check(instance, attribute, value):
        check_name(LayoutError, type(instance).__name__, "layout", value, instance.supported())

    return attrs.field(validator=check)


class _LayoutBase:
    """Shared behaviour: family rules lookup, buffer building, the size bound."""

    family: str = ""

    @classmethod
    def supported(cls) -> tuple[str, ...]:
        """The layout names SGLang supports for this family."""
        return tuple(LAYOUT_RULES[cls.family])

    def _spec(self, name, dims, itemsize, state_shape=()) -> BufferSpec:
        shape_symbols, unit_symbols = LAYOUT_RULES[self.family][self.layout]
        shape = _evaluate(shape_symbols, dims, state_shape)
        unit = math.prod(_evaluate(unit_symbols, dims, state_shape)) * itemsize
        spec = BufferSpec(name, self.layout, shape, itemsize, unit)
        if spec.nbytes > MAX_BYTES:
            raise LayoutError(
                f"{type(self).__name__}: buffer {name!r} of shape {shape} x {itemsize} B is "
                f"{spec.nbytes} bytes, past 2**63 - 1"
            )
        return spec

    def __attrs_post_init__(self) -> None:
        self.buffers()  # validates the total size eagerly, so a bad descriptor never exists

    @property
    def total_bytes(self) -> int:
        """Bytes of all buffers together."""
        return sum(spec.nbytes for spec in self.buffers())

    def params(self) -> dict:
        """The descriptor's fields as plain data (for JSON and display)."""
        return attrs.asdict(self, recurse=False)


@attrs.frozen
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


@attrs.frozen
class MHAKOnlyLayout(MHALayout):
    """MHA keys only (index-K of sparse-attention models): no V, no leading axis of 2."""

    family = "mha_k_only"

    def size_per_token_bytes(self) -> int:
        return self.layer_num * self.head_num * self.head_dim * self.itemsize

    def buffers(self) -> tuple[BufferSpec, ...]:
        return (self._spec("k", self._dims(), self.itemsize),)


@attrs.frozen
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


@attrs.frozen
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


def dsa_indexer_pages(anchor_tokens: int, page_size: int) -> int:
    """Index pages SGLang gives a DSA indexer beside an anchor pool of ``anchor_tokens`` token
    slots: ``(anchor_tokens + page_size + 1) // page_size`` - the one home of that rule (the
    capacity plan and both of the pool's constructor forms use it; issue #34)."""
    return (anchor_tokens + page_size + 1) // page_size


@attrs.frozen
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


@attrs.frozen
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


@attrs.frozen
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


@attrs.frozen
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


#: family name -> descriptor class (for JSON and the CLI).
LAYOUT_CLASSES = {
    cls.family: cls
    for cls in (
        MHALayout, MHAKOnlyLayout, AsymmetricMHALayout, MLALayout, DSAIndexerLayout,
        MambaLayout, DeepSeekV4PagedLayout, DeepSeekV4StateLayout,
    )
}
