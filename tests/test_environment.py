"""The one table of HICACHE_* variables (hicache/plan/_env.py), held to what it promises: every
variable the code reads is in it, docs/environment.md is generated from it, `hicache doctor`
FAILs every invalid value of every row (the invalid values come from this file's own oracle of
each kind, not from the table), and `hicache apply` reads the environment as the pools do."""

from __future__ import annotations

import ast
import json
import os
import re
from pathlib import Path

import pytest

from hicache.cli._doctor import doctor_checks
from hicache.cli._main import main
from hicache.plan._env import BY_NAME, SETTINGS, env_value, environment_markdown

ROOT = Path(__file__).resolve().parents[1]
#: Names in hicache's source that look like a variable and are not one.
NOT_VARIABLES = {"HICACHE_HOST_MEMORY_RESERVE_BYTES"}  # a Python constant (SGLang's name for the reserve)


def _invalid(setting, tmp_path: Path) -> list[str]:
    """Values no reader may accept, by kind and range - written here, independently of the
    table's own parser: garbage, out of range by one step, non-ASCII digits, non-finite."""
    kind = setting.kind
    if kind == "bool":
        return ["maybe", "2", "١", "yes please"]
    if kind == "choice":
        return ["bogus", setting.choices[0] + "x"]
    if kind == "size":
        values = ["lots", "0", "-1GiB", "12XB", "١٢GiB", str(int(setting.minimum) - 1)]
        if setting.maximum:
            values.append(str(int(setting.maximum) * 2))
        if setting.power_of_two:
            values.append(str(int(setting.minimum) * 3))
        return values
    if kind in ("count", "concurrency"):
        return ["abc", "-1", "1.5", "٣", str(int(setting.maximum) + 1)] + (["0"] if kind == "count" else ["auto2"])
    if kind == "seconds":
        return ["abc", "0", "-1", "nan", "inf", "1e400", "١", str(int(setting.maximum) * 10)]
    # paths: what each is used as
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    plain = tmp_path / "plain"
    plain.write_text("")
    link = tmp_path / "link"
    link.symlink_to(plain)
    if setting.name == "HICACHE_TRACE":
        return [str(tmp_path), str(fifo), str(link), str(tmp_path / "missing" / "t.json"), "/proc/hicache/t.json"]
    if setting.name == "HICACHE_RUNTIME_DIR":
        shared = tmp_path / "shared"
        shared.mkdir(mode=0o755)
        shared.chmod(0o755)
        # each bit the check guards on its own (0755 sets group and other bits together): group or
        # other, read or write
        opened = []
        for mode in (0o770, 0o750, 0o720, 0o705, 0o702):
            directory = tmp_path / f"mode-{mode:o}"
            directory.mkdir()
            directory.chmod(mode)
            opened.append(str(directory))
        # /proc: os.access() says root may create there, mkdir says no (doctor passed it, issue #54)
        return [str(plain), str(fifo), str(shared), *opened, str(tmp_path / "missing" / "deeper"),
                "/proc/hicache-runtime"]
    raise AssertionError(f"no invalid values for {setting.name} ({kind}): add them to this oracle")


def _valid(setting, tmp_path: Path) -> str:
    """One value every reader accepts."""
    if setting.kind == "choice":
        return setting.choices[-1]
    if setting.kind == "path":
        return str(tmp_path / ("trace.json" if setting.name == "HICACHE_TRACE" else "runtime"))
    return {"bool": "1", "count": "2", "concurrency": "3", "seconds": "2.5",
            "size": "2MiB" if setting.power_of_two else "1GiB"}[setting.kind]


def _doctor(env: dict) -> dict:
    """`hicache doctor`'s checks with ``env`` (this machine's facts, no plan), by name; an unset
    runtime directory defaults under a fresh XDG_RUNTIME_DIR, not this machine's /tmp."""
    import tempfile

    with tempfile.TemporaryDirectory() as runtime:
        return {c.name: c for c in doctor_checks(env={"XDG_RUNTIME_DIR": runtime, **env})}


@pytest.mark.parametrize("default, usable", [
    ("missing/deeper", False),  # neither it nor its parent exists
    ("shared", False),  # there, but mode 0755: another user could hold the lock
    ("fresh", True),  # absent, its parent there: made at the first bring-up
    ("own", True),  # there, ours, 0700
])
def test_an_unset_runtime_dir_is_judged_where_its_default_will_be(tmp_path, default, usable):
    """HICACHE_RUNTIME_DIR unset: the default every bring-up will use ($XDG_RUNTIME_DIR/hicache
    here) is checked as a set value is - a FAIL line named by the variable saying it is unset,
    the path and why, with a hint to set it; a usable default passes and nothing is left made."""
    (tmp_path / "shared/hicache").mkdir(parents=True)
    (tmp_path / "shared/hicache").chmod(0o755)
    (tmp_path / "own/hicache").mkdir(parents=True, mode=0o700)
    (tmp_path / "fresh").mkdir()
    base = tmp_path / default
    checks = {c.name: c for c in doctor_checks(env={"XDG_RUNTIME_DIR": str(base)})}
    if usable:
        assert "HICACHE_RUNTIME_DIR" not in checks and checks["environment"].status == "pass"
        assert (base / "hicache").is_dir() is (default == "own")  # the probe made and removed it
        return
    line = checks["HICACHE_RUNTIME_DIR"]
    assert line.status == "fail" and "HICACHE_RUNTIME_DIR is unset and its default cannot be used" in line.finding
    assert str(base / "hicache") in line.finding and line.hint.startswith("set HICACHE_RUNTIME_DIR")
    assert checks["environment"].status == "fail"


@pytest.mark.parametrize("name", [s.name for s in SETTINGS])
def test_doctor_fails_every_invalid_value_of_every_variable(name, tmp_path):
    """For each row and each invalid value the oracle knows for its kind: a FAIL line named by
    the variable that quotes the value, the summary line failing too - and the valid value of
    the same row passes (the check is not "any value fails")."""
    setting = BY_NAME[name]
    values = _invalid(setting, tmp_path)
    assert values
    for value in values:
        checks = _doctor({name: value})
        assert name in checks, (value, sorted(checks))
        line = checks[name]
        assert line.status == "fail" and f"{name}={value!r}" in line.finding, (value, line)
        assert checks["environment"].status == "fail"
    good = _valid(setting, tmp_path)
    checks = _doctor({name: good})
    assert name not in checks and checks["environment"].status == "pass", checks["environment"]
    assert f"{name}={good!r}" in checks["environment"].finding


def test_every_invalid_value_is_refused_by_the_reader_the_bring_ups_use(tmp_path):
    """The table's reader (what resolve_limits, pool_settings, the turnstile, the lock and the
    trace call) refuses each parse-level invalid value with an EnvError naming both."""
    from hicache.errors import EnvError

    for setting in SETTINGS:
        if setting.kind == "path":
            continue  # a path is refused where it is used (the doctor's check above)
        for value in _invalid(setting, tmp_path / setting.name):
            with pytest.raises(EnvError, match=re.escape(f"{setting.name}={value!r}")):
                env_value({setting.name: value}, setting.name)


def test_a_typo_of_a_variable_is_a_warning_naming_it():
    """HICACHE_PROGRESIVE=1 (one S) reads as unset: the doctor says so instead of passing."""
    checks = _doctor({"HICACHE_PROGRESIVE": "1"})
    assert checks["environment"].status == "warn" and "HICACHE_PROGRESIVE" in checks["environment"].finding


def _variables_in_source() -> set[str]:
    """Every HICACHE_* name in a string of hicache's source (docstrings and messages included)."""
    found = set()
    for path in (ROOT / "hicache").rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Constant) and isinstance(node.value, str):
                found |= set(re.findall(r"(?<![A-Z_])HICACHE_[A-Z][A-Z_]*[A-Z]", node.value))
    return found - NOT_VARIABLES


def test_every_variable_the_code_names_is_in_the_table():
    """No HICACHE_* variable is read or advertised without a row (the old catalogue lacked five)."""
    assert _variables_in_source() - set(BY_NAME) == set()
    assert set(BY_NAME) <= _variables_in_source()  # and no row names a variable nothing uses


def test_the_docs_are_the_table():
    """docs/environment.md is environment_markdown() of the table, byte for byte (`make docs`)."""
    assert (ROOT / "docs" / "environment.md").read_text() == environment_markdown()


def _apply(*argv, capsys):
    code = main(["apply", "--fake-cuda", "--model", "llama-3.1-8b", "--host-gb", "0.01", "--format", "json",
                 "--host-memory", "64GB", "--ranks-per-host", "1", *argv])
    captured = capsys.readouterr()
    return code, captured.out, captured.err


@pytest.mark.parametrize("name, value", [("HICACHE_HUGEPAGES", "bogus"), ("HICACHE_PROGRESSIVE", "maybe"),
                                         ("HICACHE_HOST_COPY", "turbo"), ("HICACHE_LOCK_TIMEOUT", "nan"),
                                         ("HICACHE_PIN_CONCURRENCY", "abc")])
def test_apply_refuses_what_the_pools_would_refuse(name, value, monkeypatch, capsys):
    """apply with a value a server's pools cannot read: error[bad-environment] naming it, exit 2,
    before any memory (no report, no pre-fault line)."""
    monkeypatch.setenv(name, value)
    code, out, err = _apply(capsys=capsys)
    assert code == 2 and err.startswith(f"error[bad-environment]: environment variable {name}={value!r}"), err
    assert out == "" and "pre-faulted" not in err


def test_apply_reads_hugepages_and_progressive_as_the_pools_do_and_a_flag_wins(monkeypatch, capsys):
    """HICACHE_PROGRESSIVE=1 makes apply progressive (its report says so) unless --no-progressive;
    HICACHE_HUGEPAGES=thp maps transparent huge pages unless --hugepages off."""
    monkeypatch.setenv("HICACHE_PROGRESSIVE", "1")
    code, out, err = _apply(capsys=capsys)
    assert code == 0 and json.loads(out).get("progressive") is True, err
    code, out, err = _apply("--no-progressive", capsys=capsys)
    assert code == 0 and "progressive" not in json.loads(out), err
    monkeypatch.delenv("HICACHE_PROGRESSIVE")
    monkeypatch.setenv("HICACHE_HUGEPAGES", "thp")
    code, out, _ = _apply(capsys=capsys)
    assert code == 0 and json.loads(out)["hugepages"] == "thp"
    code, out, _ = _apply("--hugepages", "off", capsys=capsys)
    assert code == 0 and json.loads(out)["hugepages"] == "off"
