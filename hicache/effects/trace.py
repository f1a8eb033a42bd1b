"""hicache.effects.trace: a sub-face for the bring-up trace's users (issue #55 item 5): the CLI's
`trace merge` (the merge of loaded traces and its writer), the path check the CLI and the pools
run before anything is held, and the spans and the switch other layers mark their work with.
Each name lives in the trace leaf."""

from hicache.effects._trace import check_path, merge_loaded, span, tracing, write_json

__all__ = ["check_path", "merge_loaded", "span", "tracing", "write_json"]
