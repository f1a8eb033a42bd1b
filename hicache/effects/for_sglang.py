"""hicache.effects.for_sglang: a sub-face for one audience, `hicache.compat` (issue #34 item 6,
#55 item 5): SGLang's chunk setting and the plug-in switch read from the environment, the torch
runtime SGLang's own pools pin through, unregistering ranges someone else registered, and the
quarantine of memory CUDA still holds. Each name lives in its own room; this module names them."""

from hicache.effects._cuda._registration import unregister_ranges
from hicache.effects._cuda._runtime import torch_runtime
from hicache.effects._host._environment import sglang_plugin_enabled, sglang_register_chunk_bytes
from hicache.effects._host._memory import quarantine

__all__ = ["quarantine", "sglang_plugin_enabled", "sglang_register_chunk_bytes", "torch_runtime", "unregister_ranges"]
