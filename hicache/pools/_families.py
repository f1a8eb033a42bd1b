"""The host-pool families, one module each (issue #34 item 2): `_mha` (MHA, K-only, asymmetric),
`_mla` (MLA and the DSA indexer beside it), `_mamba` (linear-attention state), `_v4_pools`
(DeepSeek-V4 paged and state); what they share is in `_family_base`. Each family says only how
big a token is, which layout descriptor it has and which device tensors its buffers pair with;
the geometry is made once from its form (`_forms`, `_geometry`); allocation, registration and
transfers are the base's (`_base.HostKVCache`, `_device_copies`).

A new SGLang family touches (the table in docs/sglang.md): its module here (and its row
below, which `hicache.pools` exports), its forms' row in `_forms.FORMS`, its layout in
`hicache/plan/_layouts.py` (and the model recipe in `_models.py` for `hicache plan`), its device
view in `_sglang_inputs.py`, the plug-in's `POOL_CLASSES` (compat/sglang_plugin.py) when SGLang
builds it, and the conformance and geometry suites (tests/test_sglang_conformance.py,
tests/test_pool_geometry.py).
"""

from __future__ import annotations

from hicache.pools._mamba import MambaPoolHost
from hicache.pools._mha import (
    AsymmetricMHATokenToKVPoolHost,
    MHATokenToKOnlyPoolHost,
    MHATokenToKVPoolHost,
    get_mha_host_pool_cls,
)
from hicache.pools._mla import DSAIndexerPoolHost, MLATokenToKVPoolHost
from hicache.pools._v4_pools import DeepSeekV4PagedHostPool, DeepSeekV4StateHostPool

__all__ = [
    "AsymmetricMHATokenToKVPoolHost", "DSAIndexerPoolHost", "DeepSeekV4PagedHostPool", "DeepSeekV4StateHostPool",
    "MHATokenToKOnlyPoolHost", "MHATokenToKVPoolHost", "MLATokenToKVPoolHost", "MambaPoolHost", "get_mha_host_pool_cls",
]
