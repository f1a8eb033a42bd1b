"""The node store's arena geometry, as pure data: where the header, the namespace table, the slot
index and the slot data lie in one tmpfs/hugetlbfs file, and the header's byte format.

Owns `plan_store` (bytes and slot size in, a frozen `StorePlan` out), the header codec
(`encode_header` / `decode_header`: magic, schema, geometry, label, its own CRC) and the record
format of one slot in the index. Pure: attrs, struct, zlib and hicache.errors only - the file,
its mount and its memory are hicache.effects' arena room.
"""

from __future__ import annotations

import struct
import zlib

import attrs

from hicache.errors import ArenaError, ArenaGeometryError, PlanError
from hicache.plan._value import value_class

MAGIC = b"HICSTORE"
#: What a creator writes first (the header replaces it last): a file that starts with it, or an
#: empty one, is an arena being made, or whose creator died - anything else at the path is never removed.
CREATING = b"HICINIT\0"
SCHEMA = 1  # of the plan's JSON (`StorePlan.to_jsonable`)
#: The arena header's schema, and which page checksum each one's slots carry (the header says;
#: hicache.effects' arena room computes it). Schema 1's four Fletcher lanes, folded as
#: a0 + 2a1 + 3a2 + 4a3 mod 2**64, lost the top bits of three lanes: some single-bit flips
#: read as hits with wrong bytes (issue #51). Its arenas are refused at attach.
ARENA_SCHEMA = 2
PAGE_SUMS = {1: "fletcher4-folded", 2: "halfword-fletcher"}
HEADER_BYTES = 4096  # the header page: fields, then the arena-wide counters at COUNTERS_OFFSET
COUNTERS_OFFSET = 1024
COUNTERS = ("hits", "misses", "torn", "corrupt", "evictions", "writes")
NAMESPACE_ENTRIES = 256
NAMESPACE_BYTES = 256  # 16-byte digest, then the namespace's description (UTF-8, NUL-padded)
RECORD_BYTES = 64  # one slot's index record: a cache line, so a record never straddles two
WINDOW = 16  # slots a key may live in (set-associative): lookups and evictions stay local
LABEL_BYTES = 64
BACKINGS = ("tmpfs", "hugetlbfs")

# One slot's record (little-endian, RECORD_BYTES):
#   gen u64      even: stable (0: never written); odd: being written, or torn by a dead writer
#   key 16 B     digest of (namespace, SGLang's page key)
#   sum1, sum2   u64 checksum of the payload, seeded by the key (see hicache.effects' arena room)
#   length u32   payload bytes; depth u32: the page's position in its chain (prefix_keys + i)
#   ns u16       namespace table entry; ref u8: CLOCK's referenced bit; pad; writer u32 (pid)
#   stamp u64    the wall clock (ns) when the writer claimed the slot (for diagnosis)
RECORD = struct.Struct("<Q16sQQIIHBxIQ")
GEN, KEY, SUM1, SUM2, LENGTH, DEPTH, NS, REF, WRITER, STAMP = range(10)
REF_OFFSET = 8 + 16 + 8 + 8 + 4 + 4 + 2  # byte offset of `ref` inside a record
#: byte offsets of sum1, sum2, length and depth inside a record (the C helper reads them there)
SUM1_OFFSET, SUM2_OFFSET, LENGTH_OFFSET, DEPTH_OFFSET = (struct.calcsize(prefix) for prefix in
                                                          ("<Q16s", "<Q16sQ", "<Q16sQQ", "<Q16sQQI"))
#: byte offsets of ns, writer and stamp (the C helper's writes put them there)
NS_OFFSET, WRITER_OFFSET, STAMP_OFFSET = (struct.calcsize(prefix) for prefix in
                                          ("<Q16sQQII", "<Q16sQQIIHBx", "<Q16sQQIIHBxI"))
assert RECORD.size <= RECORD_BYTES

_HEADER = struct.Struct("<8sIIQQQQQIBxxxQQQ64s")  # then a CRC32 of these bytes


def _round_up(value: int, unit: int) -> int:
    return -(-value // unit) * unit


@value_class
class StorePlan:
    """Where everything lies in an arena of ``total_bytes``: ``slots`` slots of ``slot_bytes``
    payload each (``slot_stride`` apart, from ``data_offset``), their 64-byte records from
    ``index_offset``, the namespace table at ``namespace_offset``; ``unit_bytes`` is the
    backing's page (4 KiB tmpfs, the hugepage size on hugetlbfs) every region is aligned to."""

    total_bytes: int
    slot_bytes: int
    slot_stride: int
    slots: int
    unit_bytes: int
    backing: str
    window: int
    namespace_offset: int
    index_offset: int
    data_offset: int

    @property
    def index_bytes(self) -> int:
        return self.slots * RECORD_BYTES

    @property
    def data_bytes(self) -> int:
        return self.slots * self.slot_stride

    @property
    def overhead_bytes(self) -> int:
        return self.total_bytes - self.slots * self.slot_bytes

    def record_offset(self, slot: int) -> int:
        return self.index_offset + slot * RECORD_BYTES

    def slot_offset(self, slot: int) -> int:
        return self.data_offset + slot * self.slot_stride

    def to_jsonable(self) -> dict:
        return {"schema": "hicache.store-plan", "schema_version": SCHEMA, **attrs.asdict(self),
                "index_bytes": self.index_bytes, "data_bytes": self.data_bytes,
                "overhead_bytes": self.overhead_bytes}


def plan_store(total_bytes: int, *, slot_bytes: int, unit_bytes: int = 4096, backing: str = "tmpfs",
               window: int = WINDOW) -> StorePlan:
    """The geometry of an arena of at most ``total_bytes`` (rounded down to whole ``unit_bytes``)
    holding slots of ``slot_bytes`` (one page of one pool). Raises `PlanError` naming the field
    when a value is not positive, the backing is unknown, or not even ``window`` slots fit."""
    for name, value in (("total_bytes", total_bytes), ("slot_bytes", slot_bytes), ("unit_bytes", unit_bytes),
                        ("window", window)):
        if type(value) is not int or value <= 0:
            raise PlanError(f"store plan: {name} must be a positive integer, got {value!r}")
    if unit_bytes & (unit_bytes - 1) or unit_bytes < 4096:
        raise PlanError(f"store plan: unit_bytes must be a power of two of at least 4096, got {unit_bytes}")
    if backing not in BACKINGS:
        raise PlanError(f"store plan: backing must be one of {', '.join(BACKINGS)}, got {backing!r}")
    if slot_bytes % 8:
        raise PlanError(f"store plan: slot_bytes must be a multiple of 8 (the checksum's word), got {slot_bytes}")
    total = total_bytes // unit_bytes * unit_bytes
    namespace_offset = HEADER_BYTES
    index_offset = _round_up(namespace_offset + NAMESPACE_ENTRIES * NAMESPACE_BYTES, 4096)
    stride = _round_up(slot_bytes, 64)  # slots start on a cache line
    # slots = the most that fit: records, then data aligned to the unit, within `total`
    slots = max(0, (total - index_offset) // (stride + RECORD_BYTES))
    while slots and _round_up(index_offset + slots * RECORD_BYTES, unit_bytes) + slots * stride > total:
        slots -= 1
    if slots < window:
        least = _round_up(_round_up(index_offset + window * RECORD_BYTES, unit_bytes) + window * stride, unit_bytes)
        raise PlanError(
            f"store plan: {total_bytes} bytes hold {slots} slots of {slot_bytes} bytes; at least {window} must fit "
            f"(the arena needs {least} bytes or more)"
        )
    data_offset = _round_up(index_offset + slots * RECORD_BYTES, unit_bytes)
    return StorePlan(total_bytes=total, slot_bytes=slot_bytes, slot_stride=stride, slots=slots, unit_bytes=unit_bytes,
                     backing=backing, window=window, namespace_offset=namespace_offset, index_offset=index_offset,
                     data_offset=data_offset)


def check_label(label, *, where: str = "store label") -> bytes:
    """``label``'s UTF-8 bytes as the header holds them, or a `PlanError` naming ``where``: printable
    text (`hicache store status` prints it on one line) of at most `LABEL_BYTES` bytes."""
    if not isinstance(label, str):
        raise PlanError(f"{where} must be a string, got {label!r}")
    if not label.isprintable():  # a lone surrogate (JSON's "\ud800") is not printable, and has no UTF-8
        raise PlanError(f"{where} must be printable text, got {label!r}")
    raw = label.encode()
    if len(raw) > LABEL_BYTES:
        raise PlanError(f"{where} must be at most {LABEL_BYTES} bytes of UTF-8, got {len(raw)}: {label!r}")
    return raw


def fitted_label(text: str) -> str:
    """``text`` made a label `check_label` takes: itself where it is one, else with anything
    unprintable as ``?`` and shortened in the middle to ``head...tail`` of whole characters - a
    default label from a model's name (SGLang serves a model under its path, often longer)."""
    text = "".join(c if c.isprintable() else "?" for c in text)
    raw = text.encode()
    if len(raw) <= LABEL_BYTES:
        return text
    keep = LABEL_BYTES - 3
    head = raw[:keep // 2].decode(errors="ignore")  # a character cut in two is dropped whole
    tail = raw[len(raw) - (keep - keep // 2):].decode(errors="ignore")
    return f"{head}...{tail}"


def encode_header(plan: StorePlan, *, label: str) -> bytes:
    """The header's bytes (written last when an arena is created: a file without them is no
    arena yet). ``label`` names the arena for operators (`check_label`)."""
    raw_label = check_label(label)
    body = _HEADER.pack(MAGIC, ARENA_SCHEMA, HEADER_BYTES, plan.total_bytes, plan.slot_bytes, plan.slot_stride, plan.slots,
                        plan.unit_bytes, plan.window, BACKINGS.index(plan.backing), plan.namespace_offset,
                        plan.index_offset, plan.data_offset, raw_label)
    return body + struct.pack("<I", zlib.crc32(body))


HEADER_LENGTH = _HEADER.size + 4


def decode_header(raw: bytes, *, where: str = "arena") -> tuple[StorePlan, str]:
    """``(plan, label)`` from a header's bytes. Raises `ArenaError` for what is no arena header
    (magic, CRC), `ArenaGeometryError` for another schema or a geometry `plan_store` would not
    make - naming ``where`` and the field."""
    if not raw or raw[:8] == CREATING:
        raise ArenaError(f"{where}: not finished (no header yet): its creator is still pre-faulting it, or died "
                         "before writing the header; `hicache store create` makes it afresh once no creator runs")
    if len(raw) < HEADER_LENGTH or raw[:8] != MAGIC:
        raise ArenaError(f"{where}: not a hicache store arena (no header: magic {bytes(raw[:8])!r})")
    body, (crc,) = raw[:_HEADER.size], struct.unpack_from("<I", raw, _HEADER.size)
    if zlib.crc32(body) != crc:
        raise ArenaError(f"{where}: corrupt header (CRC {zlib.crc32(body):#010x} != stored {crc:#010x})")
    (_, schema, header_bytes, total, slot_bytes, stride, slots, unit, window, backing, ns_offset, index_offset,
     data_offset, label) = _HEADER.unpack(body)
    if schema in PAGE_SUMS and schema != ARENA_SCHEMA:
        raise ArenaGeometryError(
            f"{where}: made by an older hicache (schema {schema}); its pages carry the {PAGE_SUMS[schema]} checksum, "
            f"which lets some bit flips through, and this hicache reads only {PAGE_SUMS[ARENA_SCHEMA]} (schema "
            f"{ARENA_SCHEMA}): drop it with `hicache store drop` and let it be recreated"
        )
    if schema != ARENA_SCHEMA:
        raise ArenaGeometryError(f"{where}: schema {schema}, this hicache reads schema {ARENA_SCHEMA} "
                                 "(made by a newer hicache? drop it with `hicache store drop` and recreate it)")
    if backing >= len(BACKINGS):
        raise ArenaError(f"{where}: corrupt header (backing {backing})")
    try:
        plan = plan_store(total, slot_bytes=slot_bytes, unit_bytes=unit, backing=BACKINGS[backing], window=window)
    except PlanError as error:
        raise ArenaError(f"{where}: corrupt header ({error})") from None
    stored = (header_bytes, stride, slots, ns_offset, index_offset, data_offset)
    if stored != (HEADER_BYTES, plan.slot_stride, plan.slots, plan.namespace_offset, plan.index_offset,
                  plan.data_offset):
        raise ArenaError(f"{where}: corrupt header (regions {stored} are not the plan of its own geometry)")
    return plan, label.rstrip(b"\0").decode(errors="replace")


def counter_offset(name: str) -> int:
    """Byte offset in the header of an arena-wide counter (u64)."""
    return COUNTERS_OFFSET + 8 * COUNTERS.index(name)


def check_geometry(plan: StorePlan, *, page_bytes: int, total_bytes: int | None, where: str) -> None:
    """An existing arena fits an engine whose largest page is ``page_bytes`` (and that asked for
    ``total_bytes``, when it did): else `ArenaGeometryError` naming both numbers."""
    if page_bytes > plan.slot_bytes:
        raise ArenaGeometryError(
            f"{where}: its slots hold {plan.slot_bytes} bytes, a page of this engine is {page_bytes} bytes "
            "(another model or page size made it: drop it, or give this engine its own arena)"
        )
    if total_bytes is not None and total_bytes // plan.unit_bytes * plan.unit_bytes != plan.total_bytes:
        raise ArenaGeometryError(
            f"{where}: it holds {plan.total_bytes} bytes, size_gb asks for {total_bytes} bytes "
            "(match size_gb to it, leave size_gb out to attach as it is, or drop it)"
        )
