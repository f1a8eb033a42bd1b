"""hicache.plan.store_format: the node store's arena format - header, counters, the slot
record's fields and offsets, the namespace table - for the two layers that read and write it
(effects' arena room and hicache.store); a face over `_store`, pure."""

from hicache.plan._store import (
    COUNTERS,
    COUNTERS_OFFSET,
    CREATING,
    DEPTH_OFFSET,
    GEN,
    HEADER_LENGTH,
    KEY,
    LENGTH_OFFSET,
    NAMESPACE_BYTES,
    NAMESPACE_ENTRIES,
    NS_OFFSET,
    RECORD,
    RECORD_BYTES,
    REF_OFFSET,
    STAMP_OFFSET,
    SUM1_OFFSET,
    SUM2_OFFSET,
    WRITER_OFFSET,
    StorePlan,
    check_geometry,
    check_label,
    counter_offset,
    decode_header,
    encode_header,
    fitted_label,
)

__all__ = ["COUNTERS", "COUNTERS_OFFSET", "CREATING", "DEPTH_OFFSET", "GEN", "HEADER_LENGTH", "KEY", "LENGTH_OFFSET",
           "NAMESPACE_BYTES", "NAMESPACE_ENTRIES", "NS_OFFSET", "RECORD", "RECORD_BYTES", "REF_OFFSET",
           "STAMP_OFFSET", "SUM1_OFFSET", "SUM2_OFFSET", "WRITER_OFFSET", "StorePlan", "check_geometry",
           "check_label", "counter_offset", "decode_header", "encode_header", "fitted_label"]
