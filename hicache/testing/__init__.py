"""Public test doubles (trio's ``testing``: for hicache's tests and anyone testing code on top).

- the fake CUDA (`_fake_cuda`): `FakeCudart`, a fault-injecting driver; `FakeRuntime`, the real
  torch-cudart adapter over it; `FakeCudaBinding`, cuda-python's tuple convention;
  `fake_cuda()`, one behind every default runtime; `check_runtime_conformance`; `FakeHostBuffer`;
- the fake host (`_fake_host`): `fake_machine()`, `fake_host_setup()`;
- CPU stand-ins for SGLang's device pools, one per family (`_stand_ins`: `MHADevicePool`, ...);
- SGLang's real code on a CPU box (`_sglang_cpu`: `sglang_on_cpu()`).
"""

from __future__ import annotations

from hicache.testing._fake_cuda import (
    FakeCudaBinding,
    FakeCudart,
    FakeHostBuffer,
    FakeInvariantError,
    FakeRuntime,
    check_runtime_conformance,
    fake_cuda,
)
from hicache.testing._fake_host import fake_host_setup, fake_machine
from hicache.testing._sglang_cpu import sglang_on_cpu
from hicache.testing._stand_ins import (
    AsymmetricMHADevicePool,
    DeepSeekV4DevicePool,
    DSAIndexerDevicePool,
    MambaDevicePool,
    MHADevicePool,
    MLADevicePool,
)

__all__ = [
    "AsymmetricMHADevicePool",
    "DSAIndexerDevicePool",
    "DeepSeekV4DevicePool",
    "MLADevicePool",
    "MHADevicePool",
    "MambaDevicePool",
    "FakeCudart",
    "FakeCudaBinding",
    "FakeRuntime",
    "FakeInvariantError",
    "check_runtime_conformance",
    "fake_cuda",
    "fake_host_setup",
    "fake_machine",
    "FakeHostBuffer",
    "sglang_on_cpu",
]
