"""hicache: bring up very large host KV-cache pools for LLM inference, safely and fast.

Plan the cudaHostRegister calls as pure data (hicache.plan), apply them as a transaction
(hicache.effects), and own host KV pools built on both (hicache.pools). Heavy modules (torch,
cuda-python, psutil) are imported only by the layers that need them; this package imports
only its error tree, so `hicache plan` starts fast.
"""

from hicache.errors import (
    ApplyError,
    CapacityError,
    CudaCallError,
    CudaUnavailableError,
    HicacheError,
    LayoutError,
    PlanError,
    ReleaseError,
    RollbackError,
)

__version__ = "0.1.0"

__all__ = [
    "ApplyError",
    "CapacityError",
    "CudaCallError",
    "CudaUnavailableError",
    "HicacheError",
    "LayoutError",
    "PlanError",
    "ReleaseError",
    "RollbackError",
    "__version__",
]
