"""JSON codec: versioned, exact, and loading a tampered dump names the bad range or field."""

from __future__ import annotations

import copy
import json

import pytest

from hicache.errors import PlanError
from hicache.plan import Limits, MHALayout, from_jsonable, plan_pool, plan_registration, to_jsonable

MiB = 2**20


@pytest.fixture
def dump():
    plan = plan_registration(
        2500 * MiB, granularity_bytes=300 * MiB, limits=Limits(chunk_limit_bytes=2**30)
    )
    return json.loads(json.dumps(to_jsonable(plan)))


@pytest.fixture
def pool_dump():
    layout = MHALayout(
        "page_first", layer_num=4, head_num=2, head_dim=64, page_size=16, page_num=256, itemsize=2
    )
    return json.loads(json.dumps(to_jsonable(plan_pool(layout, Limits(chunk_limit_bytes=MiB)))))


def test_dump_has_schema_version_and_integer_bytes(dump):
    """The dump says what it is and carries sizes as integers."""
    assert dump["schema"] == "hicache.plan" and dump["schema_version"] == 1
    assert dump["ranges"][1] == {"offset": 900 * MiB, "size": 900 * MiB}


def test_pool_dump_buffers_carry_the_documented_keys(pool_dump):
    """Each buffer object has name, layout, shape, itemsize, nbytes, copy_unit_bytes, ranges."""
    buffer = pool_dump["buffers"][0]
    for key in ("name", "layout", "shape", "itemsize", "nbytes", "copy_unit_bytes", "ranges"):
        assert key in buffer
    assert from_jsonable(pool_dump) == from_jsonable(copy.deepcopy(pool_dump))


@pytest.mark.parametrize(
    "tamper, pattern",
    [
        (lambda d: d["ranges"][1].update(offset=800 * MiB), r"ranges\[1\] .* overlaps the previous range"),
        (lambda d: d["ranges"][1].update(offset=1000 * MiB), r"ranges\[1\] .* leaves a gap"),
        (lambda d: d["ranges"].pop(), r"ranges cover \[0, 1887436800\) but total_bytes is 2621440000"),
        (lambda d: (d["ranges"][0].update(size=1000 * MiB), d["ranges"][1].update(offset=1000 * MiB, size=800 * MiB)),
         r"ranges\[0\] .* ends at 1048576000, not a multiple of the copy unit 314572800"),
        (lambda d: (d["ranges"][0].update(size=1200 * MiB), d["ranges"][1].update(offset=1200 * MiB, size=600 * MiB)),
         r"ranges\[0\] .* over the cap of 1073741824"),
        (lambda d: d.update(schema_version=2), r"schema_version 2 is not supported"),
        (lambda d: d.update(schema="other"), r"\$\.schema must be 'hicache.plan'"),
        (lambda d: d.update(kind="nope"), r"\$\.kind must be"),
        (lambda d: d["ranges"][0].update(size="943718400"), r"ranges\[0\]\.size"),
        (lambda d: d["ranges"][0].update(size=943718400.0), r"ranges\[0\]\.size"),
        (lambda d: d.update(extra=1), r"extra"),
        (lambda d: d["limits"].update(chunk_limit_bytes=0), r"Limits\.chunk_limit_bytes must be positive, got 0 @ \$\.limits"),
        (lambda d: d["ranges"][2].update(size=-5), r"Range\.size must be positive, got -5"),
    ],
)
def test_tampered_dumps_fail_naming_the_bad_part(dump, tamper, pattern):
    """Overlapping, gapped, misaligned, oversized, mistyped or unknown content is refused."""
    tamper(dump)
    with pytest.raises(PlanError, match=pattern):
        from_jsonable(dump)


@pytest.mark.parametrize(
    "tamper, pattern",
    [
        (lambda d: d["buffers"][0].update(copy_unit_bytes=4096), r"\$\.buffers\[0\]\.copy_unit_bytes is 4096"),
        (lambda d: d["buffers"][0].update(shape=[1, 2]), r"\$\.buffers\[0\]\.shape"),
        (lambda d: d["params"].update(head_num=0), r"\$\.params: MHALayout\.head_num must be positive"),
        (lambda d: d.update(family="gqa"), r"\$\.family must be one of"),
        (lambda d: d["buffers"][0]["ranges"][3].update(offset=1), r"\$\.buffers\[0\]: ranges\[3\]"),
        (lambda d: d["buffers"].append(d["buffers"][0]), r"has 2 buffers; the layout has 1"),
    ],
)
def test_tampered_pool_dumps_fail_naming_the_bad_part(pool_dump, tamper, pattern):
    """A pool dump whose buffers disagree with its layout, or with the laws, is refused."""
    tamper(pool_dump)
    with pytest.raises(PlanError, match=pattern):
        from_jsonable(pool_dump)


def test_to_jsonable_refuses_other_objects():
    """to_jsonable of something that is not a plan is a PlanError."""
    with pytest.raises(PlanError, match="expected a RegistrationPlan, PoolPlan or CapacityPlan"):
        to_jsonable({"ranges": []})


def _capacity_dump():
    import json as _json

    from hicache.plan import PRESETS, plan_capacity

    plan = plan_capacity(PRESETS["llama-3.1-8b"], limits=Limits(chunk_limit_bytes=2**30), tp=2, host_gb=10,
                         host_memory_bytes=10**12, ranks_per_host=2)
    return _json.loads(_json.dumps(to_jsonable(plan)))


def _tamper(data, path, value):
    node = data
    for key in path[:-1]:
        node = node[key]
    node[path[-1]] = value
    return data


@pytest.mark.parametrize(
    "path, value",
    [
        (("extra",), 1),
        (("totals", "total_bytes"), 1),
        (("caps", "chunk_limit"), 2**31),
        (("budget", "ok"), False),
        (("size", "page_num"), 7),
        (("pools", 0, "plan", "buffers", 0, "step_bytes"), 4096),
        (("pools", 0, "plan", "buffers", 0, "alignment_bytes"), 4096),
        (("notes",), ["trust me"]),
    ],
    ids=lambda v: str(v),
)
def test_a_tampered_capacity_dump_is_refused(path, value):
    """The loader re-derives everything from the inputs: an unknown key or any derived field
    that differs is refused, naming it."""
    assert from_jsonable(_capacity_dump()) is not None
    with pytest.raises(PlanError):
        from_jsonable(_tamper(_capacity_dump(), path, value))


def test_an_absurd_layer_count_is_refused_before_any_work():
    """Refused by the layout's bound on layer_num, before any per-layer buffer is built."""
    data = _capacity_dump()
    data["model"]["facts"]["num_hidden_layers"] = 10**7
    with pytest.raises(PlanError, match="layer_num must be <= 10000"):
        from_jsonable(data)


@pytest.mark.parametrize(
    "path, value, pattern",
    [
        (("limits",), [1], r"\$\.limits must be an object, got \[1\]"),
        (("pools",), {}, r"\$\.pools must be a list, got \{\}"),
        (("pools", 0), {"name": "kv"}, r"\$\.pools\[0\] must be an object with 'name' and 'plan'"),
        (("pools", 0, "plan", "family"), "gqa", r"\$\.pools\[0\]\.plan: \$\.family must be one of"),
        (("pools", 0, "name"), "state", r"\$\.pools are \['state'\] but the inputs give \['kv'\]"),
    ],
    ids=lambda v: str(v),
)
def test_a_capacity_dump_of_the_wrong_shape_is_refused_naming_where(path, value, pattern):
    """A capacity plan whose limits are not an object, whose pools are not a list of
    ``{name, plan}``, whose pool plan is broken or whose pools are not the ones its inputs give
    is a PlanError naming the JSON path - what `hicache doctor --plan` and `apply --plan` show."""
    with pytest.raises(PlanError, match=pattern):
        from_jsonable(_tamper(_capacity_dump(), path, value))


@pytest.mark.parametrize("tamper, pattern", [
    (lambda d: d.update(params=[64]), r"\$\.params must be an object, got \[64\]"),
    (lambda d: d.update(stray=1), r"malformed plan: unknown keys \['stray'\] at \$"),
])
def test_a_pool_dump_of_the_wrong_shape_is_refused_naming_where(pool_dump, tamper, pattern):
    """A pool plan whose params are not an object, or with a key the format does not have."""
    tamper(pool_dump)
    with pytest.raises(PlanError, match=pattern):
        from_jsonable(pool_dump)


@pytest.mark.parametrize("data", [[1, 2], "plan", 3, None])
def test_a_plan_that_is_not_a_json_object_is_refused(data):
    """A list, a string, a number or null where a plan belongs: one PlanError naming the type."""
    with pytest.raises(PlanError, match=f"a plan must be a JSON object, got {type(data).__name__}"):
        from_jsonable(data)
