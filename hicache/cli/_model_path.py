"""`--model-path` as SGLang takes it: a local model directory, or a Hugging Face repo id
(``org/name``). A repo id is read offline - the plan downloads nothing: its ``config.json`` in
this machine's Hugging Face cache (the revision ``refs/main`` names, where SGLang would load it
from), else the embedded preset whose source it is, else one error naming where it looked."""

from __future__ import annotations

import os
import re

from hicache.cli._common import CliError

#: what Hugging Face accepts as a repo id: ``org/name`` of letters, digits, ``-``, ``_``, ``.``
_REPO_ID = re.compile(r"[A-Za-z0-9][\w.-]*/[A-Za-z0-9][\w.-]*")


def hub_cache_dir(env, home: str) -> str:
    """The Hugging Face hub cache, as huggingface_hub finds it: ``HF_HUB_CACHE``, else the older
    ``HUGGINGFACE_HUB_CACHE``, else ``HF_HOME/hub``, else ``XDG_CACHE_HOME/huggingface/hub``,
    else ``~/.cache/huggingface/hub`` (``home``: the user's home directory)."""
    for name in ("HF_HUB_CACHE", "HUGGINGFACE_HUB_CACHE"):
        if env.get(name):
            return os.path.expanduser(env[name])
    if env.get("HF_HOME"):
        return os.path.join(os.path.expanduser(env["HF_HOME"]), "hub")
    cache = env.get("XDG_CACHE_HOME") or os.path.join(home, ".cache")
    return os.path.join(cache, "huggingface", "hub")


def resolve_model_path(value: str, presets, *, env, home: str | None = None):
    """What ``--model-path value`` names: ``("config", path, name)`` - a config.json to read and
    the model's name - or ``("preset", key, note)``. ``env``: the environment (the cache's
    variables). A `CliError` naming every place looked."""
    hint = "pass a local model directory holding config.json (or --config FILE)"
    if os.path.isdir(value):
        return "config", os.path.join(value, "config.json"), value
    if not _REPO_ID.fullmatch(value):
        raise CliError("bad-config", f"--model-path {value} is not a directory", hint)
    cache = hub_cache_dir(env, os.path.expanduser("~") if home is None else home)
    found = _cached_config(value, cache)
    if found is not None:
        return "config", found, value
    for key, spec in presets.items():
        if spec.source.casefold() == value.casefold():
            return "preset", key, f"--model-path {value} is the embedded preset {key} (not in the Hugging Face cache {cache})"
    raise CliError(
        "bad-config",
        f"--model-path {value}: no such directory, not in the Hugging Face cache ({cache}), and no embedded preset's "
        "source (hicache plan --list-models)",
        f"fetch its config.json (huggingface-cli download {value} config.json), or pass --config FILE or --model PRESET")


def _cached_config(repo: str, cache: str) -> str | None:
    """The cached ``config.json`` of ``repo`` at ``refs/main`` (else the one snapshot holding
    one); None where the repo is not cached or holds no config; a `CliError` where ``refs/main``
    names a snapshot without one or several snapshots leave the choice open."""
    root = os.path.join(cache, "models--" + repo.replace("/", "--"))
    snapshots = os.path.join(root, "snapshots")
    if not os.path.isdir(snapshots):
        return None
    revision = _read_ref(os.path.join(root, "refs", "main"))
    if revision is not None:
        config = os.path.join(snapshots, revision, "config.json")
        if not os.path.isfile(config):
            raise CliError("bad-config", f"--model-path {repo}: the Hugging Face cache's refs/main names snapshot "
                           f"{revision}, which holds no config.json ({config})",
                           f"fetch it (huggingface-cli download {repo} config.json), or pass --config FILE")
        return config
    held = sorted(name for name in os.listdir(snapshots) if os.path.isfile(os.path.join(snapshots, name, "config.json")))
    if len(held) > 1:
        raise CliError("bad-config", f"--model-path {repo}: the Hugging Face cache holds {len(held)} snapshots with a "
                       f"config.json ({', '.join(held)}) and no refs/main to choose one",
                       f"pass --config {os.path.join(snapshots, held[0], 'config.json')} (or another snapshot's)")
    return os.path.join(snapshots, held[0], "config.json") if held else None


def _read_ref(path: str) -> str | None:
    """The commit a ref file names (hex), or None where there is no such regular file; opened
    without blocking (a FIFO there is refused, never waited on), its name checked before it is
    joined to a path."""
    import stat

    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError:
        return None
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            return None
        raw = os.read(fd, 200).strip()
    finally:
        os.close(fd)
    if not re.fullmatch(rb"[0-9a-f]{7,64}", raw):
        raise CliError("bad-config", f"{path} names no commit (got {raw[:80]!r})",
                       "pass --config FILE with the snapshot's config.json")
    return raw.decode()
