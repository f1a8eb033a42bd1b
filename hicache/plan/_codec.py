"""JSON codec for plans: `to_jsonable` / `from_jsonable`, schema-versioned, exact round trip.

Owns the wire format (integer bytes, plain lists and dicts) and strict loading: a local cattrs
converter refuses coercions ("5" or 5.0 for an int), unknown keys and unknown schemas, and every
loaded plan is rebuilt through the validating constructors, so a tampered dump fails naming the
bad range or field. Pure: attrs, cattrs, the standard library and hicache.errors only.
"""

from __future__ import annotations

from decimal import Decimal

import functools
import types

import attrs

from hicache.errors import HicacheError, LayoutError, PlanError
from hicache.plan._capacity_plan import CapacityPlan, plan_capacity
from hicache.plan._layouts import LAYOUT_CLASSES
from hicache.plan._models import ModelSpec
from hicache.plan._limits import Limits
from hicache.plan._planner import RegistrationPlan
from hicache.plan._pool import BufferPlan, PoolPlan
from hicache.plan._range import Range
from hicache.plan._value import value_class

SCHEMA = "hicache.plan"
SCHEMA_VERSION = 1


def _strict_int(value, _type) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"expected an integer, got {value!r}")
    return value


def _strict_str(value, _type) -> str:
    if not isinstance(value, str):
        raise TypeError(f"expected a string, got {value!r}")
    return value


@functools.cache
def _converter():
    # cattrs is imported on first load only: writing plans (the CLI's path) never needs it.
    import cattrs

    converter = cattrs.Converter(forbid_extra_keys=True)
    converter.register_structure_hook(int, _strict_int)
    converter.register_structure_hook(str, _strict_str)
    return converter


@functools.cache
def _wire():
    """The wire schemas, built on first load (attrs class creation costs start-up time)."""

    @value_class
    class _RangeWire:
        offset: int
        size: int


    @value_class
    class _PlanWire:
        total_bytes: int
        granularity_bytes: int | None
        step_bytes: int
        alignment_bytes: int | None
        ranges: list[_RangeWire]
        notes: list[str]


    @value_class
    class _BufferWire:
        name: str
        layout: str
        shape: list[int]
        itemsize: int
        nbytes: int
        copy_unit_bytes: int
        step_bytes: int
        alignment_bytes: int | None
        ranges: list[_RangeWire]
        notes: list[str]


    @value_class
    class _ModelWire:
        name: str
        source: str
        kind: str
        facts: dict


    @value_class
    class _InputsWire:
        tp: int
        page_size: int
        layout: str
        kv_dtype: str
        mamba_slots: int
        host_bytes: int | None
        device_tokens: int | None
        host_to_device_ratio: str | None
        ranks_per_host: int | None
        host_memory_bytes: int | None
        reserve_bytes: int

    names = dict(locals())
    for cls in (_RangeWire, _PlanWire, _BufferWire, _ModelWire, _InputsWire):
        attrs.resolve_types(cls, globals(), names)  # string annotations name local classes
    return types.SimpleNamespace(
        Range=_RangeWire, Plan=_PlanWire, Buffer=_BufferWire, Model=_ModelWire, Inputs=_InputsWire
    )


def _limits_jsonable(limits: Limits) -> dict:
    return attrs.asdict(limits)


def _ranges_jsonable(ranges) -> list[dict]:
    return [{"offset": r.offset, "size": r.size} for r in ranges]


def _plan_fields(plan: RegistrationPlan) -> dict:
    return {
        "step_bytes": plan.step_bytes,
        "alignment_bytes": plan.alignment_bytes,
        "ranges": _ranges_jsonable(plan.ranges),
        "notes": list(plan.notes),
    }


def _capacity_jsonable(plan: CapacityPlan, head: dict) -> dict:
    budget = None
    if plan.budget is not None:
        budget = {**attrs.asdict(plan.budget), "ok": plan.budget.ok}
    return {
        **head,
        "kind": "capacity",
        "model": {
            "name": plan.model.name, "source": plan.model.source, "kind": plan.model.kind,
            "facts": dict(plan.model.facts),
        },
        "inputs": {
            "tp": plan.tp, "page_size": plan.page_size, "layout": plan.layout,
            "kv_dtype": plan.kv_dtype, "mamba_slots": plan.mamba_slots,
            "host_bytes": plan.host_bytes, "device_tokens": plan.device_tokens,
            "host_to_device_ratio": plan.host_to_device_ratio,
            "ranks_per_host": plan.ranks_per_host, "host_memory_bytes": plan.host_memory_bytes,
            "reserve_bytes": plan.reserve_bytes,
        },
        "limits": _limits_jsonable(plan.limits),
        "caps": plan.limits.caps(),
        "binding_caps": list(plan.limits.binding_caps()),
        "size": {
            "tokens": plan.size.tokens, "page_size": plan.size.page_size,
            "page_num": plan.size.page_num, "size_per_token_bytes": plan.size.size_per_token_bytes,
        },
        "pools": [{"name": p.name, "plan": to_jsonable(p.plan)} for p in plan.pools],
        "totals": {
            "total_bytes": plan.total_bytes, "call_count": plan.call_count,
            "largest_call_bytes": plan.largest_call_bytes,
        },
        "budget": budget,
        "notes": list(plan.notes),
    }


def to_jsonable(plan: RegistrationPlan | PoolPlan | CapacityPlan) -> dict:
    """A plan as plain JSON data (dicts, lists, ints, strings) with a schema version.

    Serialise with ``json.dumps(..., sort_keys=True)`` for dumps that diff cleanly.
    """
    head = {"schema": SCHEMA, "schema_version": SCHEMA_VERSION}
    if isinstance(plan, CapacityPlan):
        return _capacity_jsonable(plan, head)
    if isinstance(plan, RegistrationPlan):
        return {
            **head,
            "kind": "registration",
            "total_bytes": plan.total_bytes,
            "granularity_bytes": plan.granularity_bytes,
            "limits": _limits_jsonable(plan.limits),
            **_plan_fields(plan),
        }
    if isinstance(plan, PoolPlan):
        params = plan.layout.params()
        return {
            **head,
            "kind": "pool",
            "family": plan.layout.family,
            "layout": params.pop("layout"),
            "params": params,
            "limits": _limits_jsonable(plan.limits),
            "buffers": [
                {
                    "name": b.spec.name,
                    "layout": b.spec.layout,
                    "shape": list(b.spec.shape),
                    "itemsize": b.spec.itemsize,
                    "nbytes": b.spec.nbytes,
                    "copy_unit_bytes": b.spec.copy_unit_bytes,
                    **_plan_fields(b.plan),
                }
                for b in plan.buffers
            ],
        }
    raise PlanError(
        f"to_jsonable: expected a RegistrationPlan, PoolPlan or CapacityPlan, got {plan!r}"
    )


def _describe(error: BaseException, type_) -> str:
    # Our own validators' messages already name the field and value; keep them verbatim.
    if isinstance(error, HicacheError):
        return str(error)
    from cattrs.v import format_exception

    return format_exception(error, type_)


def _structure(data, cls, where: str):
    import cattrs

    try:
        return _converter().structure(data, cls)
    except cattrs.BaseValidationError as error:
        problems = "; ".join(
            cattrs.transform_error(error, path=where, format_exception=_describe)
        )
        raise PlanError(f"malformed plan: {problems}") from None


def _build(where: str, factory, *args, **kwargs):
    try:
        return factory(*args, **kwargs)
    except (HicacheError, TypeError) as error:
        raise PlanError(f"{where}: {error}") from error


def _limits(data: dict) -> Limits:
    if not isinstance(data, dict):
        raise PlanError(f"$.limits must be an object, got {data!r}")
    return _structure(data, Limits, "$.limits")


def _ranges(wire_ranges) -> tuple[Range, ...]:
    return tuple(Range(r.offset, r.size) for r in wire_ranges)


def _plan_from(where, total, granularity, wire, limits) -> RegistrationPlan:
    ranges = _build(where, _ranges, wire.ranges)
    return _build(
        where, RegistrationPlan, total, granularity, wire.step_bytes, limits, ranges,
        tuple(wire.notes), wire.alignment_bytes,
    )


def from_jsonable(data: dict) -> RegistrationPlan | PoolPlan:
    """Rebuild a plan from ``to_jsonable`` output, re-validating everything.

    Raises ``PlanError`` naming the bad field or range: unknown schema or version, unknown or
    missing keys, overlapping, gapped, misaligned or oversized ranges, buffers that do not
    match their layout.
    """
    if not isinstance(data, dict):
        raise PlanError(f"a plan must be a JSON object, got {type(data).__name__}")
    if data.get("schema") != SCHEMA:
        raise PlanError(f"$.schema must be {SCHEMA!r}, got {data.get('schema')!r}")
    if data.get("schema_version") != SCHEMA_VERSION:
        raise PlanError(
            f"$.schema_version {data.get('schema_version')!r} is not supported "
            f"(this hicache reads {SCHEMA_VERSION})"
        )
    body = {k: v for k, v in data.items() if k not in ("schema", "schema_version", "kind")}
    kind = data.get("kind")
    if kind == "registration":
        limits = _limits(body.pop("limits", None))
        total, granularity = body.pop("total_bytes", None), body.pop("granularity_bytes", None)
        wire = _structure(
            {**body, "total_bytes": total, "granularity_bytes": granularity}, _wire().Plan, "$"
        )
        return _plan_from("$", wire.total_bytes, wire.granularity_bytes, wire, limits)
    if kind == "pool":
        return _pool_from(body)
    if kind == "capacity":
        return _capacity_from(body)
    raise PlanError(f"$.kind must be 'registration', 'pool' or 'capacity', got {kind!r}")


_CAPACITY_KEYS = {"schema", "schema_version", "kind", "model", "inputs", "limits", "pools", "size", "totals",
                  "caps", "binding_caps", "budget", "notes", "cap_sources"}
_DERIVED = ("size", "totals", "caps", "binding_caps", "budget", "notes")


def _capacity_from(body: dict) -> CapacityPlan:
    """Recompute the capacity plan from its inputs and require the dump to match it: every
    derived field (size, totals, caps, budget, notes, each pool) and no unknown key."""
    unknown = set(body) - _CAPACITY_KEYS
    if unknown:
        raise PlanError(f"malformed capacity plan: unknown keys {sorted(unknown)} at $")
    model = _structure(body.get("model"), _wire().Model, "$.model")
    inputs = _structure(body.get("inputs"), _wire().Inputs, "$.inputs")
    limits = _limits(body.get("limits"))
    pools = body.get("pools")
    if not isinstance(pools, list):
        raise PlanError(f"$.pools must be a list, got {pools!r}")
    loaded = []
    for index, pool in enumerate(pools):
        if not isinstance(pool, dict) or set(pool) != {"name", "plan"}:
            raise PlanError(f"$.pools[{index}] must be an object with 'name' and 'plan'")
        try:
            loaded.append((pool["name"], from_jsonable(pool["plan"])))
        except PlanError as error:
            raise PlanError(f"$.pools[{index}].plan: {error}") from error
    host_gb = None if inputs.host_bytes is None else Decimal(inputs.host_bytes) / 10**9
    try:
        rebuilt = plan_capacity(
            ModelSpec(model.name, model.source, model.kind, model.facts), limits=limits,
            tp=inputs.tp, page_size=inputs.page_size, layout=inputs.layout,
            kv_dtype=inputs.kv_dtype, host_gb=host_gb, device_tokens=inputs.device_tokens,
            host_to_device_ratio=inputs.host_to_device_ratio, mamba_slots=inputs.mamba_slots,
            ranks_per_host=inputs.ranks_per_host, host_memory_bytes=inputs.host_memory_bytes,
            reserve_bytes=inputs.reserve_bytes,
        )
    except (HicacheError, TypeError) as error:
        raise PlanError(f"$.inputs: {error}") from error
    names = [pool.name for pool in rebuilt.pools]
    if [name for name, _ in loaded] != names:
        raise PlanError(f"$.pools are {[n for n, _ in loaded]} but the inputs give {names}")
    for index, ((name, plan), pool) in enumerate(zip(loaded, rebuilt.pools)):
        if plan != pool.plan:
            raise PlanError(f"$.pools[{index}] ({name}) does not match the plan its inputs give")
    derived = to_jsonable(rebuilt)
    for key in _DERIVED:
        if body.get(key) != derived.get(key):
            raise PlanError(f"$.{key} is {body.get(key)!r} but the inputs give {derived.get(key)!r}")
    return rebuilt


def _pool_from(body: dict) -> PoolPlan:
    unknown = set(body) - {"family", "layout", "params", "limits", "buffers"}
    if unknown:
        raise PlanError(f"malformed plan: unknown keys {sorted(unknown)} at $")
    family = body.get("family")
    if family not in LAYOUT_CLASSES:
        raise PlanError(f"$.family must be one of {', '.join(LAYOUT_CLASSES)}, got {family!r}")
    params = body.get("params")
    if not isinstance(params, dict):
        raise PlanError(f"$.params must be an object, got {params!r}")
    try:
        layout = LAYOUT_CLASSES[family](body.get("layout"), **params)
    except (LayoutError, TypeError) as error:
        raise PlanError(f"$.params: {error}") from error
    limits = _limits(body.get("limits"))
    wires = _structure(body.get("buffers"), list[_wire().Buffer], "$.buffers")
    specs = layout.buffers()
    if len(wires) != len(specs):
        raise PlanError(f"$.buffers has {len(wires)} buffers; the layout has {len(specs)}")
    buffers = []
    for index, (wire, spec) in enumerate(zip(wires, specs)):
        where = f"$.buffers[{index}]"
        for field in ("name", "layout", "itemsize", "nbytes", "copy_unit_bytes"):
            if getattr(wire, field) != getattr(spec, field):
                raise PlanError(
                    f"{where}.{field} is {getattr(wire, field)!r} but the layout gives "
                    f"{getattr(spec, field)!r}"
                )
        if tuple(wire.shape) != spec.shape:
            raise PlanError(f"{where}.shape is {wire.shape} but the layout gives {list(spec.shape)}")
        plan = _plan_from(where, spec.nbytes, spec.copy_unit_bytes, wire, limits)
        buffers.append(BufferPlan(spec, plan))
    return PoolPlan(layout, limits, tuple(buffers))
