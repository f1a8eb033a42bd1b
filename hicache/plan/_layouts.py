"""Layout descriptors: one per SGLang host-pool family -> the buffers it allocates.

Owns the shape and page-copy-unit rules of every family x layout (as data tables, from
../shared/reference/host-pool-layouts.md), the descriptors' shared base and field checks, and
which module holds each family's class (`_layouts_mha`, `_layouts_kv_split`, `_layouts_mla`,
`_layouts_state`, loaded on first use). It knows nothing of limits or chunking.
Pure: attrs, the standard library and hicache.errors only.
"""

from __future__ import annotations

import math
from collections.abc import Mapping

import attrs

from hicache.errors import LayoutError
from hicache.plan.checks import MAX_BYTES, as_int, as_tuple, check_int, check_name
from hicache.plan._value import value_class

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


@value_class
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


def dsa_indexer_pages(anchor_tokens: int, page_size: int) -> int:
    """Index pages SGLang gives a DSA indexer beside an anchor pool of ``anchor_tokens`` token
    slots: ``(anchor_tokens + page_size + 1) // page_size`` - the one home of that rule (the
    capacity plan and both of the pool's constructor forms use it; issue #34)."""
    return (anchor_tokens + page_size + 1) // page_size



#: family -> (module, class name) of its descriptor; the module is imported on first lookup.
_FAMILY_HOMES = {
    "mha": ("hicache.plan._layouts_mha", "MHALayout"),
    "mha_k_only": ("hicache.plan._layouts_kv_split", "MHAKOnlyLayout"),
    "asymmetric_mha": ("hicache.plan._layouts_kv_split", "AsymmetricMHALayout"),
    "mla": ("hicache.plan._layouts_mla", "MLALayout"),
    "dsa_indexer": ("hicache.plan._layouts_mla", "DSAIndexerLayout"),
    "mamba": ("hicache.plan._layouts_state", "MambaLayout"),
    "deepseek_v4_paged": ("hicache.plan._layouts_state", "DeepSeekV4PagedLayout"),
    "deepseek_v4_state": ("hicache.plan._layouts_state", "DeepSeekV4StateLayout"),
}
_CLASS_HOMES = {name: home for home, name in _FAMILY_HOMES.values()}


def _load(home: str, name: str):
    import importlib

    return getattr(importlib.import_module(home), name)


class _LayoutClasses(Mapping):
    """family name -> descriptor class, read-only; a family's module loads on its first lookup
    (issue #35 item 4: `hicache plan` of an MHA model builds no MLA or state classes)."""

    def __getitem__(self, family: str):
        home = _FAMILY_HOMES[family]  # KeyError for an unknown family, as a dict's
        return _load(*home)

    def __contains__(self, family) -> bool:
        return family in _FAMILY_HOMES  # without loading the family's module

    def __iter__(self):
        return iter(_FAMILY_HOMES)

    def __len__(self) -> int:
        return len(_FAMILY_HOMES)

    def __repr__(self) -> str:
        return f"LAYOUT_CLASSES({', '.join(_FAMILY_HOMES)})"


#: family name -> descriptor class (for JSON and the CLI).
LAYOUT_CLASSES = _LayoutClasses()


def is_layout(value) -> bool:
    """Whether ``value`` is an instance of exactly one of the families' descriptor classes."""
    family = getattr(type(value), "family", None)
    return family in _FAMILY_HOMES and LAYOUT_CLASSES[family] is type(value)


def __getattr__(name: str):
    """The descriptor classes by name (``from hicache.plan._layouts import MLALayout``), loaded lazily."""
    home = _CLASS_HOMES.get(name)
    if home is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = _load(home, name)
    globals()[name] = value
    return value
