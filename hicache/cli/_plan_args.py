"""The plan arguments `plan` and `apply` share, and the capacity plan they describe.

Owns turning flags (and the ``HICACHE_*`` settings, through `hicache.plan.resolve_limits`, the
one place caps are merged) into a `CapacityPlan`, the cap sources and the defaults used.
Defaults come from `hicache.plan.CAPACITY_DEFAULTS`. Pure: no machine access unless the
caller passes a probed kernel release.
"""

from __future__ import annotations

import os

from hicache.cli._common import (
    CONFIG_LIMIT_BYTES, INFEASIBLE, CliError, positive_decimal, positive_int, read_json_file, size,
)
from hicache.errors import CopyUnitOverCapError, LayoutError
from hicache.plan.settings import BY_NAME, size_in_range
from hicache.plan import DEFAULT_CALL_CAP_BYTES
from hicache.plan import (
    CAPACITY_DEFAULTS,
    DEFAULT_CHUNK_LIMIT_BYTES,
    DEFAULT_RESERVE_BYTES,
    KV_DTYPES,
    PRESETS,
    CapacityPlan,
    ConfigError,
    EnvError,
    ResolvedLimits,
    format_bytes,
    model_from_hf_config,
    parse_kernel_release,
    plan_capacity,
    resolve_limits,
)

LAYOUTS = ("page_first_direct", "page_first", "layer_first", "page_head")

#: Work is bounded before it starts: past these a plan is refused (or needs --force).
MAX_HOST_GB = 10**6  # 1 PB per rank
MAX_RATIO = 10**4  # host-to-device ratio: SGLang's default is 2; 10,000 is a typo's scale already
MAX_CALLS = 100_000  # cudaHostRegister calls per rank a plan may have without --force
MAX_FORCED_CALLS = 1_000_000  # ... and with it (its JSON is ~60 MB; past this, time and memory run away)


def _model(args):
    name = None
    if args.model_path:
        if args.config:
            raise CliError("conflicting-flags", "--model-path and --config both given", "pass one of them")
        if args.model:
            raise CliError("conflicting-flags", "--model and --model-path both given", "pass one of them")
        from hicache.cli._model_path import resolve_model_path

        kind, found, said = resolve_model_path(args.model_path, PRESETS, env=os.environ)  # the HF cache's variables
        if kind == "preset":
            import sys

            print(f"hicache: {said}", file=sys.stderr)  # plan and apply both read --model-path here
            return PRESETS[found]
        args.config, name = found, said
    if args.config and args.model:
        raise CliError("conflicting-flags", "--model and --config both given", "pass one of them")
    if args.config:
        path = args.config
        data = read_json_file(path, "--config", CONFIG_LIMIT_BYTES, "pass the path of a HuggingFace config.json", "bad-config")
        try:
            return model_from_hf_config(data, name=name or str(path), source=str(path))
        except ConfigError as error:
            raise CliError("bad-config", str(error), "check the config.json, or use --model with a preset") from None
    name = args.model or CAPACITY_DEFAULTS["model"]
    if name not in PRESETS:
        import difflib

        close = difflib.get_close_matches(name.lower(), list(PRESETS), n=3, cutoff=0.5)
        guess = f"did you mean {' or '.join(close)}? " if close else ""
        raise CliError("unknown-model", f"unknown model {name!r}",
                       f"{guess}`hicache plan --list-models` lists the presets; or pass --config config.json")
    return PRESETS[name]


def _is_zero(text: str) -> bool:
    try:
        return text.isascii() and float(text) == 0.0
    except ValueError:
        return False


def _defaults_used(args, sources: dict) -> tuple[str, ...]:
    used = []
    if not args.model and not args.config and not getattr(args, "model_path", None):
        used.append(f"--model {CAPACITY_DEFAULTS['model']}")
    for flag, key in (("--tp", "tp"), ("--page-size", "page_size"), ("--layout", "layout")):
        if getattr(args, key) is None:
            used.append(f"{flag} {CAPACITY_DEFAULTS[key]}")
    if sources.get("chunk_limit") == "default":
        used.append(f"--chunk-limit {DEFAULT_CHUNK_LIMIT_BYTES // 2**30}GiB")
    if sources.get("call_cap") == "default":
        used.append(f"--call-cap {DEFAULT_CALL_CAP_BYTES // 2**30}GiB")
    if args.host_gb is None and args.ratio is None:
        used.append(f"--host-gb {CAPACITY_DEFAULTS['host_gb']}")
    return tuple(used)


def limits_from_args(args, *, env=None, machine_kernel_release: str | None = None, os_page_bytes: int = 4096) -> ResolvedLimits:
    """The caps the flags ask for, merged with ``env``'s ``HICACHE_*`` settings (a flag wins)."""
    if args.kernel_release is not None and parse_kernel_release(args.kernel_release) is None:
        raise CliError("bad-kernel-release", f"--kernel-release {args.kernel_release!r} is not a Linux release",
                       "e.g. --kernel-release 6.12, or what `uname -r` prints on the target machine")
    chunk = size(args.chunk_limit, "--chunk-limit") if args.chunk_limit else None
    call_cap = getattr(args, "call_cap", None)
    if call_cap:
        call_cap = "none" if call_cap.strip().lower() == "none" else size(call_cap, "--call-cap", minimum=4096)
    hugepage = size(args.hugepage_size, "--hugepage-size") if args.hugepage_size else None
    if hugepage is not None and not size_in_range("HICACHE_HUGEPAGE_SIZE", hugepage):
        raise CliError("bad-size", f"--hugepage-size {args.hugepage_size} must be "
                       f"{BY_NAME['HICACHE_HUGEPAGE_SIZE'].range}", "hugetlbfs page sizes: 2MiB or 1GiB on x86-64 "
                       "(ls /sys/kernel/mm/hugepages)")
    try:
        return resolve_limits(
            env=os.environ if env is None else env, chunk_limit_bytes=chunk,
            kernel_release=args.kernel_release or None, hugepage_bytes=hugepage,
            machine_kernel_release=machine_kernel_release, os_page_bytes=os_page_bytes, call_cap_bytes=call_cap or None,
        )
    except EnvError as error:
        raise CliError("bad-limits", str(error),
                       "check --chunk-limit, --call-cap, --hugepage-size and the HICACHE_* variables") from None


def build_plan(args, resolved: ResolvedLimits | None = None) -> tuple[CapacityPlan, tuple[str, ...], dict]:
    """The capacity plan the `plan`/`apply` arguments describe, the defaults it used and the
    source of each cap. ``resolved``: caps already resolved (``apply`` probes the machine)."""
    model = _model(args)
    if args.host_gb is not None and args.ratio is not None:
        if _is_zero(args.host_gb):  # SGLang's --hicache-size 0: "size by --hicache-ratio"
            args.host_gb = None
        else:
            raise CliError("conflicting-flags", "--host-gb and --ratio both given",
                           "size the pool by one of them (--host-gb 0 means: by --ratio, as SGLang's --hicache-size 0)")
    if args.ratio is not None and args.device_tokens is None:
        raise CliError("missing-flag", "--ratio needs --device-tokens", "e.g. --ratio 2 --device-tokens 500000")
    if args.device_tokens is not None and args.ratio is None:
        raise CliError("missing-flag", "--device-tokens is read only with --ratio",
                       "size the pool by --ratio R --device-tokens N, or by --host-gb alone")
    tp = positive_int(args.tp or str(CAPACITY_DEFAULTS["tp"]), "--tp")
    page_size = positive_int(args.page_size or str(CAPACITY_DEFAULTS["page_size"]), "--page-size")
    if args.kv_dtype == "auto":  # SGLang's default: the model's dtype
        args.kv_dtype = None
    if args.kv_dtype is not None and args.kv_dtype not in KV_DTYPES:
        raise CliError("bad-dtype", f"unknown --kv-dtype {args.kv_dtype!r}", f"one of {', '.join(sorted(KV_DTYPES))}")
    resolved = limits_from_args(args) if resolved is None else resolved
    host_gb = None
    if args.ratio is None:
        host_gb = positive_decimal(args.host_gb or CAPACITY_DEFAULTS["host_gb"], "--host-gb")
        if host_gb > MAX_HOST_GB:
            raise CliError("bad-size", f"--host-gb {args.host_gb} is over {MAX_HOST_GB:,} GB per rank",
                           "host sizes are decimal GB per rank, as SGLang's --hicache-size")
        calls = int(host_gb * 10**9) // resolved.limits.effective_cap_bytes
        if calls > MAX_CALLS and not getattr(args, "force", False):
            raise CliError(
                "too-many-calls",
                f"about {calls:,} cudaHostRegister calls per rank at {resolved.limits.effective_cap_bytes:,} bytes "
                f"each: over {MAX_CALLS:,}",
                f"{_cap_fix(resolved.limits, resolved.sources)}; or pass --force to plan it anyway",
            )
    ratio = positive_decimal(args.ratio, "--ratio") if args.ratio is not None else None
    if ratio is not None and ratio > MAX_RATIO:
        raise CliError("bad-size", f"--ratio {args.ratio} is over {MAX_RATIO:,}",
                       "the host pool is --ratio times the device pool (SGLang's --hicache-ratio, e.g. 2)")
    device_tokens = positive_int(args.device_tokens, "--device-tokens") if args.device_tokens else None
    ranks = positive_int(args.ranks_per_host, "--ranks-per-host") if args.ranks_per_host else None
    memory = size(args.host_memory, "--host-memory") if args.host_memory else None
    if ranks and memory is None:
        raise CliError("missing-flag", "--ranks-per-host needs --host-memory for the budget", "e.g. --host-memory 2TB --ranks-per-host 8")
    reserve = size(args.reserve, "--reserve", minimum=0) if args.reserve else DEFAULT_RESERVE_BYTES
    try:
        plan = plan_capacity(
            model, limits=resolved.limits, tp=tp, page_size=page_size,
            layout=args.layout or CAPACITY_DEFAULTS["layout"], kv_dtype=args.kv_dtype, host_gb=host_gb,
            device_tokens=device_tokens, host_to_device_ratio=ratio,
            mamba_slots=positive_int(args.mamba_slots, "--mamba-slots"), ranks_per_host=ranks,
            host_memory_bytes=memory, reserve_bytes=reserve,
        )
    except ConfigError as error:
        raise CliError("bad-config", str(error), "check --tp against the model's KV heads, or --kv-dtype") from None
    except LayoutError as error:
        raise CliError("unsupported-layout", str(error), "pick a --layout the model's pools support") from None
    except CopyUnitOverCapError as error:
        raise CliError("infeasible-plan", str(error), _unit_fix(error, resolved.sources), INFEASIBLE) from None
    _check_bounded(plan, args, ratio is not None, resolved.sources)
    return plan, _defaults_used(args, resolved.sources), resolved.sources


_CAP_FIXES = {
    "chunk_limit": "raise --chunk-limit (or HICACHE_REGISTER_CHUNK)",
    "call_cap": "raise --call-cap (or HICACHE_CALL_CAP; none drops it, and registration waits for the whole pre-fault)",
    "kernel_cap": "the kernel cap decides the call size: raise or unset HICACHE_KERNEL_PIN_CAP (or check --kernel-release)",
    "driver_ceiling": "the driver ceiling decides the call size: raise or unset HICACHE_DRIVER_CEILING",
}


#: what raises each cap, by the name `Limits.binding_caps` gives it
_CAP_KNOBS = {"chunk_limit": "--chunk-limit", "call_cap": "--call-cap",
              "kernel_cap": "HICACHE_KERNEL_PIN_CAP (or --kernel-release)", "driver_ceiling": "HICACHE_DRIVER_CEILING"}


def _unit_fix(error, sources: dict) -> str:
    """How to fit a page copy larger than the call cap: raise every cap that decides (raising
    one of two equal ones changes nothing), or make the page smaller."""
    def both(words):
        return " and ".join(dict.fromkeys(words))

    return (f"a page copy is {format_bytes(error.unit_bytes)}: raise {both(_CAP_KNOBS[c] for c in error.caps)} to that "
            f"or more (now {format_bytes(error.cap_bytes)}, from {both(sources.get(c, 'default') for c in error.caps)}), "
            "or use fewer tokens a page (--page-size)")


def _cap_fix(limits, sources: dict) -> str:
    """How to get larger calls: the fix for whichever cap decides the call size, with its source."""
    binding = limits.binding_caps()[0]
    return f"{_CAP_FIXES[binding]} (now {format_bytes(limits.effective_cap_bytes)}, from {sources.get(binding, 'default')})"


def _check_bounded(plan, args, by_ratio: bool, sources: dict) -> None:
    """Every way of sizing a pool (--host-gb, or --ratio x --device-tokens) meets the same
    bounds before anything reads the plan's ranges (they are lazy until then): at most 1 PB
    per rank, at most MAX_CALLS registration calls per rank without --force."""
    sizing = "lower --ratio or --device-tokens" if by_ratio else "lower --host-gb"
    if plan.total_bytes > MAX_HOST_GB * 10**9:
        raise CliError("bad-size", f"the host pool would be {format_bytes(plan.total_bytes)} per rank: over "
                       f"{MAX_HOST_GB:,} GB (1 PB)", f"{sizing}; sizes are per rank")
    if plan.call_count > MAX_FORCED_CALLS:
        raise CliError("too-many-calls", f"{plan.call_count:,} cudaHostRegister calls per rank: over {MAX_FORCED_CALLS:,}, "
                       "even with --force", f"{_cap_fix(plan.limits, sources)}, or {sizing}")
    if plan.call_count > MAX_CALLS and not getattr(args, "force", False):
        raise CliError(
            "too-many-calls",
            f"{plan.call_count:,} cudaHostRegister calls per rank at {plan.limits.effective_cap_bytes:,} bytes each: "
            f"over {MAX_CALLS:,}",
            f"{_cap_fix(plan.limits, sources)}; or {sizing}, or pass --force to plan it anyway",
        )


def add_plan_arguments(parser, *, budget_title: str = "budget (plan never reads the machine)") -> None:
    what = parser.add_argument_group("model and parallelism")
    what.add_argument("--model", help=f"embedded preset (default {CAPACITY_DEFAULTS['model']}; --list-models)")
    what.add_argument("--config", help="a HuggingFace config.json instead of a preset")
    what.add_argument("--model-path", help="as SGLang's: a local model directory holding config.json, or a Hugging "
                      "Face repo id - read offline from the Hugging Face cache, else the preset of that source")
    what.add_argument("--tp", "--tp-size", dest="tp",
                      help=f"tensor-parallel size (default {CAPACITY_DEFAULTS['tp']}, as SGLang's --tp-size)")
    what.add_argument("--page-size", help=f"tokens per page (default {CAPACITY_DEFAULTS['page_size']})")
    what.add_argument("--layout", "--hicache-mem-layout", dest="layout", choices=LAYOUTS,
                      help=f"host pool layout (default {CAPACITY_DEFAULTS['layout']})")
    what.add_argument("--kv-dtype", "--kv-cache-dtype", dest="kv_dtype",
                      help="KV cache dtype (default or 'auto': the model's; bf16, fp8_e4m3, ...)")
    what.add_argument("--mamba-slots", default=str(CAPACITY_DEFAULTS["mamba_slots"]),
                      help=f"linear-attention state slots (default {CAPACITY_DEFAULTS['mamba_slots']})")
    size_group = parser.add_argument_group("pool size (one of)")
    size_group.add_argument("--host-gb", "--hicache-size", dest="host_gb",
                            help=f"host pool per rank in decimal GB, as SGLang's --hicache-size (default {CAPACITY_DEFAULTS['host_gb']})")
    size_group.add_argument("--ratio", "--hicache-ratio", dest="ratio", help="host-to-device ratio; needs --device-tokens")
    size_group.add_argument("--device-tokens", help="tokens of the device KV pool")
    caps = parser.add_argument_group("registration caps (a flag beats HICACHE_REGISTER_CHUNK / HICACHE_CALL_CAP / "
                                     "HICACHE_KERNEL_PIN_CAP / HICACHE_HUGEPAGE_SIZE)")
    caps.add_argument("--chunk-limit", help="largest cudaHostRegister call (default: HICACHE_REGISTER_CHUNK, else 64GiB)")
    caps.add_argument("--call-cap", help="largest call so registration overlaps the pre-fault and holds the driver at "
                                         "most the stall budget (default: HICACHE_CALL_CAP, else 4GiB; none: no such cap)")
    caps.add_argument("--kernel-release", help="apply the per-pin cap of this Linux release (6.11-6.13)")
    caps.add_argument("--hugepage-size", help="hugetlbfs page size of the pool (e.g. 2MiB, 1GiB)")
    budget = parser.add_argument_group(budget_title)
    budget.add_argument("--host-memory", help="memory available on the host (e.g. 2TB, 1.5TiB)")
    budget.add_argument("--ranks-per-host", help="ranks sharing the host memory")
    budget.add_argument("--reserve", help="memory kept back (default 10GiB)")
    parser.add_argument("--force", action="store_true",
                        help=f"plan even past {MAX_CALLS:,} registration calls per rank")
