"""The commands' bounds (issue #33 item 4): hugetlbfs page sizes within the mappable range and,
for apply, ones the kernel offers (``prefer`` falls back); --ratio bounded; --reserve 0 a real
value; one option given twice with two values refused; numbers only in ASCII digits."""

from __future__ import annotations

import os

import json

import pytest

from hicache.cli._main import main


def _run(capsys, *argv):
    """Exit code, stdout, and stderr from its error line on (apply --fake-cuda notes first)."""
    code = main(list(argv))
    captured = capsys.readouterr()
    err = captured.err
    return code, captured.out, err[err.index("error["):] if "error[" in err else err


APPLY = ("apply", "--fake-cuda", "--model", "llama-3.1-8b", "--host-gb", "0.01", "--host-memory", "64GB",
         "--ranks-per-host", "1", "--format", "json")


@pytest.mark.parametrize("command", [("plan",), APPLY])
@pytest.mark.parametrize("size", ["64GiB", "4GiB", "3MiB", "32KiB"])
def test_a_hugepage_size_outside_the_mappable_range_is_bad_size(command, size, capsys):
    """--hugepage-size 64GiB died in mmap with OverflowError: now bad-size naming the flag and
    the range, before any memory (plan and apply alike)."""
    code, out, err = _run(capsys, *command, "--hugepage-size", size)
    assert code == 2 and err.startswith(f"error[bad-size]: --hugepage-size {size} must be a power of two"), err
    assert out == "" and "Traceback" not in err


def _offering(monkeypatch, *sizes):
    """This machine's kernel offers hugetlbfs pages of ``sizes`` only (sysfs injected)."""
    from hicache.effects._host import _memory

    monkeypatch.setattr(_memory, "offered_hugepage_sizes", lambda root="/": tuple(sizes))


def test_required_hugepages_of_a_size_the_kernel_does_not_offer_are_refused_naming_the_offered(monkeypatch, capsys):
    """--hugepages required --hugepage-size 64KiB on a kernel offering 2 MiB only: bad-size
    naming the offered sizes, before any memory."""
    _offering(monkeypatch, 2 * 2**20)
    code = main([*APPLY, "--hugepages", "required", "--hugepage-size", "64KiB"])
    out, err = capsys.readouterr()
    assert code == 2 and "error[bad-size]: hugetlbfs pages of 64 KiB are not offered" in err, err
    assert "it offers: 2 MiB" in err and out == "" and "pre-faulted " not in err.replace("pre-faulted and", "")
    assert "--hugepages prefer to fall back" in err.splitlines()[-1]


def test_preferred_hugepages_of_a_size_not_offered_fall_back_to_4k_pages(monkeypatch, capsys):
    """--hugepages prefer with an unoffered size: a note, then the bring-up on 4 KiB pages."""
    _offering(monkeypatch, 2 * 2**20)
    code, out, err = _run(capsys, *APPLY, "--hugepages", "prefer", "--hugepage-size", "64KiB")
    assert code == 0 and "note: hugetlbfs pages of 64 KiB are not offered" in err, err
    report = json.loads(out)
    assert report["hugepages"] == "prefer" and all(
        set(k for k, v in tiers.items() if v and k != "exact") <= {"4k"} for tiers in report["tiers"].values()), report


@pytest.mark.parametrize("ratio", ["1e30", "10001", "inf", "nan"])
def test_ratio_is_bounded_with_bad_size_naming_it(ratio, capsys):
    """--ratio 1e30 failed as unsupported-layout with an internal message: now bad-size naming --ratio."""
    code, _, err = _run(capsys, "plan", "--ratio", ratio, "--device-tokens", "1000")
    assert code == 2 and err.startswith("error[bad-size]: --ratio"), err


def test_a_ratio_in_range_still_plans(capsys):
    """The bound is not "any ratio fails": 10,000 (the largest) plans."""
    code, out, err = _run(capsys, "plan", "--ratio", "10000", "--device-tokens", "1000", "--format", "json")
    assert code == 0 and json.loads(out)["inputs"]["host_to_device_ratio"] == "10000", err


def test_reserve_zero_is_accepted_and_used(capsys):
    """--reserve 0 is a reserve of nothing (it was refused as below 1 byte): the budget keeps
    nothing back, 10 GiB less than the default."""
    plans = {}
    for reserve in ("0", "10GiB"):
        code, out, err = _run(capsys, "plan", "--model", "llama-3.1-8b", "--host-gb", "1", "--host-memory", "100GB",
                              "--reserve", reserve, "--format", "json")
        assert code == 0, err
        plans[reserve] = json.loads(out)
    zero, default = plans["0"]["budget"], plans["10GiB"]["budget"]
    assert zero["reserve_bytes"] == 0 and default["reserve_bytes"] == 10 * 2**30
    assert zero["per_rank_bytes"] - default["per_rank_bytes"] == 10 * 2**30


@pytest.mark.parametrize("argv, first, second", [
    (["--tp", "1", "--tp-size", "8"], "--tp 1", "--tp-size 8"),  # the case
    (["--tp=2", "--tp", "3"], "--tp 2", "--tp 3"),
    (["--host-gb", "1", "--hicache-size", "2"], "--host-gb 1", "--hicache-size 2"),
    (["--layout", "layer_first", "--hicache-mem-layout", "page_first"], "--layout layer_first",
     "--hicache-mem-layout page_first"),
])
def test_one_option_given_twice_with_two_values_is_conflicting_flags(argv, first, second, capsys):
    """--tp 1 --tp-size 8 planned TP=8 silently: now conflicting-flags naming both spellings."""
    code, out, err = _run(capsys, "plan", *argv)
    assert code == 2 and err.startswith(f"error[conflicting-flags]: {first} and {second} both given"), err
    assert out == ""


def test_the_same_value_twice_is_not_a_conflict(capsys):
    """--tp 8 --tp-size 8 says one thing twice: it plans."""
    code, out, err = _run(capsys, "plan", "--tp", "8", "--tp-size", "8", "--format", "json")
    assert code == 0 and json.loads(out)["inputs"]["tp"] == 8, err


_NEVER = f"/dev/shm/hicache-test-never-made-{os.getpid()}"


@pytest.mark.parametrize("argv, ref", [
    (["plan", "--tp", "1_6"], "bad-number"),                 # int() reads it as 16
    (["plan", "--host-gb", "1_0"], "bad-size"),              # Decimal() reads it as 10
    (["plan", "--ratio", "2_0", "--device-tokens", "1000"], "bad-size"),
    ([*APPLY, "--metrics-port", "1_9601"], "bad-number"),
    ([*APPLY, "--hold", "1_0"], "bad-number"),               # float() reads it as 10.0
    (["store", "create", _NEVER, "--size-gb", "1_0", "--slot-bytes", "4096"], "bad-size"),
    (["store", "create", _NEVER, "--size-gb", "1", "--slot-bytes", "4_096"], "bad-number"),
])
def test_numbers_with_underscores_are_refused(argv, ref, capsys):
    """Python reads "1_0" as 10 (PEP 515): `--size-gb 1_0` made a 10 GB arena and `--tp 1_6`
    planned TP=16 (issue #54). Refused naming the flag, as the environment table refuses them;
    nothing is created."""
    try:
        code, out, err = _run(capsys, *argv)
        assert code == 2 and err.startswith(f"error[{ref}]"), err
        assert out == "" and not os.path.exists(_NEVER)
    finally:
        if os.path.lexists(_NEVER):  # a regression made it: never leave a GB in /dev/shm
            os.unlink(_NEVER)


@pytest.mark.parametrize("argv, ref", [
    (["plan", "--tp", "٨"], "bad-number"),                  # Arabic-Indic 8
    (["plan", "--host-gb", "١٢"], "bad-size"),
    (["plan", "--host-gb", "１２"], "bad-size"),            # full-width 12
    (["plan", "--chunk-limit", "١٢GiB"], "bad-size"),
    (["plan", "--page-size", "६४"], "bad-number"),          # Devanagari 64
    (["plan", "--ratio", "٢", "--device-tokens", "1000"], "bad-size"),
    (["plan", "--host-memory", "٢TB", "--ranks-per-host", "1"], "bad-size"),
    ([*APPLY, "--hold", "٣"], "bad-number"),                  # float() reads it as 3.0
    ([*APPLY, "--threads", "٤"], "bad-number"),
])
def test_numbers_in_non_ascii_digits_are_refused(argv, ref, capsys):
    """int(), float() and Decimal() read "١٢" as 12; no operator meant it: refused, naming the flag."""
    code, out, err = _run(capsys, *argv)
    assert code == 2 and err.startswith(f"error[{ref}]"), err
    assert out == ""
