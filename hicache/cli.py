"""`hicache` command line: `plan` (offline capacity review), `doctor`, `apply`.

Owns argument parsing, error reporting and exit codes; numbers come from hicache.plan and
rendering from hicache._render. The `plan` path imports no torch, cuda or psutil, so it starts
as fast as a bare script; `doctor` and `apply` load hicache.effects when they run.
Exit codes: 0 ok, 1 infeasible plan / refused budget / failed check, 2 usage, 3 CUDA failure,
130 interrupted.
"""

from __future__ import annotations

import argparse
import json
import sys
from decimal import Decimal, InvalidOperation

from hicache.errors import (
    ApplyError,
    CapacityError,
    CudaCallError,
    HicacheError,
    LayoutError,
    PlanError,
)
from hicache.plan import (
    DEFAULT_MODEL,
    DEFAULT_RESERVE_BYTES,
    KV_DTYPES,
    PRESETS,
    CapacityPlan,
    ConfigError,
    Limits,
    kernel_pin_cap,
    model_from_hf_config,
    parse_size,
    plan_capacity,
)

USAGE, INFEASIBLE, CUDA_FAILURE, INTERRUPTED = 2, 1, 3, 130
LAYOUTS = ("page_first_direct", "page_first", "layer_first", "page_head")
DEFAULTS = {
    "model": DEFAULT_MODEL, "tp": 8, "page_size": 64, "layout": "page_first_direct",
    "host_gb": "100", "chunk_limit": "64GiB",
}


class CliError(Exception):
    """A user-facing failure: one ``error[ref]: message`` line, a hint, an exit code."""

    def __init__(self, ref: str, message: str, hint: str, code: int = USAGE) -> None:
        super().__init__(message)
        self.ref, self.hint, self.code = ref, hint, code


def _formatter(prog: str) -> argparse.HelpFormatter:
    # An explicit width keeps argparse from importing shutil for the terminal size on every
    # start (argparse builds a formatter per add_argument); `hicache plan` must start fast.
    import os

    columns = os.environ.get("COLUMNS", "")
    return argparse.HelpFormatter(prog, width=int(columns) - 2 if columns.isdigit() else 98)


class _Parser(argparse.ArgumentParser):
    def __init__(self, *args, **kwargs) -> None:
        kwargs.setdefault("formatter_class", _formatter)
        super().__init__(*args, **kwargs)

    def error(self, message: str):  # argparse's own usage errors, in our format
        raise CliError("usage", message, f"run `{self.prog} --help`")


def _positive_int(text: str, flag: str) -> int:
    try:
        value = int(text)
    except (TypeError, ValueError):
        raise CliError("bad-number", f"{flag} must be a whole number, got {text!r}", f"e.g. {flag} 8") from None
    if value <= 0:
        raise CliError("bad-number", f"{flag} must be positive, got {value}", f"e.g. {flag} 8")
    return value


def _positive_decimal(text: str, flag: str) -> Decimal:
    try:
        value = Decimal(text)
    except (InvalidOperation, TypeError):
        raise CliError("bad-size", f"{flag} must be a number, got {text!r}", f"e.g. {flag} 100") from None
    if not value.is_finite() or value <= 0:
        raise CliError("bad-size", f"{flag} must be a positive number, got {text!r}", f"e.g. {flag} 100")
    return value


def _size(text: str, flag: str) -> int:
    try:
        return parse_size(text, what=flag)
    except PlanError as error:
        raise CliError("bad-size", str(error), f"sizes look like 64GiB, 512MiB, 2TB or 4096 ({flag})") from None


def _model(args):
    if args.config and args.model:
        raise CliError("conflicting-flags", "--model and --config both given", "pass one of them")
    if args.config:
        path = args.config
        try:
            with open(path) as handle:
                data = json.loads(handle.read())
        except OSError as error:
            raise CliError("bad-config", f"cannot read {path}: {error.strerror}", "pass the path of a HuggingFace config.json") from None
        except ValueError as error:
            raise CliError("bad-config", f"{path} is not valid JSON: {error}", "pass the path of a HuggingFace config.json") from None
        try:
            return model_from_hf_config(data, name=str(path))
        except ConfigError as error:
            raise CliError("bad-config", str(error), "check the config.json, or use --model with a preset") from None
    name = args.model or DEFAULT_MODEL
    if name not in PRESETS:
        raise CliError("unknown-model", f"unknown model {name!r}", "`hicache plan --list-models` lists the presets; or pass --config config.json")
    return PRESETS[name]


def _defaults_used(args) -> tuple[str, ...]:
    used = []
    if not args.model and not args.config:
        used.append(f"--model {DEFAULT_MODEL}")
    for flag, key in (("--tp", "tp"), ("--page-size", "page_size"), ("--layout", "layout"), ("--chunk-limit", "chunk_limit")):
        if getattr(args, key) is None:
            used.append(f"{flag} {DEFAULTS[key]}")
    if args.host_gb is None and args.ratio is None:
        used.append(f"--host-gb {DEFAULTS['host_gb']}")
    return tuple(used)


def build_plan(args) -> tuple[CapacityPlan, tuple[str, ...]]:
    """The capacity plan the `plan`/`apply` arguments describe, and the defaults it used."""
    model = _model(args)
    if args.host_gb is not None and args.ratio is not None:
        raise CliError("conflicting-flags", "--host-gb and --ratio both given", "size the pool by one of them")
    if args.ratio is not None and args.device_tokens is None:
        raise CliError("missing-flag", "--ratio needs --device-tokens", "e.g. --ratio 2 --device-tokens 500000")
    tp = _positive_int(args.tp or str(DEFAULTS["tp"]), "--tp")
    page_size = _positive_int(args.page_size or str(DEFAULTS["page_size"]), "--page-size")
    chunk = _size(args.chunk_limit or DEFAULTS["chunk_limit"], "--chunk-limit")
    if args.kv_dtype is not None and args.kv_dtype not in KV_DTYPES:
        raise CliError("bad-dtype", f"unknown --kv-dtype {args.kv_dtype!r}", f"one of {', '.join(sorted(KV_DTYPES))}")
    kernel_cap = kernel_pin_cap(args.kernel_release) if args.kernel_release else None
    hugepage = _size(args.hugepage_size, "--hugepage-size") if args.hugepage_size else None
    try:
        limits = Limits(chunk_limit_bytes=chunk, kernel_cap_bytes=kernel_cap, hugepage_bytes=hugepage)
    except PlanError as error:
        raise CliError("bad-limits", str(error), "check --chunk-limit and --hugepage-size") from None
    host_gb = None
    if args.ratio is None:
        host_gb = _positive_decimal(args.host_gb or DEFAULTS["host_gb"], "--host-gb")
    ratio = _positive_decimal(args.ratio, "--ratio") if args.ratio is not None else None
    device_tokens = _positive_int(args.device_tokens, "--device-tokens") if args.device_tokens else None
    ranks = _positive_int(args.ranks_per_host, "--ranks-per-host") if args.ranks_per_host else None
    memory = _size(args.host_memory, "--host-memory") if args.host_memory else None
    if ranks and memory is None:
        raise CliError("missing-flag", "--ranks-per-host needs --host-memory for the budget", "e.g. --host-memory 2TB --ranks-per-host 8")
    reserve = _size(args.reserve, "--reserve") if args.reserve else DEFAULT_RESERVE_BYTES
    try:
        plan = plan_capacity(
            model, limits=limits, tp=tp, page_size=page_size,
            layout=args.layout or DEFAULTS["layout"], kv_dtype=args.kv_dtype, host_gb=host_gb,
            device_tokens=device_tokens, host_to_device_ratio=ratio,
            mamba_slots=_positive_int(args.mamba_slots, "--mamba-slots"), ranks_per_host=ranks,
            host_memory_bytes=memory, reserve_bytes=reserve,
        )
    except ConfigError as error:
        raise CliError("bad-config", str(error), "check --tp against the model's KV heads, or --kv-dtype") from None
    except LayoutError as error:
        raise CliError("unsupported-layout", str(error), "pick a --layout the model's pools support") from None
    return plan, _defaults_used(args)


def _add_plan_arguments(parser) -> None:
    what = parser.add_argument_group("model and parallelism")
    what.add_argument("--model", help=f"embedded preset (default {DEFAULT_MODEL}; --list-models)")
    what.add_argument("--config", help="a HuggingFace config.json instead of a preset")
    what.add_argument("--tp", help="tensor-parallel size (default 8)")
    what.add_argument("--page-size", help="tokens per page (default 64)")
    what.add_argument("--layout", choices=LAYOUTS, help="host pool layout (default page_first_direct)")
    what.add_argument("--kv-dtype", help="KV cache dtype (default: the model's; bf16, fp8, ...)")
    what.add_argument("--mamba-slots", default="256", help="linear-attention state slots (default 256)")
    size = parser.add_argument_group("pool size (one of)")
    size.add_argument("--host-gb", help="host pool per rank in decimal GB, as SGLang's --hicache-size (default 100)")
    size.add_argument("--ratio", help="host-to-device ratio; needs --device-tokens")
    size.add_argument("--device-tokens", help="tokens of the device KV pool")
    caps = parser.add_argument_group("registration caps")
    caps.add_argument("--chunk-limit", help="largest cudaHostRegister call (default 64GiB)")
    caps.add_argument("--kernel-release", help="apply the per-pin cap of this Linux release (6.11-6.13)")
    caps.add_argument("--hugepage-size", help="hugetlbfs page size of the pool (e.g. 2MiB, 1GiB)")
    budget = parser.add_argument_group("budget (plan never reads the machine)")
    budget.add_argument("--host-memory", help="memory available on the host (e.g. 2TB, 1.5TiB)")
    budget.add_argument("--ranks-per-host", help="ranks sharing the host memory")
    budget.add_argument("--reserve", help="memory kept back (default 10GiB)")


def _plan_command(commands) -> None:
    plan = commands.add_parser("plan", help="capacity plan of a model's host pools (offline, pure)")
    _add_plan_arguments(plan)
    plan.add_argument("--list-models", action="store_true", help="list the embedded presets")
    plan.add_argument("--format", choices=("table", "json", "markdown"), default="table")
    plan.add_argument("--out", help="write the output to FILE instead of stdout")


def _doctor_command(commands) -> None:
    doctor = commands.add_parser("doctor", help="what this machine will do to a plan")
    doctor.add_argument("--plan", dest="plan_file", help="a saved JSON plan to check against this machine")
    doctor.add_argument("--format", choices=("table", "json"), default="table")


def _apply_command(commands) -> None:
    apply = commands.add_parser("apply", help="allocate, pre-fault and register a plan for real")
    _add_plan_arguments(apply)
    apply.add_argument("--plan", dest="plan_file", help="a saved JSON plan (instead of plan arguments)")
    apply.add_argument("--hold", default="0", help="seconds to hold the registration, or inf: until Ctrl-C (default 0)")
    apply.add_argument("--hugepages", choices=("off", "prefer", "required"), default="off")
    apply.add_argument("--threads", help="pre-fault threads (default: cores, at most 16)")
    apply.add_argument("--format", choices=("table", "json"), default="table")


_COMMANDS = {"plan": _plan_command, "doctor": _doctor_command, "apply": _apply_command}


def make_parser(only: str | None = None) -> argparse.ArgumentParser:
    """The argument parser; ``only`` builds just that subcommand (start-up time of `plan`)."""
    parser = _Parser(prog="hicache", description="Plan, check and apply cudaHostRegister of host KV-cache pools.")
    commands = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)
    for name, add in _COMMANDS.items():
        if only in (None, name):
            add(commands)
    return parser


def _list_models() -> str:
    lines = [f"{'preset':<20} {'family':<14} source"]
    for name, spec in PRESETS.items():
        mark = "  (default)" if name == DEFAULT_MODEL else ""
        lines.append(f"{name:<20} {spec.kind:<14} {spec.source}{mark}")
    return "\n".join(lines) + "\n"


def _emit(text: str, out: str | None) -> None:
    if out:
        try:
            with open(out, "w") as handle:
                handle.write(text)
        except OSError as error:
            raise CliError("bad-output", f"cannot write {out}: {error.strerror}", "pass a writable --out path") from None
        print(f"wrote {out}", file=sys.stderr)
    else:
        sys.stdout.write(text)


def _run_plan(args) -> int:
    from hicache._render import render

    if args.list_models:
        _emit(_list_models(), args.out)
        return 0
    plan, defaults = build_plan(args)
    if defaults and not any(getattr(args, k) for k in ("model", "config")):
        print("hicache plan: no model given; planning the default preset on default settings", file=sys.stderr)
    _emit(render(plan, args.format, defaults=defaults), args.out)
    if plan.budget is not None and not plan.budget.ok:
        raise CliError(
            "budget-refused", plan.budget.explain(),
            "lower --host-gb, run fewer --ranks-per-host, or add host memory", INFEASIBLE,
        )
    return 0


def main(argv: list[str] | None = None) -> int:
    """Entry point of `hicache` and `python -m hicache`; returns the exit code."""
    try:
        argv = sys.argv[1:] if argv is None else list(argv)
        only = argv[0] if argv and argv[0] in _COMMANDS else None
        args = make_parser(only).parse_args(argv)
        if args.command == "plan":
            return _run_plan(args)
        from hicache import _cli_machine  # doctor and apply need the effects layer

        if args.command == "doctor":
            return _cli_machine.run_doctor(args)
        return _cli_machine.run_apply(args, build_plan)
    except CliError as error:
        return _fail(error.ref, str(error), error.hint, error.code)
    except CapacityError as error:
        return _fail("budget-refused", str(error), "lower the pool size or free host memory", INFEASIBLE)
    except ApplyError as error:
        cause = error.__cause__
        if isinstance(cause, KeyboardInterrupt):
            return _fail("interrupted", str(error), "nothing is left registered", INTERRUPTED)
        if isinstance(cause, CudaCallError):
            return _fail("cuda-error", str(error), "run `hicache doctor`", CUDA_FAILURE)
        return _fail("apply-failed", str(error), "run `hicache doctor`", INFEASIBLE)
    except CudaCallError as error:
        ref = "cuda-unavailable" if error.__class__.__name__ == "CudaUnavailableError" else "cuda-error"
        return _fail(ref, str(error), "run `hicache doctor` on this machine", CUDA_FAILURE)
    except PlanError as error:
        return _fail("infeasible-plan", str(error), "raise --chunk-limit or change --layout/--page-size", INFEASIBLE)
    except HicacheError as error:
        return _fail("error", str(error), "run `hicache doctor`", INFEASIBLE)
    except KeyboardInterrupt:
        return _fail("interrupted", "interrupted", "nothing is left registered", INTERRUPTED)


def _fail(ref: str, message: str, hint: str, code: int) -> int:
    print(f"error[{ref}]: {message}", file=sys.stderr)
    print(f"hint: {hint}", file=sys.stderr)
    return code
