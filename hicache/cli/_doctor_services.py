"""`hicache doctor`'s rules about what runs on the machine: every HICACHE_* variable (the one
table), which processes share the host-wide budget, the SGLang plug-in, and room for (and the
state of) a node store.
"""

from __future__ import annotations



from hicache.plan import format_bytes

from hicache.cli._doctor_context import Check, Context


def _environment(c: Context) -> list[Check]:
    """Every HICACHE_* variable of the one table (hicache/plan/_env.py), as the bring-ups will
    read it: one FAIL line per bad value, named by the variable; a set HICACHE_* variable the
    table does not know is a warning (a typo reads as unset)."""
    from hicache.effects import for_cli
    from hicache.plan.settings import SETTINGS, unknown_variables

    problems = for_cli.environment_problems(c.env)
    unknown = unknown_variables(c.env)
    given = [s.name for s in SETTINGS if (c.env.get(s.name) or "").strip()]
    bad = {p.name for p in problems}
    checks = [Check(p.name, "fail", p.reason, f"fix or unset {p.name} (docs/environment.md: what it takes)" if p.value
                    else f"set {p.name} to a directory of yours (docs/environment.md)") for p in problems]
    finding = (f"{len(SETTINGS)} HICACHE_* settings known; set: "
               + (", ".join(f"{n}={c.env[n]!r}" for n in given) if given else "none"))
    if unknown:
        finding += f"; unknown: {', '.join(unknown)} (read as unset)"
    if problems:
        return [Check("environment", "fail", finding + f"; {len(bad)} cannot be used (below)",
                      "fix or unset each variable named below")] + checks
    if unknown:
        return [Check("environment", "warn", finding,
                      "check the spelling against docs/environment.md")]
    return [Check("environment", "pass", finding + "; all valid")]


def _host_scope(c: Context) -> Check:
    """Which processes share the host-wide budget: those that see the same runtime directory as
    the same user. In a container the default directory is the container's own, so servers in
    other containers on the host budget its memory each alone - a warning unless
    HICACHE_RUNTIME_DIR was chosen."""
    from hicache.effects import for_cli

    where = c.facts.runtime_dir
    # unreadable, or naming what cannot hold the files (a FIFO, another user's): the environment rule's FAIL says why
    if where is None or any(p.name == "HICACHE_RUNTIME_DIR" for p in for_cli.environment_problems(c.env)):
        return Check("host_scope", "pass", "the runtime directory: see HICACHE_RUNTIME_DIR above")
    chosen = bool((c.env.get("HICACHE_RUNTIME_DIR") or "").strip())
    source = ("HICACHE_RUNTIME_DIR" if chosen else "$XDG_RUNTIME_DIR" if (c.env.get("XDG_RUNTIME_DIR") or "")
              else "the default")
    finding = (f"budget lock, ledger and turnstile in {where} ({source}): the host-wide budget is shared by the "
               "processes of this user that see this directory")
    if c.facts.container and not chosen:
        return Check("host_scope", "warn", finding + f"; this process runs in a container ({c.facts.container}), so "
                     "that directory is the container's own: servers in other containers of this host budget its "
                     "memory each alone", "bind-mount one host directory (mode 0700, the same uid) into every "
                     "container of the host and set HICACHE_RUNTIME_DIR to it; one server per host needs nothing")
    return Check("host_scope", "pass", finding)


def _sglang(c: Context) -> Check:
    """Whether SGLang is installed, and whether hicache's plug-in will load in its processes."""
    from hicache.compat import sglang_plugin
    from hicache.effects import for_sglang
    from hicache.errors import EnvError

    replaces = ", ".join(target.rsplit(".", 1)[1] for target in sglang_plugin.TARGETS)
    try:
        enabled = for_sglang.sglang_plugin_enabled(c.env)
    except EnvError as error:
        return Check("sglang", "fail", str(error), "HICACHE_SGLANG=on or off")
    version = sglang_plugin.sglang_version()
    if version is None:
        return Check("sglang", "pass", "SGLang is not installed: the plug-in has nothing to load into")
    low, high = (".".join(map(str, v)) for v in sglang_plugin.TESTED_RANGE)
    if "hicache" not in sglang_plugin.entry_point_names():
        return Check("sglang", "fail", f"SGLang {version}: hicache's entry point is not in group sglang.srt.plugins",
                     'reinstall hicache in this environment: pip install "hicache[cuda]"')
    if not sglang_plugin.admitted(c.env):
        return Check("sglang", "warn", f"SGLang {version}: SGLANG_PLUGINS={c.env.get('SGLANG_PLUGINS')!r} leaves "
                     "hicache out: SGLang's own registration stays", "add hicache to SGLANG_PLUGINS")
    if not enabled:
        return Check("sglang", "warn", f"SGLang {version}: HICACHE_SGLANG=off: SGLang's own registration stays",
                     "unset HICACHE_SGLANG to let hicache register host pools")
    if not sglang_plugin.supported(version):
        return Check("sglang", "warn", f"SGLang {version} is outside the tested range (>={low}, <{high}): the plug-in "
                     "patches nothing", f"run SGLang {low}, or hicache's drop-in helpers (docs/sglang.md)")
    return Check("sglang", "pass", f"SGLang {version}: the hicache plug-in loads in every SGLang process and "
                 f"replaces {replaces}")


SHM = "/dev/shm"
SHM_SMALL_BYTES = 10**9  # Docker's default /dev/shm is 64 MB: a node store needs GBs


#: the arena path whose directory's room is read: a name nothing is expected at (the backing's
#: check says what is at the path itself first - an arena named "arena" there is not the mount)
PROBE = "{}/.hicache-doctor-room-probe"


def _store_room(c: Context) -> Check:
    """Room for a node store: /dev/shm's tmpfs and every hugetlbfs mount with its free pages."""
    from hicache.effects import arena
    from hicache.errors import ArenaError

    parts, status, hint = [], "pass", ""
    try:
        shm = arena.backing_of(PROBE.format(SHM), root=c.root)  # a file there: its directory is /dev/shm
        parts.append(f"{SHM} ({shm.kind}) {format_bytes(shm.free_bytes)} free")
        if shm.free_bytes < SHM_SMALL_BYTES:
            status, hint = "warn", "a container's /dev/shm is 64 MB by default: docker run --shm-size=64g (docs/store.md)"
    except ArenaError as error:
        status, hint = "warn", "node store arenas go on tmpfs or hugetlbfs (docs/store.md)"
        parts.append(str(error).split(": ", 1)[-1])
    try:
        huge = [m for m in arena.mounts(root=c.root) if m.fstype == "hugetlbfs"]
    except OSError:
        huge = []
    for mount in huge:
        try:
            room = arena.backing_of(PROBE.format(mount.point), root=c.root).free_bytes
            parts.append(f"hugetlbfs {mount.point} ({format_bytes(mount.pagesize_bytes or 2**21)} pages) "
                         f"{format_bytes(room)} free")
        except (ArenaError, OSError):
            parts.append(f"hugetlbfs {mount.point} (not readable)")
    return Check("store_room", status, "; ".join(parts) or "no tmpfs or hugetlbfs found", hint)


#: what the node store's reads and writes run through: `slot_ops("auto")` picks the C helper where it was built
SLOT_OPS_NATIVE = "slot operations: the C helper (a batch per call, checksummed as copied)"
SLOT_OPS_FALLBACK = ("slot operations: the Python fallback - the C helper is not built (reads and writes several "
                     "times slower)")
SLOT_OPS_HINT = "reinstall hicache where a C compiler (gcc/cc) is available"


def _store(c: Context) -> Check:
    """The node store's slot operations (the C helper, or the slower fallback where it was not
    built), and the arena `--store PATH` names: its geometry, pages held and torn slots (nothing
    changed)."""
    from hicache.effects import arena

    native = arena.slot_ops("auto") is arena.NativeSlotOps
    ops, status, hint = (SLOT_OPS_NATIVE, "pass", "") if native else (SLOT_OPS_FALLBACK, "warn", SLOT_OPS_HINT)
    if c.store is None:
        return Check("store", status, f"no arena given (--store PATH checks one); {ops}", hint)
    from hicache.errors import ArenaBeingCreatedError, ArenaError
    from hicache.store import SlotIndex

    try:
        attached = arena.attach_arena(c.store, root=c.root)
    except ArenaBeingCreatedError as error:
        return Check("store", "warn", str(error), f"run doctor again once pid {error.creator}'s create has ended")
    except ArenaError as error:
        return Check("store", "fail", str(error), "hicache store create PATH makes one (docs/store.md)")
    try:
        census = SlotIndex(attached).census()
        plan = attached.plan
        finding = (f"{c.store}: {attached.backing.kind}, {plan.slots:,} slots of {plan.slot_bytes:,} bytes, "
                   f"{census.pages:,} pages held, {census.torn} torn; {ops}")
        if census.torn:
            torn_hint = "torn slots are a dead writer's: the next engine's attach reclaims them"
            return Check("store", "warn", finding, "; ".join(filter(None, (torn_hint, hint))))
        return Check("store", status, finding, hint)
    finally:
        attached.close()


#: The rules, in the order they print.
