"""The node store's arena room: the tmpfs/hugetlbfs file (mount and room checks, create under a
directory lock with its header last, attach without faulting), its records and namespace table
(`Records`: every word of the store's state, with the writer's id and clock), and the word
operations and per-slot locks the store's slot protocol runs on (a C helper with a fallback). Imports the
leaves, `_host` (the pre-fault workers) and `_copy` (how many threads a large copy uses) only."""

from hicache.effects._arena._arena import Arena, attach_arena, check_room, create_arena, drop_arena
from hicache.effects._arena._mounts import Backing, Mount, backing_of, mount_of, mounts, parse_mountinfo
from hicache.effects._arena._records import Records
from hicache.effects._arena._slots import CORRUPT, HIT, MISS, NOT_FOUND, TORN, NativeSlotOps, PythonSlotOps, slot_ops, try_lock, try_read_lock, unlock

__all__ = ["Arena", "Backing", "CORRUPT", "HIT", "MISS", "TORN", "check_room", "Mount", "NOT_FOUND", "NativeSlotOps", "PythonSlotOps", "Records", "attach_arena", "backing_of",
           "create_arena", "drop_arena", "mount_of", "mounts", "parse_mountinfo", "slot_ops", "try_lock", "try_read_lock", "unlock"]
