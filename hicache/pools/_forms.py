"""The one place a host pool's SGLang constructor form is told apart (issue #34 item 2).

SGLang has called its host pools several ways: 0.5.23's device-buffer description first (an
`MHABufferInfo`, `MLABufferInfo`, `MLAHostAllocation`, `MambaStateBufferInfo`, a DSA
`HostPoolDecl`, a K-only pool's anchor host pool second), DeepSeek-V4's ``pool_name`` first, and
the older SGLang's device pool first. `FORMS` lists each family's forms in the order they are
tried, each with its detector and its named constructor; a family's SGLang-facing ``__init__``
asks `form_of` once and the pool records the `Form` in its geometry. A family whose forms differ
in their positional arguments (K-only, DSA, DeepSeek-V4) lists a builder per form in its
``builders``, each naming every argument of that form's signature; its ``__init__`` is `dispatch`,
which binds the call once against the builder of the form it is. What differs by form - which
device tensors a transfer copies, how layer ids map, how the pool is sized, which allocator
table and chunk setting apply - is a field of `Form`, read by the base; nothing else in
`hicache.pools` tests what the first argument is (tests/test_import_rules.py). May import
`_sglang_inputs` (the detectors' field tests) and errors only.
"""

from __future__ import annotations

import inspect
import types
from typing import Callable

import attrs

from hicache.errors import LayoutError
from hicache.pools._sglang_inputs import is_mamba_info, is_mha_info, is_mla_allocation, is_mla_info


@attrs.frozen
class Form:
    """One SGLang constructor form and how a pool built by it behaves.

    ``sglang``: whose constructor it is ("0.5.23" or "older": SGLang's `pool_host` package
    arrived in 0.5.23); ``constructor``: the family's named constructor for it; ``sizing``: how
    its pages are counted ("sglang-0.5.23": SGLang 0.5.23's rule, its padding page included;
    "ceil": the older ceiling; "anchor": the anchor pool's pages; "given": the caller's page
    count); ``own_device``: transfers copy the device tensors given at construction whatever
    pool the caller passes (SGLang's pools do); ``mapped_layers``: controller layer ids go through
    the description's map (targets, packed drafts; a layer it lacks copies nothing) instead of
    being pool-local ids checked against the range; ``server_chunk``: the server's own
    host-register chunk setting caps each call; ``sglang_allocators``: allocator names read as
    SGLang 0.5.23's table; ``byte_pages``: flat pages are raw bytes (0.5.23's Mamba format);
    ``allocator_only``: its pools hold no memory (``is_dummy``: MLA's `MLAHostAllocation`)."""

    name: str
    sglang: str
    constructor: str
    sizing: str
    own_device: bool = False
    mapped_layers: bool = False
    server_chunk: bool = False
    sglang_allocators: bool = False
    byte_pages: bool = False
    allocator_only: bool = False


_DESCRIBED = dict(sglang="0.5.23", own_device=True, mapped_layers=True, server_chunk=True, sglang_allocators=True)
DESCRIPTION = Form("description", constructor="from_buffer_info", sizing="sglang-0.5.23", **_DESCRIBED)
ALLOCATION = Form("allocation", constructor="from_allocation", sizing="sglang-0.5.23", allocator_only=True,
                  **_DESCRIBED)
STATE_DESCRIPTION = Form("state description", constructor="from_buffer_info", sizing="sglang-0.5.23",
                         byte_pages=True, **_DESCRIBED)
DECLARATION = Form("declaration", constructor="from_decl", sizing="anchor", **_DESCRIBED)
ANCHOR = Form("anchor", sglang="0.5.23", constructor="from_anchor", sizing="anchor")
POOL_NAME = Form("pool_name", sglang="0.5.23", constructor="from_pool_name", sizing="given", own_device=True)
DEVICE_POOL = Form("device pool", sglang="older", constructor="from_device_pool", sizing="ceil")


def _first(args, kwargs, *names):
    """The first argument, by position or under one of ``names`` (SGLang's HiSparse coordinator
    passes them by keyword)."""
    if args:
        return args[0]
    return next((kwargs[name] for name in names if kwargs.get(name) is not None), None)


def _second(args, kwargs, name):
    return args[1] if len(args) > 1 else kwargs.get(name)


def _is_anchor(pool) -> bool:
    return hasattr(pool, "page_num") and hasattr(pool, "page_size")


def _is_declaration(obj) -> bool:
    return hasattr(obj, "storage_info") and hasattr(obj, "device_pool")


Detector = Callable[[tuple, dict], bool]
#: family -> ((form, detector(args, kwargs)), ...) tried in order; the last detector always matches
FORMS: dict[str, tuple[tuple[Form, Detector], ...]] = {
    "mha": ((DESCRIPTION, lambda a, k: is_mha_info(_first(a, k, "buffer_info"))),
            (DEVICE_POOL, lambda a, k: True)),
    "mha_k_only": ((ANCHOR, lambda a, k: _is_anchor(_second(a, k, "anchor_host"))),
                   (DEVICE_POOL, lambda a, k: True)),
    "mla": ((ALLOCATION, lambda a, k: is_mla_allocation(_first(a, k, "buffer_info"))),
            (DESCRIPTION, lambda a, k: is_mla_info(_first(a, k, "buffer_info"))),
            (DEVICE_POOL, lambda a, k: True)),
    "mamba": ((STATE_DESCRIPTION, lambda a, k: is_mamba_info(_first(a, k, "buffer_info"))),
              (DEVICE_POOL, lambda a, k: True)),
    "dsa": ((DECLARATION, lambda a, k: _is_declaration(_first(a, k, "decl"))),
            (DEVICE_POOL, lambda a, k: True)),
    "deepseek_v4": ((POOL_NAME, lambda a, k: isinstance(_first(a, k, "pool_name"), str)),
                    (DEVICE_POOL, lambda a, k: True)),
}


def form_of(family: str, args: tuple, kwargs: dict) -> Form:
    """The form of a constructor call of ``family`` (``args``/``kwargs`` as the caller passed them)."""
    return next(form for form, detects in FORMS[family] if detects(args, kwargs))


def forms_of(family: str) -> tuple[Form, ...]:
    """Every form ``family`` serves, in the order `form_of` tries them."""
    return tuple(form for form, _ in FORMS[family])


def build_form(pool, form: Form, builder, args: tuple, kwargs: dict) -> None:
    """SGLang's call of ``pool``'s class in ``form``, bound once against that form's own signature
    - ``builder``'s after its first parameter (the pool), which names every argument - then
    built by ``builder(pool, *args, **kwargs)``. A call the signature refuses is Python's
    TypeError naming the pool and its form's constructor, before anything is built."""
    signature = inspect.signature(builder)
    own = signature.replace(parameters=list(signature.parameters.values())[1:])
    try:
        own.bind(*args, **kwargs)
    except TypeError as error:
        raise TypeError(f"{type(pool).__name__}.{form.constructor}(): {error}") from None
    builder(pool, *args, **kwargs)


def dispatch(pool, args: tuple, kwargs: dict) -> None:
    """The ``__init__`` of a family whose forms differ in their positional arguments: the call's
    form (`form_of`), then bound once against that form's builder (``builders``) and built."""
    cls = type(pool)
    form = form_of(cls.pool_family, args, kwargs)
    build_form(pool, form, cls.builders[form], args, kwargs)


def check_named(cls, wanted: str, args: tuple, kwargs: dict) -> None:
    """A named constructor (``cls.from_X(...)``) refuses a call of another form, naming both."""
    form = form_of(cls.pool_family, args, kwargs)
    if form.constructor != wanted:
        served = ", ".join(f.constructor for f in forms_of(cls.pool_family))
        raise LayoutError(f"{cls.__name__}.{wanted}() was called with the {form.name} form ({form.constructor}); "
                          f"{cls.__name__} serves {served}")


class NamedConstructors:
    """Mixed into every family: ``cls.from_<form>(...)`` for each form in `FORMS`, each the
    SGLang-facing constructor restricted to that one form, with that form's signature (its
    builder's where the family dispatches, else the family's ``__init__``'s).

    ``builders``: form -> a builder ``(pool, <that form's arguments, every one named>)``, for a
    family whose ``__init__`` is `dispatch`; empty where one ``__init__`` names every argument of
    every form (the first one tells them apart)."""

    pool_family: str = ""
    builders: dict = {}

    def __init_subclass__(cls, **kwargs):
        super().__init_subclass__(**kwargs)
        missing = [f.name for f in forms_of(cls.pool_family) if f not in cls.builders] if cls.builders else []
        if missing:
            raise TypeError(f"{cls.__name__}.builders has no builder for its forms {missing}")
        for form in forms_of(cls.pool_family) if cls.pool_family else ():
            if form.constructor not in cls.__dict__:
                setattr(cls, form.constructor, classmethod(_named(cls, form)))
        cls.__init__ = _named_for(cls, cls.__init__)
        if cls.builders:  # `dispatch`: what tools read is SGLang 0.5.23's form (the first), not *args
            cls.__init__ = _shown_as(cls.__init__, cls.builders[forms_of(cls.pool_family)[0]])


def _shown_as(init, builder):
    """A copy of ``init`` (a `dispatch` ``__init__``) whose signature, as `inspect` and tools
    read it, is ``builder``'s - the first form's, SGLang 0.5.23's, every argument named: one
    signature where Python has no overloads; the older form binds too, and its named
    constructor shows its own. A copy, so a class that inherits the function keeps its own."""
    shown = types.FunctionType(init.__code__, init.__globals__, init.__name__, init.__defaults__, init.__closure__)
    shown.__kwdefaults__, shown.__doc__, shown.__qualname__ = init.__kwdefaults__, init.__doc__, init.__qualname__
    shown.__dict__.update(init.__dict__)
    signature = inspect.signature(builder)
    first, *rest = signature.parameters.values()
    shown.__signature__ = signature.replace(parameters=[first.replace(name="self"), *rest])
    return shown


def _named_for(cls, init):
    """``init`` under ``cls``'s own name: a constructor shared by several families (the MHA
    pair's, a base's) then fails a misspelt keyword with Python's TypeError naming the pool the
    caller built (``AsymmetricMHATokenToKVPoolHost.__init__() got an unexpected keyword
    argument``), not the class that holds the code. The same code, defaults and closure."""
    qualname = f"{cls.__qualname__}.__init__"
    code = getattr(init, "__code__", None)
    if code is None or getattr(init, "__qualname__", None) == qualname == getattr(code, "co_qualname", qualname):
        return init
    if hasattr(code, "co_qualname"):  # 3.11+: the message may name the code's qualname
        code = code.replace(co_qualname=qualname)
    # Python 3.10's message names the function's __qualname__ (set below), its code has none
    named = types.FunctionType(code, init.__globals__, "__init__", init.__defaults__, init.__closure__)
    named.__kwdefaults__, named.__doc__, named.__qualname__ = init.__kwdefaults__, init.__doc__, qualname
    named.__dict__.update(init.__dict__)
    return named


def _named(owner, form: Form):
    """``owner.<form's constructor>``: the pool from that form only (another is a LayoutError
    naming both), its signature the form's own."""
    wanted = form.constructor

    def construct(cls, *args, **kwargs):
        check_named(cls, wanted, args, kwargs)
        return cls(*args, **kwargs)

    construct.__name__, construct.__qualname__ = wanted, f"{owner.__qualname__}.{wanted}"
    construct.__doc__ = f"The pool from SGLang's {form.name} form only (else LayoutError)."
    signature = inspect.signature(owner.builders.get(form, owner.__init__))  # (pool or self, the form's arguments)
    first, *rest = signature.parameters.values()
    construct.__signature__ = signature.replace(parameters=[first.replace(name="cls"), *rest])  # bound: cls drops
    return construct
