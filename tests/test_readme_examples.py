"""The README's "Use it from Python" examples run as written and print what they say: the plan
example (pure) and the bring-up example (runnable as is on a CPU machine under the fake
driver, the suite's injected 3 GB machine deciding the budget)."""

from __future__ import annotations

import contextlib
import io
from pathlib import Path

import pytest

README = Path(__file__).resolve().parent.parent / "README.md"


def _blocks() -> list[str]:
    """The Python blocks of the README's "Use it from Python" section, in order."""
    section = README.read_text().split("## Use it from Python", 1)[1].split("\n## ", 1)[0]
    return [part.split("```", 1)[0] for part in section.split("```python\n")[1:]]


def _run(block: str) -> list[str]:
    """Execute ``block`` as a module would; the lines it printed."""
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        exec(compile(block, "README.md", "exec"), {"__name__": "readme_example"})
    return out.getvalue().splitlines()


def test_the_plan_example_prints_each_buffer_and_its_first_calls():
    """The plan example (80 layers, 60,000 pages, 64 GiB chunk limit): one buffer, its 128 KiB
    copy unit, and its first two calls at the 64 GiB limit."""
    lines = _run(_blocks()[0])
    assert lines == ["kv 131072 (Range(offset=0, size=68719476736), Range(offset=68719476736, size=68719476736))"]


def test_the_bring_up_example_registers_the_pool_and_leaves_nothing_held():
    """The bring-up example, under the fake driver: one call of the 256 MiB pool, all of it
    registered, one flat buffer - and nothing held once the block ends."""
    pytest.importorskip("torch")
    block = _blocks()[1]
    assert "fake_cuda()" in block  # runnable as is on a CPU machine: the README says so
    assert _run(block) == ["1 268435456 torch.Size([268435456])", "set()"]


def test_the_readme_has_the_examples_these_tests_run():
    """Not vacuous: the section holds the plan and bring-up examples first (a third, a fragment
    over a device pool, follows)."""
    blocks = _blocks()
    assert len(blocks) >= 2 and "plan_pool(layout, Limits(" in blocks[0] and "bring_up(pool" in blocks[1]
