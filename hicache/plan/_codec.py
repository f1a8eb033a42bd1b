"""JSON codec for plans: `to_jsonable` / `from_jsonable`, schema-versioned, exact round trip.

Owns the wire format (integer bytes, plain lists and dicts) and strict loading: a local cattrs
converter refuses coercions ("5" or 5.0 for an int), unknown keys and unknown schemas, and every
loaded plan is rebuilt through the validating constructors, so a tampered dump fails naming the
bad range or field. Pure: attrs, cattrs, the standard library and hicache.errors only.
"""

from __future__ import annotations

import attrs
import cattrs
from cattrs.v import format_exception

from hicache.errors import HicacheError, LayoutError, PlanError
from hicache.plan._layouts import LAYOUT_CLASSES
from hicache.plan._limits import Limits
from hicache.plan._planner import RegistrationPlan
from hicache.plan._pool import BufferPlan, PoolPlan
from hicache.plan._range import Range

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


def _make_converter() -> cattrs.Converter:
    converter = cattrs.Converter(forbid_extra_keys=True)
    converter.register_structure_hook(int, _strict_int)
    converter.register_structure_hook(str, _strict_str)
    return converter


_CONVERTER = _make_converter()


@attrs.frozen
class _RangeWire:
    offset: int
    size: int


@attrs.frozen
class _PlanWire:
    total_bytes: int
    granularity_bytes: int | None
    step_bytes: int
    alignment_bytes: int | None
    ranges: list[_RangeWire]
    notes: list[str]


@attrs.frozen
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


def to_jsonable(plan: RegistrationPlan | PoolPlan) -> dict:
    """A plan as plain JSON data (dicts, lists, ints, strings) with a schema version.

    Serialise with ``json.dumps(..., sort_keys=True)`` for dumps that diff cleanly.
    """
    head = {"schema": SCHEMA, "schema_version": SCHEMA_VERSION}
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
    raise PlanError(f"to_jsonable: expected a RegistrationPlan or PoolPlan, got {plan!r}")


def _describe(error: BaseException, type_) -> str:
    # Our own validators' messages already name the field and value; keep them verbatim.
    if isinstance(error, HicacheError):
        return str(error)
    return format_exception(error, type_)


def _structure(data, cls, where: str):
    try:
        return _CONVERTER.structure(data, cls)
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
            {**body, "total_bytes": total, "granularity_bytes": granularity}, _PlanWire, "$"
        )
        return _plan_from("$", wire.total_bytes, wire.granularity_bytes, wire, limits)
    if kind == "pool":
        return _pool_from(body)
    raise PlanError(f"$.kind must be 'registration' or 'pool', got {kind!r}")


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
    wires = _structure(body.get("buffers"), list[_BufferWire], "$.buffers")
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
