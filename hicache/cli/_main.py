"""`hicache` entry point: the parser of every command, and errors turned into exit codes.

Exit codes: 0 ok, 1 infeasible plan / refused budget / failed check, 2 usage, 3 CUDA failure,
130 interrupted (Ctrl-C), 143 / 129 stopped by SIGTERM / SIGHUP - `apply` and `store` undo
what they did on those as on Ctrl-C, as a process killed by them would exit. Only the command
being run is imported (the `plan` path stays light).
"""

from __future__ import annotations

import sys
import warnings

from hicache._extras import MissingExtraError
from hicache.cli._common import CUDA_FAILURE, INFEASIBLE, INTERRUPTED, USAGE, CliError, Parser, fail
from hicache.errors import (
    ApplyError,
    ArenaBeingCreatedError,
    ArenaError,
    ArenaGeometryError,
    CapacityError,
    CudaCallError,
    EnvError,
    HicacheError,
    HostOutOfMemoryError,
    HugepageSizeError,
    HugepagesExhaustedError,
    LockDirectoryError,
    LockTimeoutError,
    PlanError,
    PoolTooSmallError,
    RegistrationStateError,
    ReleaseError,
    RollbackError,
    caused_by_interrupt,
)

_COMMANDS = ("plan", "doctor", "apply", "store", "trace")
_HOLDING = ("apply", "store")  # the commands that take memory, claims and registrations


def _interrupted(error: BaseException) -> tuple[str, int]:
    """How an interrupt is said and the exit code: Ctrl-C 130, SIGTERM 143, SIGHUP 129."""
    import signal

    from hicache.errors import signal_number

    signum = signal_number(error) or signal.SIGINT
    if signum == signal.SIGINT:
        return "interrupted", INTERRUPTED
    return f"stopped by {signal.Signals(signum).name}", 128 + signum


def _module(name: str):
    if name == "plan":
        from hicache.cli import _plan as module
    elif name == "doctor":
        from hicache.cli import _doctor as module
    elif name == "store":
        from hicache.cli import _store as module
    elif name == "trace":
        from hicache.cli import _trace as module
    else:
        from hicache.cli import _apply as module
    return module


def make_parser(only: str | None = None) -> Parser:
    """The argument parser; ``only`` builds just that subcommand (start-up time of `plan`)."""
    from hicache import __version__

    parser = Parser(prog="hicache", description="Plan, check and apply cudaHostRegister of host KV-cache pools.",
                    epilog="hicache plan --help | doctor --help | apply --help | store --help | trace --help: each command with an example")
    parser.add_argument("--version", action="version", version=f"hicache {__version__}")
    commands = parser.add_subparsers(dest="command", required=True, parser_class=Parser)
    for name in _COMMANDS:
        if only in (None, name):
            _module(name).add_command(commands)
    return parser


#: the hint after an interrupted `hicache store` command: a create removes its unfinished file
STORE_LEFT = "no unfinished arena is left behind (an interrupted create removes its file)"


def _what_is_left(error: BaseException | None) -> str:
    """The hint after an interrupt or failure: never "nothing is left" when a rollback leaked."""
    while error is not None:
        if isinstance(error, ReleaseError):
            return (f"{len(error.leaked)} range(s) stay registered (listed above); this process must not "
                    "free their memory - exiting releases them")
        if isinstance(error, RollbackError):
            ranges = len(error.leaked) + len(getattr(error, "uncertain", ()))
            return (f"{ranges} range(s) may stay registered (listed above); this process must not "
                    "free their memory - exiting releases them")
        error = error.__cause__ or error.__context__
    return "nothing is left registered"


def _option_names(parser) -> dict:
    """dest -> the first option string naming it, over the parser and its subcommands."""
    import argparse

    names: dict = {}
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for sub in action.choices.values():
                for dest, flag in _option_names(sub).items():
                    names.setdefault(dest, flag)
        elif action.option_strings:
            names.setdefault(action.dest, action.option_strings[0])
    return names


def _refuse_empty_values(parser, args) -> None:
    """``--tp=``, ``--model ''``, ``--out ''``...: an empty value is a mistake, never the default
    (it once became the default silently, and the "defaults used" line then misreported it)."""
    names = _option_names(parser)
    for dest, value in vars(args).items():
        if isinstance(value, str) and not value.strip() and dest in names:
            raise CliError("empty-value", f"{names[dest]} was given an empty value",
                           f"give {names[dest]} a value, or leave it out for the default")


#: torch's CPU build warns at import when NumPy is absent; hicache never uses NumPy, and on
#: stderr the warning lands in the middle of apply's progress display (issue #31).
_TORCH_NUMPY_WARNING = "Failed to initialize NumPy"


def main(argv: list[str] | None = None) -> int:
    """Entry point of `hicache` and `python -m hicache`; returns the exit code."""
    warnings.filterwarnings("ignore", message=_TORCH_NUMPY_WARNING, category=UserWarning)
    only = None
    try:
        argv = sys.argv[1:] if argv is None else list(argv)
        only = argv[0] if argv and argv[0] in _COMMANDS else None
        parser = make_parser(only)
        args = parser.parse_args(argv)
        _refuse_empty_values(parser, args)
        if args.command in _HOLDING:
            from hicache.effects import terminate_as_interrupt

            with terminate_as_interrupt():  # SIGTERM / SIGHUP: undone as Ctrl-C is (issue #33)
                return _module(args.command).run(args)
        return _module(args.command).run(args)
    except CliError as error:
        return fail(error.ref, str(error), error.hint, error.code)
    except MissingExtraError as error:
        return fail("missing-extra", str(error).split(": pip install")[0], 'pip install "hicache[cuda]"', USAGE)
    except HugepageSizeError as error:
        return fail("bad-size", str(error), "pick an offered --hugepage-size (or HICACHE_HUGEPAGE_SIZE), or "
                    "--hugepages prefer to fall back to 4 KiB pages", USAGE)
    except HugepagesExhaustedError as error:
        return fail("hugepages-exhausted", str(error),
                    "reserve more (sysctl vm.nr_hugepages=N) or use --hugepages prefer (falls back), thp or off", INFEASIBLE)
    except HostOutOfMemoryError as error:
        return fail("host-out-of-memory", str(error), "free host memory, or plan a smaller pool (--host-gb)", INFEASIBLE)
    except LockTimeoutError as error:
        return fail("lock-timeout", str(error), "another bring-up holds the host-wide budget lock (named above): "
                    "wait for it, or raise HICACHE_LOCK_TIMEOUT", INFEASIBLE)
    except LockDirectoryError as error:
        return fail("lock-directory", str(error), "set HICACHE_RUNTIME_DIR to a private directory of yours (mode 0700)",
                    USAGE)
    except PoolTooSmallError as error:  # a CapacityError too, but it needs a larger pool, not a smaller one
        return fail("pool-too-small", str(error), "raise --host-gb (or --ratio): a pool holds at least one page", USAGE)
    except CapacityError as error:  # its message may carry its own hint: one hint line, not two
        message, _, hint = str(error).partition(". Hint: ")
        return fail("budget-refused", message, hint or "lower the pool size or free host memory", INFEASIBLE)
    except ApplyError as error:
        cause = error.__cause__
        if isinstance(cause, KeyboardInterrupt):
            said, code = _interrupted(error)
            return fail("interrupted", f"{said}: {error}" if code != INTERRUPTED else str(error),
                        _what_is_left(error), code)
        if isinstance(cause, CudaCallError):
            return fail("cuda-error", str(error), "run `hicache doctor`", CUDA_FAILURE)
        return fail("apply-failed", str(error), "run `hicache doctor`", INFEASIBLE)
    except ReleaseError as error:
        if caused_by_interrupt(error):
            return fail("interrupted", str(error), _what_is_left(error), _interrupted(error)[1])
        return fail("release-leaked", str(error), _what_is_left(error), CUDA_FAILURE)
    except CudaCallError as error:
        ref = "cuda-unavailable" if error.__class__.__name__ == "CudaUnavailableError" else "cuda-error"
        return fail(ref, str(error), "run `hicache doctor` on this machine", CUDA_FAILURE)
    except ArenaBeingCreatedError as error:
        return fail("arena-being-created", str(error),
                    f"wait for pid {error.creator}'s create to end, then run this again", USAGE)
    except ArenaGeometryError as error:
        return fail("arena-geometry", str(error), "drop the arena (hicache store drop PATH) or match its geometry",
                    INFEASIBLE)
    except ArenaError as error:
        return fail("arena", str(error), "hicache store status PATH shows an arena; docs/store.md: where arenas go",
                    USAGE)
    except EnvError as error:  # a PlanError too, but the fix is the variable, not the plan
        return fail("bad-environment", str(error), "fix or unset the environment variable it names", USAGE)
    except PlanError as error:
        return fail("infeasible-plan", str(error), "raise --chunk-limit or change --layout/--page-size", INFEASIBLE)
    except RegistrationStateError as error:  # e.g. memory still registered refused to unmap
        return fail("registration-state", str(error), "a registration is still held: exiting releases it; "
                    "run `hicache doctor` if it persists", CUDA_FAILURE)
    except HicacheError as error:
        return fail("error", str(error), "run `hicache doctor`", INFEASIBLE)
    except MemoryError:
        return fail("out-of-memory", "ran out of memory", "plan a smaller pool or fewer calls (raise --chunk-limit)", INFEASIBLE)
    except KeyboardInterrupt as interrupt:
        said, code = _interrupted(interrupt)
        detail = interrupt.__cause__ or interrupt.__context__
        message = f"{said} ({detail})" if detail is not None else said
        left = STORE_LEFT if only == "store" else _what_is_left(interrupt)  # a store registers nothing
        return fail("interrupted", message, left, code)
