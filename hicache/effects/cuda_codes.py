"""hicache.effects.cuda_codes: a sub-face for code that reads CUDA's answers (`compat`,
`hicache.testing`'s fake driver; issue #55 item 5): success, the sticky errors, the two
registration errors hicache tells apart, and every code's name. Each lives in the CUDA room."""

from hicache.effects._cuda._codes import ALREADY_REGISTERED, NAMES, NOT_REGISTERED, STICKY, SUCCESS

__all__ = ["ALREADY_REGISTERED", "NAMES", "NOT_REGISTERED", "STICKY", "SUCCESS"]
