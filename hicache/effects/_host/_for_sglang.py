"""What only `hicache.compat` asks of the host room and CUDA's (issue #34 item 6: SGLang-only
helpers leave effects' face): SGLang's chunk setting and the plug-in switch read from the
environment, the torch runtime SGLang's own pools pin through, unregistering ranges someone else
registered, and the quarantine of memory CUDA still holds. The face exports this module as
``hicache.effects.for_sglang``; nothing here is new, each name lives in its own module."""

from hicache.effects._cuda._registration import unregister_ranges
from hicache.effects._cuda._runtime import torch_runtime
from hicache.effects._host._environment import sglang_plugin_enabled, sglang_register_chunk_bytes
from hicache.effects._host._memory import quarantine

__all__ = ["quarantine", "sglang_plugin_enabled", "sglang_register_chunk_bytes", "torch_runtime", "unregister_ranges"]
