"""`hicache plan --model-path` as SGLang takes it: a local directory or a Hugging Face repo id -
read offline from this machine's Hugging Face cache, else the embedded preset of that source."""

from __future__ import annotations

import json
import os

import pytest

from hicache.cli import main
from hicache.cli._model_path import hub_cache_dir

LLAMA = "meta-llama/Llama-3.1-70B-Instruct"
SMALL = {"num_hidden_layers": 4, "num_attention_heads": 8, "num_key_value_heads": 2, "hidden_size": 512,
         "torch_dtype": "bfloat16"}


def _plan(capsys, *argv):
    code = main(["plan", "--format", "json", *argv])
    out = capsys.readouterr()
    return code, (json.loads(out.out) if code == 0 else None), out.err


def _cache_repo(cache, repo: str, config: dict | None, *, revision="0123abcd" * 5, refs=True, extra=()):
    """A repo in the layout huggingface_hub leaves: blobs, a snapshot whose config.json links to
    its blob, refs/main naming the snapshot (``refs``); ``extra``: more snapshots with configs."""
    root = cache / ("models--" + repo.replace("/", "--"))
    (root / "blobs").mkdir(parents=True)
    for snapshot, body in [(revision, config), *extra]:
        (root / "snapshots" / snapshot).mkdir(parents=True)
        if body is not None:
            blob = root / "blobs" / f"blob-{snapshot}"
            blob.write_text(json.dumps(body))
            os.symlink(os.path.relpath(blob, root / "snapshots" / snapshot), root / "snapshots" / snapshot / "config.json")
    if refs:
        (root / "refs").mkdir()
        (root / "refs" / "main").write_text(revision + "\n")
    return root


def test_a_presets_repo_id_plans_that_preset_when_the_cache_lacks_it(capsys, tmp_path, monkeypatch):
    """`--model-path deepseek-ai/DeepSeek-V3` (docs/store.md's launch line) plans the deepseek-v3
    preset - byte for byte what `--model deepseek-v3` plans - and says so; it was `is not a
    directory`."""
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path))
    code, by_path, err = _plan(capsys, "--model-path", "deepseek-ai/DeepSeek-V3", "--tp", "8")
    assert code == 0 and "is the embedded preset deepseek-v3" in err and str(tmp_path) in err
    _, by_name, _ = _plan(capsys, "--model", "deepseek-v3", "--tp", "8")
    assert by_path["pools"] == by_name["pools"] and by_path["totals"] == by_name["totals"]


def test_a_cached_repo_is_read_at_refs_main_before_any_preset(capsys, tmp_path, monkeypatch):
    """A repo in the Hugging Face cache is planned from its config.json at the snapshot refs/main
    names (a symlink into blobs, as huggingface_hub leaves it), even where a preset has that
    source: the cached config is the model SGLang would load. Named by its repo id, its source the
    config read."""
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path))
    _cache_repo(tmp_path, LLAMA, SMALL, extra=[("ffff0000" * 5, {**SMALL, "num_hidden_layers": 99})])
    code, plan, err = _plan(capsys, "--model-path", LLAMA)
    assert code == 0 and "preset" not in err
    config = tmp_path / "given.json"
    config.write_text(json.dumps(SMALL))
    _, expected, _ = _plan(capsys, "--config", str(config))
    assert plan["pools"] == expected["pools"] and plan["model"]["name"] == LLAMA
    assert plan["model"]["source"].endswith(os.path.join("snapshots", "0123abcd" * 5, "config.json"))


def test_one_snapshot_without_refs_is_read_and_several_are_refused_naming_them(capsys, tmp_path, monkeypatch):
    """Without refs/main the one snapshot holding a config.json is read; with two, the plan is
    refused naming both and the --config that picks one."""
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path))
    _cache_repo(tmp_path, "org/one", SMALL, refs=False)
    assert _plan(capsys, "--model-path", "org/one")[0] == 0
    _cache_repo(tmp_path, "org/two", SMALL, refs=False, extra=[("ffff0000" * 5, SMALL)])
    code, _, err = _plan(capsys, "--model-path", "org/two")
    assert code == 2 and err.startswith("error[bad-config]: --model-path org/two: the Hugging Face cache holds 2 ")
    assert "0123abcd" in err and "ffff0000" in err and "hint: pass --config " in err


@pytest.mark.parametrize("case", ["refs names a snapshot without config", "refs names no commit", "refs is a fifo"])
def test_a_cache_that_does_not_say_which_config_is_one_error(capsys, tmp_path, monkeypatch, case):
    """refs/main naming a snapshot without a config.json, or holding no commit (a path that
    would leave the snapshots), is one bad-config error; a FIFO at refs/main is not waited on (it
    is as if absent: the one snapshot is read)."""
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path))
    root = _cache_repo(tmp_path, "org/m", None if case.startswith("refs names a snapshot") else SMALL)
    if case == "refs names no commit":
        (root / "refs" / "main").write_text("../../../elsewhere\n")
    if case == "refs is a fifo":
        (root / "refs" / "main").unlink()
        os.mkfifo(root / "refs" / "main")
    code, _, err = _plan(capsys, "--model-path", "org/m")
    if case == "refs is a fifo":
        assert code == 0, err
    else:
        assert code == 2 and err.startswith("error[bad-config]: ") and "Traceback" not in err
        assert ("holds no config.json" if case.startswith("refs names a snapshot") else "names no commit") in err


def test_a_repo_id_found_nowhere_names_where_it_looked(capsys, tmp_path, monkeypatch):
    """An uncached repo id no preset has as its source: one error naming the cache looked in and
    the list of presets, hinting at the download of its config.json; a path that is no repo id
    keeps the plain error."""
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path))
    code, _, err = _plan(capsys, "--model-path", "org/unknown")
    assert code == 2 and f"not in the Hugging Face cache ({tmp_path})" in err and "--list-models" in err
    assert "huggingface-cli download org/unknown config.json" in err
    code, _, err = _plan(capsys, "--model-path", str(tmp_path / "nope"))
    assert code == 2 and err.startswith(f"error[bad-config]: --model-path {tmp_path / 'nope'} is not a directory")


def test_model_path_and_model_together_are_refused_by_their_names(capsys):
    """--model with --model-path is a conflict named as such (it was reported as --config)."""
    code, _, err = _plan(capsys, "--model", "llama-3.1-8b", "--model-path", LLAMA)
    assert code == 2 and "--model and --model-path both given" in err


@pytest.mark.parametrize("env, expected", [
    ({"HF_HUB_CACHE": "/a", "HUGGINGFACE_HUB_CACHE": "/b", "HF_HOME": "/c", "XDG_CACHE_HOME": "/d"}, "/a"),
    ({"HUGGINGFACE_HUB_CACHE": "/b", "HF_HOME": "/c", "XDG_CACHE_HOME": "/d"}, "/b"),
    ({"HF_HOME": "/c", "XDG_CACHE_HOME": "/d"}, "/c/hub"),
    ({"XDG_CACHE_HOME": "/d"}, "/d/huggingface/hub"),
    ({}, "/home/u/.cache/huggingface/hub"),
    ({"HF_HUB_CACHE": ""}, "/home/u/.cache/huggingface/hub"),
])
def test_the_hub_cache_is_where_huggingface_hub_looks(env, expected):
    """HF_HUB_CACHE, then HUGGINGFACE_HUB_CACHE, then HF_HOME/hub, then
    XDG_CACHE_HOME/huggingface/hub, then ~/.cache/huggingface/hub; an empty variable is unset."""
    assert hub_cache_dir(env, "/home/u") == expected
