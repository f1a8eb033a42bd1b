"""Views into host buffers, derived from the layout tables in hicache.plan.

Owns one question: for buffer symbols like ``("2", "N", "H", "P", "L", "D")``, which view holds
layer ``l`` of K (or V) as ``(pages, tokens_per_page, *item)``, and which slice holds page ``p``.
Deriving both from the same tables the planner uses keeps transfers and plans in agreement.
"""

from __future__ import annotations

from hicache.plan import LAYOUT_RULES

_TOKEN_AXES = ("S", "N", "P")


def buffer_symbols(family: str, layout: str) -> tuple[str, ...]:
    """The shape symbols of a family's buffer in ``layout``."""
    return LAYOUT_RULES[family][layout][0]


def _expand(symbols, ndim):
    # "*" (Mamba state shape) stands for the trailing dims.
    out = []
    for symbol in symbols:
        if symbol == "*":
            out.extend(["*"] * (ndim - len(symbols) + 1))
        else:
            out.append(symbol)
    return out


def layer_token_view(tensor, family: str, layout: str, layer: int, kv: int | None, page_size: int):
    """Layer ``layer`` (and K/V half ``kv``) of ``tensor`` as ``(pages, page_size, *item)``.

    For page-row layouts (DSA ``T``, DeepSeek-V4 ``R``) the result is ``(pages, *row)``.
    """
    symbols = _expand(buffer_symbols(family, layout), tensor.dim())
    view, names = tensor, list(symbols)
    for symbol, index in (("2", kv), ("L", layer)):
        if symbol in names:
            axis = names.index(symbol)
            view = view.select(axis, index)
            del names[axis]
    if "S" in names:  # a token axis: split into (pages, page_size)
        axis = names.index("S")
        view = view.unflatten(axis, (-1, page_size))
        names[axis : axis + 1] = ["N", "P"]
    front = [names.index(s) for s in ("N", "P") if s in names]
    rest = [i for i in range(len(names)) if i not in front]
    return view.permute(*front, *rest)


def page_slice(tensor, family: str, layout: str, page: int, page_size: int):
    """The part of ``tensor`` that holds page ``page`` (all layers, K and V)."""
    symbols = _expand(buffer_symbols(family, layout), tensor.dim())
    if "N" in symbols:
        return tensor.narrow(symbols.index("N"), page, 1)
    axis = symbols.index("S")
    return tensor.narrow(axis, page * page_size, page_size)


def page_axis(tensor, family: str, layout: str) -> tuple[int, bool]:
    """``(axis, by_page)``: the axis `page_slice` narrows - a page axis (``by_page``) or the
    token axis (narrowed by ``page_size`` tokens)."""
    symbols = _expand(buffer_symbols(family, layout), tensor.dim())
    if "N" in symbols:
        return symbols.index("N"), True
    return symbols.index("S"), False
