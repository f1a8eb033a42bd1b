"""`hicache trace merge`: the bring-up traces of several processes of one host as one timeline.

Every hicache trace is on the host's CLOCK_MONOTONIC (docs/metrics.md), so the ranks' spans
line up as they happened; the output is written as safely as a trace is (a regular or new file,
through a temp file).
"""

from __future__ import annotations

import sys

from hicache.cli._common import CliError, read_json_file

TRACE_LIMIT_BYTES = 1 << 30  # a bring-up trace is KB to MB; past a GiB it is not one

DESCRIPTION = ("Merge bring-up traces (hicache apply --trace, HICACHE_TRACE) of the processes of one host into "
               "one Chrome trace-event file, each process its own row. Example: hicache trace merge --out node.json "
               "rank0.json rank1.json")


def add_command(commands) -> None:
    trace = commands.add_parser("trace", help="merge the bring-up traces of a host's processes", description=DESCRIPTION)
    actions = trace.add_subparsers(dest="action", required=True, parser_class=type(trace))
    merge = actions.add_parser("merge", help="one timeline of several processes' traces")
    merge.add_argument("--out", required=True, help="the merged trace (a new or regular file)")
    merge.add_argument("traces", nargs="+", help="traces of processes of one host")


def run(args) -> int:
    from hicache.effects import trace
    from hicache.errors import TraceOutputError

    hint = "merge hicache traces of one host; --out a new or regular file"
    # every input as the CLI reads files: a FIFO, device or /dev/zero is refused, never read (it hung)
    loaded = [(path, read_json_file(path, "trace", TRACE_LIMIT_BYTES, hint, "bad-trace")) for path in args.traces]
    try:
        out = trace.check_path(args.out)
        merged = trace.merge_loaded(loaded)
    except TraceOutputError as error:
        raise CliError("bad-trace", str(error), hint) from None
    if not trace.write_json(out, merged):
        raise CliError("bad-output", f"cannot write {out}", "see the warning above")
    processes = len({e.get("pid") for e in merged["traceEvents"]})
    print(f"wrote {out}: {len(merged['traceEvents'])} events of {processes} process(es)", file=sys.stderr)
    return 0
