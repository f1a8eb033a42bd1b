"""What every `hicache` command shares: the user-facing error, exit codes, the parser class,
and strict readers of numbers and sizes. Imports hicache.plan and the standard library only
(the `plan` path must not load torch, cuda or psutil).
"""

from __future__ import annotations

import argparse
import os
import sys
from decimal import Decimal, InvalidOperation

from hicache._output_file import check_output, replace_file
from hicache.errors import PlanError
from hicache.plan import parse_size

USAGE, INFEASIBLE, CUDA_FAILURE, INTERRUPTED = 2, 1, 3, 130


class CliError(Exception):
    """A user-facing failure: one ``error[ref]: message`` line, a hint, an exit code."""

    def __init__(self, ref: str, message: str, hint: str, code: int = USAGE) -> None:
        super().__init__(message)
        self.ref, self.hint, self.code = ref, hint, code


def _formatter(prog: str) -> argparse.HelpFormatter:
    # An explicit width keeps argparse from importing shutil for the terminal size on every
    # start (argparse builds a formatter per add_argument); `hicache plan` must start fast.
    columns = os.environ.get("COLUMNS", "")
    width = int(columns) - 2 if columns.isascii() and columns.isdigit() and int(columns) > 20 else 98
    return argparse.HelpFormatter(prog, width=min(width, 98))


class Parser(argparse.ArgumentParser):
    def __init__(self, *args, **kwargs) -> None:
        kwargs.setdefault("formatter_class", _formatter)
        super().__init__(*args, **kwargs)
        for name in (None, "store"):  # every plain option (None: add_argument's default; groups share this)
            self.register("action", name, _StoreOnce)

    def error(self, message: str):  # argparse's own usage errors, in our format
        raise CliError("usage", message, f"run `{self.prog} --help`")


class _StoreOnce(argparse._StoreAction):
    """An option given twice with different values - under one spelling or two (``--tp 1
    --tp-size 8``) - is `conflicting-flags`, never "the last one wins" silently."""

    def __call__(self, parser, namespace, values, option_string=None):
        given = namespace.__dict__.setdefault("_given_options", {})
        earlier = given.get(self.dest)
        if earlier is not None and earlier[1] != values:
            raise CliError("conflicting-flags", f"{earlier[0]} {earlier[1]} and {option_string} {values} both given",
                           f"{earlier[0]} and {option_string} set the same thing: give it once")
        given[self.dest] = (option_string, values)
        super().__call__(parser, namespace, values, option_string)


#: The largest value each count flag takes: past these the input is a typo, not a deployment
#: (and some would start that many threads or plan that many slots).
MAXIMA = {"--tp": 65_536, "--page-size": 2**20, "--mamba-slots": 10**8, "--threads": 256,
          "--ranks-per-host": 4_096, "--device-tokens": 10**12, "--metrics-port": 65_535}


def ascii_number(text) -> bool:
    """Whether ``text`` is written as a plain number may be: in ASCII - int(), float() and
    Decimal() read "١٢" (Arabic-Indic digits) or "１２" (full-width) as 12 (issue #33) - and
    without underscores, which they read as digit separators ("1_0" is 10: `--size-gb 1_0` made
    a 10 GB arena, issue #54). The environment table refuses both the same way."""
    return isinstance(text, str) and text.isascii() and "_" not in text


def positive_int(text: str, flag: str) -> int:
    try:
        if not ascii_number(text):
            raise ValueError(text)
        value = int(text)
    except (TypeError, ValueError):
        raise CliError("bad-number", f"{flag} must be a whole number, got {text!r}", f"e.g. {flag} 8") from None
    if value <= 0:
        raise CliError("bad-number", f"{flag} must be positive, got {value}", f"e.g. {flag} 8")
    maximum = MAXIMA.get(flag)
    if maximum is not None and value > maximum:
        shown = f"{value:,}" if value < 10**18 else f"{str(value)[:6]}... ({len(str(value))} digits)"
        raise CliError("bad-number", f"{flag} {shown} is over {maximum:,}", f"at most {maximum:,} (past that it is a typo, not a deployment)")
    return value


def positive_decimal(text: str, flag: str) -> Decimal:
    try:
        if not ascii_number(str(text)):
            raise InvalidOperation(text)
        value = Decimal(str(text))
    except (InvalidOperation, TypeError):
        raise CliError("bad-size", f"{flag} must be a number, got {text!r}", f"e.g. {flag} 100") from None
    if not value.is_finite() or value <= 0:
        raise CliError("bad-size", f"{flag} must be a positive number, got {text!r}", f"e.g. {flag} 100")
    return value


def size(text: str, flag: str, *, minimum: int = 1) -> int:
    try:
        return parse_size(text, what=flag, minimum=minimum)
    except PlanError as error:
        raise CliError("bad-size", str(error), f"sizes look like 64GiB, 512MiB, 2TB or 4096 ({flag})") from None


def emit(text: str, out: str | None) -> None:
    """Write ``text`` to ``out`` (a path: a new or regular file, replaced whole - see
    `hicache._output_file`) or stdout."""
    if out:
        def refused(message):
            return CliError("bad-output", message, "pass --out a new or regular file, or leave it out for standard output")

        path = check_output(out, what="output file", error=refused)
        replace_file(path, lambda handle: handle.write(text), what="output file", error=refused)
        print(f"wrote {out}", file=sys.stderr)
    else:
        try:
            sys.stdout.write(text)
            sys.stdout.flush()
        except OSError as error:  # a full disk (> /dev/full), a closed pipe
            _quiet_stdout()
            raise CliError("bad-output", f"cannot write to standard output: {error.strerror}",
                           "check where standard output goes (a full disk, a closed pipe), or pass --out FILE") from None


def _quiet_stdout() -> None:
    """Point stdout at /dev/null so the interpreter's final flush of what is left cannot fail
    again (a second traceback after the error line)."""
    import os

    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        os.close(devnull)
    except (OSError, ValueError, AttributeError):  # no real descriptor (a test's capture): nothing to flush
        pass


def fail(ref: str, message: str, hint: str, code: int) -> int:
    print(f"error[{ref}]: {message}", file=sys.stderr)
    print(f"hint: {hint}", file=sys.stderr)
    return code


#: Largest input files read: a HuggingFace config.json is a few KiB, a saved plan well under this.
CONFIG_LIMIT_BYTES = 1 * 2**20
PLAN_LIMIT_BYTES = 64 * 2**20


def read_json_file(path: str, flag: str, limit: int, hint: str, ref: str):
    """The JSON in ``path``: a regular file of at most ``limit`` bytes (never a FIFO, a device
    or /dev/zero - they could block or never end), not nested absurdly deep."""
    import json
    import stat

    # opened once, without blocking (a FIFO opens at once, then is refused), and checked on the
    # open descriptor: a path swapped for a FIFO between a stat and an open cannot hang us
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0))
    except OSError as error:
        raise CliError(ref, f"cannot read {path}: {error.strerror}", hint) from None
    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode):
            raise CliError(ref, f"{flag} {path} is not a regular file", hint)
        if info.st_size > limit:
            raise CliError(ref, f"{flag} {path} is {info.st_size:,} bytes, over the {limit:,}-byte limit", hint)
        os.set_blocking(fd, True)  # a regular file: plain reads
        with os.fdopen(fd, "rb") as handle:
            fd = None  # the file object closes it
            raw = handle.read(limit + 1)
    except OSError as error:
        raise CliError(ref, f"cannot read {path}: {error.strerror}", hint) from None
    finally:
        if fd is not None:
            os.close(fd)
    if len(raw) > limit:
        raise CliError(ref, f"{flag} {path} grew past the {limit:,}-byte limit while being read", hint)
    try:
        return json.loads(raw)
    except RecursionError:
        raise CliError(ref, f"{path} nests JSON too deeply", hint) from None
    except ValueError as error:
        raise CliError(ref, f"{path} is not valid JSON: {error}", hint) from None
