"""Without a C compiler the optional helpers are not built: the install still works and the
parts that use them take their Python paths. Run in a child process with both helpers made
unimportable (as on a machine without gcc/cc)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_pools_allocator_copies_and_cli_pass_without_the_compiled_helpers():
    """Those files' tests (the node store's CLI among them, on the store's default - here the
    fallback - slot operations; test_store_index runs the fallback beside the C helper in every
    run; the transfer engine's, whose "auto" copies by torch indexing here; the store's stopped
    writes, Python path) pass in a child where the compiled helpers cannot be imported (one child
    for all: on two busy cores each more child is seconds of imports)."""
    code = (
        "import sys\n"
        "sys.modules['hicache.effects._copy._hostcopy'] = None\n"
        "sys.modules['hicache.pools._pagestack'] = None\n"
        "sys.modules['hicache.effects._arena._slotops'] = None\n"
        "import pytest\n"
        "from hicache.effects._copy import _host_copy\n"
        "from hicache.pools import _page_allocator\n"
        "from hicache.effects._arena import _slots\n"
        "assert _host_copy._native is None and _page_allocator._native is None and _slots._native is None\n"
        "sys.exit(pytest.main(['-q', '-p', 'no:cacheprovider', '-p', 'no:xdist', 'tests/test_pools.py',"
        " 'tests/test_page_allocator.py', 'tests/test_host_copy.py', 'tests/test_sglang_callsites.py',"
        " 'tests/test_store_cli.py', 'tests/test_transfer_engine.py', 'tests/test_store_c_steps.py']))\n"
    )
    result = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=900)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-2000:]
