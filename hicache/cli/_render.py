"""Rendering of capacity plans and doctor findings: table and markdown for people, JSON for
tools. Owns wording and layout only; every number comes from the plan. Pure: imports
hicache.plan and the standard library, never torch, cuda or psutil (the plan path stays fast).
"""

from __future__ import annotations

import json

from hicache.plan import CapacityPlan, format_bytes, format_gb, to_jsonable

_DTYPE_BY_ITEMSIZE = {1: "uint8", 2: "bf16", 4: "float32", 8: "float64"}
_CAP_WHY = {
    "chunk_limit": "chunk limit",
    "driver_ceiling": "driver ceiling (r580+ refuse a call of 512 GiB or more)",
    "kernel_cap": "kernel cap (Linux 6.11-6.13: ~2 GB a call)",
    "call_cap": "call cap (registration overlaps the pre-fault; a call holds the driver <= the stall budget)",
}
_UNSET_HOW = {"kernel_cap": "set by --kernel-release / HICACHE_KERNEL_PIN_CAP", "call_cap": "set by --call-cap / HICACHE_CALL_CAP"}


def render_json(plan: CapacityPlan, sources: dict | None = None) -> str:
    """Deterministic JSON: schema version, sorted keys, integer bytes; ``cap_sources`` names
    what decided each cap (a flag, a HICACHE_* variable, the machine or the default)."""
    data = to_jsonable(plan)
    if sources:
        data["cap_sources"] = dict(sources)
    return json.dumps(data, sort_keys=True, indent=2) + "\n"


def _dtype(plan: CapacityPlan, pool: str, itemsize: int) -> str:
    if pool in ("indexer",):
        return "uint8"
    from hicache.plan import KV_DTYPES

    if pool == "mamba" and itemsize == 4:
        return "float32"
    return plan.kv_dtype if KV_DTYPES.get(plan.kv_dtype) == itemsize else _DTYPE_BY_ITEMSIZE.get(itemsize, f"{itemsize} B")


def _rows(plan: CapacityPlan):
    for pool in plan.pools:
        for buffer in pool.plan.buffers:
            spec, registration = buffer.spec, buffer.plan
            yield [
                pool.name, spec.name, pool.plan.layout.family, spec.layout,
                "(" + ", ".join(str(d) for d in spec.shape) + ")",
                _dtype(plan, pool.name, spec.itemsize), format_bytes(spec.nbytes),
                format_bytes(spec.copy_unit_bytes), format_bytes(registration.step_bytes),
                str(registration.call_count), format_bytes(registration.largest_call_bytes),
            ]


_HEAD = ["pool", "buffer", "family", "layout", "shape", "dtype", "size", "copy unit", "step", "calls", "largest call"]
_NARROW = (0, 1, 3, 5, 6, 7, 8, 9, 10)  # the table without family and shape: fits 100 columns
WIDTH = 100


def _wrap(lines: list[str], width: int) -> list[str]:
    """Prose lines folded at ``width`` (continuations indented); table rows are left alone."""
    out = []
    for line in lines:
        if len(line) <= width:
            out.append(line)
            continue
        import textwrap  # only for a long line: most plans have none (start-up, issue #35)

        indent = " " * (len(line) - len(line.lstrip()) + 2)
        out += textwrap.wrap(line, width, subsequent_indent=indent, break_on_hyphens=False)
    return out


def _size_line(plan: CapacityPlan) -> str:
    size = plan.size
    if plan.host_bytes is not None:
        source = f"{format_gb(plan.host_bytes)} per rank (--host-gb)"
    else:
        source = f"{plan.device_tokens:,} device tokens x ratio {plan.host_to_device_ratio}"
    return (
        f"{source} -> {size.tokens:,} tokens in {size.page_num:,} pages of {size.page_size} "
        f"({size.size_per_token_bytes:,} B per token)"
    )


def _caps_lines(plan: CapacityPlan, sources: dict | None = None) -> list[str]:
    binding = set(plan.limits.binding_caps())
    sources = sources or {}
    lines = []
    caps = plan.limits.caps()
    for name in ("chunk_limit", "call_cap", "driver_ceiling", "kernel_cap"):
        source = sources.get(name)
        if name in caps:
            mark = "  <- decides" if name in binding else ""
            origin = f"; from {source}" if source else ""
            lines.append(f"{format_bytes(caps[name]):>10}  {_CAP_WHY[name]}{origin}{mark}")
        else:
            origin = f" (from {source})" if source and source != "not checked" else ""
            lines.append(f"{'not set':>10}  {_CAP_WHY[name]}{origin}; {_UNSET_HOW[name]}")
    return lines


def _budget_line(plan: CapacityPlan) -> str:
    verdict = plan.budget
    if verdict is None:
        return (
            "not checked: pass --host-memory and --ranks-per-host, or run "
            "`hicache doctor --plan FILE` on the target machine"
        )
    return ("OK: " if verdict.ok else "REFUSED: ") + verdict.explain()


def _header(plan: CapacityPlan, defaults: tuple[str, ...]) -> list[str]:
    lines = [
        f"hicache capacity plan: {plan.model.name} ({plan.model.source}), "
        f"TP={plan.tp}, figures per rank"
    ]
    if defaults:
        lines.append("defaults used: " + " ".join(defaults))
    lines.append("units: GiB/MiB = 2^30/2^20 bytes (buffers, calls); GB = 10^9 bytes (host sizes, as --hicache-size)")
    return lines


def _summary(plan: CapacityPlan) -> list[str]:
    per_host = ""
    if plan.ranks_per_host:
        per_host = f"; {plan.max_calls_per_host} per host with {plan.ranks_per_host} ranks"
    return [
        f"total: {format_bytes(plan.total_bytes)} = {format_gb(plan.total_bytes)} per rank",
        f"registration: {plan.call_count} cudaHostRegister call(s) per rank{per_host}, "
        f"largest {format_bytes(plan.largest_call_bytes)}",
    ]


def render_table(plan: CapacityPlan, *, defaults: tuple[str, ...] = (), sources: dict | None = None,
                 wide: bool = False) -> str:
    """Aligned plain-text tables for a capacity reviewer, within 100 columns (``wide``: every
    column, family and shape too, and no folding)."""
    keep = range(len(_HEAD)) if wide else _NARROW
    head = _HEAD if wide else [*_HEAD[:-1], "largest"]
    rows = [[row[i] for i in keep] for row in [head, *_rows(plan)]]
    widths = [max(len(row[i]) for row in rows) for i in range(len(keep))]
    right = {k for k, i in enumerate(keep) if i >= 6}
    table = [
        "  ".join(cell.rjust(w) if i in right else cell.ljust(w) for i, (cell, w) in enumerate(zip(row, widths))).rstrip()
        for row in rows
    ]
    lines = _header(plan, defaults)
    lines += ["", "host pool: " + _size_line(plan), ""]
    prose = [*_summary(plan), "caps per call (<- the one that decides the step):",
             *("  " + line for line in _caps_lines(plan, sources))]
    if plan.notes:
        prose.append("notes:")
        prose += [f"  - {note}" for note in plan.notes]
    prose.append("budget: " + _budget_line(plan))
    if wide:
        return "\n".join(lines + table + [""] + prose) + "\n"
    return "\n".join(_wrap(lines, WIDTH) + table + [""] + _wrap(prose, WIDTH)) + "\n"


def render_markdown(plan: CapacityPlan, *, defaults: tuple[str, ...] = (), sources: dict | None = None) -> str:
    """The same content as markdown, for a review document."""
    header = _header(plan, defaults)
    lines = [f"## {header[0]}", ""]
    lines += [f"- {line}" for line in header[1:]]
    lines += [f"- host pool: {_size_line(plan)}", ""]
    lines.append("| " + " | ".join(_HEAD) + " |")
    lines.append("|" + "|".join("---:" if i >= 6 else "---" for i in range(len(_HEAD))) + "|")
    lines += ["| " + " | ".join(f"`{c}`" if i == 4 else c for i, c in enumerate(row)) + " |" for row in _rows(plan)]
    lines += ["", *[f"- {line}" for line in _summary(plan)], "- caps per call:"]
    lines += [f"  - {line.strip()}" for line in _caps_lines(plan, sources)]
    if plan.notes:
        lines.append("- notes:")
        lines += [f"  - {note}" for note in plan.notes]
    lines.append(f"- budget: {_budget_line(plan)}")
    return "\n".join(lines) + "\n"


def render(plan: CapacityPlan, fmt: str, *, defaults: tuple[str, ...] = (), sources: dict | None = None,
           wide: bool = False) -> str:
    if fmt == "json":
        return render_json(plan, sources)
    if fmt == "markdown":
        return render_markdown(plan, defaults=defaults, sources=sources)
    return render_table(plan, defaults=defaults, sources=sources, wide=wide)
