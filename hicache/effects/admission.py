"""hicache.effects.admission: a sub-face for the callers that admit host memory outside a pool's
bring-up (issue #55 item 5): SGLang's seam (`compat`: a pinned allocation it makes admitted,
then counted resident or abandoned), the budget's figures the CLI and doctor show, the host-wide
budget lock and the one admission (`claim` by an `AdmissionPolicy`, made once this process's
dropped mappings are given back, which the node store's creation asks, as a pool's bring-up
and SGLang's hooks do), and the registration turnstile's type. Each name lives in its own room."""

from hicache.effects._bringup._admission import (
    abandon,
    available_host_memory_bytes,
    host_memory_budget_bytes,
    resident,
)
from hicache.effects._bringup._admission import settled_claim as claim  # after this process's releases
from hicache.effects._hostwide._claim import AdmissionPolicy
from hicache.effects._hostwide._lock import budget_lock
from hicache.effects._hostwide._turnstile import Turnstile

__all__ = ["AdmissionPolicy", "Turnstile", "abandon", "available_host_memory_bytes", "budget_lock", "claim",
           "host_memory_budget_bytes", "resident"]
