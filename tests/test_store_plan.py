"""The node store's arena geometry and header (hicache.plan, pure): for every geometry the
regions tile the file without overlap, each slot's record is one cache line and its data lies
inside the file, the slot count is the most that fit, and the header round-trips exactly while a
flipped byte, another schema or a geometry the planner would not make is refused by name."""

from __future__ import annotations

import struct

import pytest
from hypothesis import example, given
from hypothesis import strategies as st
from strategies import store_geometries

from hicache.errors import ArenaError, ArenaGeometryError, PlanError
from hicache.plan import plan_store
from hicache.plan.store_format import check_label, fitted_label
from hicache.plan._store import (
    CREATING,
    HEADER_BYTES,
    NAMESPACE_BYTES,
    NAMESPACE_ENTRIES,
    RECORD,
    RECORD_BYTES,
    check_geometry,
    decode_header,
    encode_header,
)


@given(store_geometries())
@example((77824, 64, 4096))
def test_regions_tile_the_arena_in_order_and_the_slot_count_is_maximal(geometry):
    """Header < namespace table < index < data, all inside the file, data aligned to the
    backing's page and every slot a cache-line stride apart; one slot more would not fit."""
    total, slot_bytes, unit = geometry
    plan = plan_store(total, slot_bytes=slot_bytes, unit_bytes=unit)
    assert plan.total_bytes % unit == 0 and plan.total_bytes <= total
    assert HEADER_BYTES <= plan.namespace_offset
    assert plan.namespace_offset + NAMESPACE_ENTRIES * NAMESPACE_BYTES <= plan.index_offset
    assert plan.index_offset + plan.slots * RECORD_BYTES <= plan.data_offset
    assert plan.data_offset % unit == 0 and plan.slot_stride % 64 == 0 and plan.slot_stride >= slot_bytes
    assert plan.slot_offset(plan.slots - 1) + plan.slot_bytes <= plan.total_bytes
    more = plan.slots + 1
    data_offset = -(-(plan.index_offset + more * RECORD_BYTES) // unit) * unit
    assert data_offset + more * plan.slot_stride > plan.total_bytes


@given(store_geometries())
def test_the_header_round_trips_and_any_flipped_byte_is_refused(geometry):
    """decode(encode(plan)) is the plan and its label; each single flipped byte of the header
    is an ArenaError (magic or CRC), never another geometry."""
    total, slot_bytes, unit = geometry
    plan = plan_store(total, slot_bytes=slot_bytes, unit_bytes=unit)
    raw = encode_header(plan, label="node-a")
    assert decode_header(raw) == (plan, "node-a")
    for at in range(0, len(raw), 7):
        flipped = bytearray(raw)
        flipped[at] ^= 0x40
        with pytest.raises(ArenaError):
            decode_header(bytes(flipped))


@pytest.mark.parametrize("raw", [b"", CREATING, CREATING + bytes(200)], ids=["empty", "mark", "mark-and-zeros"])
def test_an_arena_its_creator_has_not_finished_is_told_apart_from_a_foreign_file(raw):
    """A file still marked by its creator (or empty) is refused as not finished - a creator still
    pre-faulting, or one that died - naming what makes it afresh; other bytes are no arena."""
    with pytest.raises(ArenaError, match="arena a: not finished .*`hicache store create` makes it afresh"):
        decode_header(raw, where="arena a")
    with pytest.raises(ArenaError, match="not a hicache store arena"):
        decode_header(b"precious" + bytes(200), where="arena a")


def test_a_record_is_one_cache_line():
    """The record format fits the 64 bytes a slot's index entry has."""
    assert RECORD.size <= RECORD_BYTES == 64


def _header_of_schema(schema: int) -> bytes:
    """A header of ``schema`` with a valid CRC."""
    import zlib

    raw = bytearray(encode_header(plan_store(64 << 20, slot_bytes=4096), label=""))
    struct.pack_into("<I", raw, 8, schema)
    raw[-4:] = struct.pack("<I", zlib.crc32(bytes(raw[:-4])))
    return bytes(raw)


def test_another_schema_is_a_geometry_error_naming_it():
    """A header of a future schema (its CRC valid) says which schema it is."""
    with pytest.raises(ArenaGeometryError, match="schema 3"):
        decode_header(_header_of_schema(3))


def test_an_arena_of_the_old_page_checksum_is_refused_naming_its_sum_and_the_drop():
    """Schema 1's arenas carry the checksum that let bit flips through (issue #51): refused,
    naming that sum and `hicache store drop`; this hicache writes schema 2."""
    assert decode_header(encode_header(plan_store(64 << 20, slot_bytes=4096), label="x"))[1] == "x"
    assert struct.unpack_from("<I", encode_header(plan_store(64 << 20, slot_bytes=4096), label=""), 8) == (2,)
    with pytest.raises(ArenaGeometryError, match=r"schema 1.*fletcher4-folded.*hicache store drop"):
        decode_header(_header_of_schema(1))


def test_a_header_with_regions_its_geometry_would_not_make_is_corrupt():
    """Geometry fields the planner would not produce from the header's own numbers (CRC
    recomputed, as a forger would) are refused naming the regions."""
    import zlib

    plan = plan_store(64 << 20, slot_bytes=4096)
    raw = bytearray(encode_header(plan, label=""))
    struct.pack_into("<Q", raw, 8 + 4 + 4 + 8 + 8 + 8, plan.slots + 1)  # slots
    raw[-4:] = struct.pack("<I", zlib.crc32(bytes(raw[:-4])))
    with pytest.raises(ArenaError, match="regions"):
        decode_header(bytes(raw))


def test_the_arena_wide_counters_lie_where_every_process_looks_for_them():
    """The counters are words of the header page after its fields, one after another from
    COUNTERS_OFFSET, in COUNTERS' order - a format every attached process shares (a process of
    another layout would add its counts into another's words)."""
    from hicache.plan._store import COUNTERS, COUNTERS_OFFSET, HEADER_LENGTH, counter_offset

    offsets = [counter_offset(name) for name in COUNTERS]
    assert offsets == [COUNTERS_OFFSET + 8 * i for i in range(len(COUNTERS))] and COUNTERS_OFFSET == 1024
    assert HEADER_LENGTH <= offsets[0] and offsets[-1] + 8 <= HEADER_BYTES


def test_a_header_naming_no_backing_this_hicache_knows_is_corrupt():
    """A backing index past the known backings (CRC recomputed) is an ArenaError naming it, not
    an IndexError."""
    import zlib

    raw = bytearray(encode_header(plan_store(64 << 20, slot_bytes=4096), label=""))
    struct.pack_into("<B", raw, 8 + 4 + 4 + 8 + 8 + 8 + 8 + 8 + 4, 7)  # backing
    raw[-4:] = struct.pack("<I", zlib.crc32(bytes(raw[:-4])))
    with pytest.raises(ArenaError, match="corrupt header .backing 7"):
        decode_header(bytes(raw))


@given(st.text(max_size=200))
@example("/models/huggingface/hub/models--meta-llama--Llama-3.1-70B-Instruct/snapshots/1605565b47bb9346c5515c34102e054115b4f98b")
@example("é" * 33)
@example("\ud800x\n")
@example("a..." * 40)
def test_a_fitted_label_is_one_the_header_takes_and_keeps_what_fits(text):
    """`fitted_label` of any text (a served model's name) is a label `check_label` takes: the text
    itself where it is one; else unprintables as ``?`` and, past 64 bytes, ``head...tail`` whose
    head starts and whose tail ends the text, each at least 25 bytes - whole characters only."""
    label = fitted_label(text)
    assert check_label(label) == label.encode()
    shown = "".join(c if c.isprintable() else "?" for c in text)
    if len(shown.encode()) <= 64:
        assert label == shown
    else:
        cuts = [k for k in range(len(label)) if label[k:k + 3] == "..." and shown.startswith(label[:k])
                and shown.endswith(label[k + 3:])]  # the text may hold "..." itself
        assert any(len(label[:k].encode()) >= 25 and len(label[k + 3:].encode()) >= 25 for k in cuts)


def test_a_label_longer_than_its_field_is_refused_not_cut():
    """A label of more than 64 bytes of UTF-8 is refused naming its length (the header's field
    would cut it silently); 64 bytes fit."""
    plan = plan_store(64 << 20, slot_bytes=4096)
    assert decode_header(encode_header(plan, label="é" * 32))[1] == "é" * 32
    with pytest.raises(PlanError, match="at most 64 bytes of UTF-8, got 66"):
        encode_header(plan, label="é" * 33)


def test_a_page_larger_than_a_slot_or_another_size_does_not_fit():
    """check_geometry names both numbers; a page that fits and the same size pass."""
    plan = plan_store(64 << 20, slot_bytes=4096)
    check_geometry(plan, page_bytes=4096, total_bytes=64 << 20, where="a")
    with pytest.raises(ArenaGeometryError, match="4096 bytes, a page of this engine is 8192"):
        check_geometry(plan, page_bytes=8192, total_bytes=None, where="a")
    with pytest.raises(ArenaGeometryError, match="size_gb asks for"):
        check_geometry(plan, page_bytes=4096, total_bytes=32 << 20, where="a")


@pytest.mark.parametrize("kwargs, match", [
    (dict(total_bytes=0, slot_bytes=64), "total_bytes must be a positive integer, got 0"),
    (dict(total_bytes=1 << 20, slot_bytes=12), "multiple of 8"),
    (dict(total_bytes=1 << 20, slot_bytes=64, unit_bytes=3000), "power of two"),
    (dict(total_bytes=1 << 20, slot_bytes=64, unit_bytes=12288), "power of two of at least 4096, got 12288"),
    (dict(total_bytes=1 << 20, slot_bytes=64, unit_bytes=2048), "power of two of at least 4096, got 2048"),
    (dict(total_bytes=1 << 20, slot_bytes=64, backing="ext4"), "backing must be one of"),
    (dict(total_bytes=64 << 10, slot_bytes=1 << 20), "at least 16 must fit"),
])
def test_bad_store_geometry_names_the_field(kwargs, match):
    """Every bad input is a PlanError naming the field and the value."""
    total = kwargs.pop("total_bytes")
    with pytest.raises(PlanError, match=match):
        plan_store(total, **kwargs)
