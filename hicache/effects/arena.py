"""hicache.effects.arena: a sub-face for the node store (`hicache.store`) and its operators' CLI
(issue #55 item 5): the arena file (create - its room checked first -, attach, drop, mount checks), its mounts,
and the slot protocol's word operations and per-slot locks (the C
helper's or the fallback's) with the outcomes a read reports. Each name lives in the arena room."""

from hicache.effects._arena import (
    CORRUPT,
    HIT,
    NOT_FOUND,
    TORN,
    Arena,
    NativeSlotOps,
    PythonSlotOps,
    attach_arena,
    backing_of,
    create_arena,
    drop_arena,
    mount_of,
    mounts,
    parse_mountinfo,
    slot_ops,
    try_lock,
    try_read_lock,
    unlock,
)

__all__ = ["Arena", "CORRUPT", "HIT", "NOT_FOUND", "NativeSlotOps", "PythonSlotOps", "TORN",
           "attach_arena", "backing_of", "create_arena", "drop_arena", "mount_of",
           "mounts", "parse_mountinfo", "slot_ops", "try_lock", "try_read_lock", "unlock"]
