"""Memory safety of transfers, in a child process so that a wild copy's crash is a failure:
random device tensor lengths (some shorter than layer 0's K) and random indices either copy
exactly what torch indexing copies, or raise TransferError with nothing copied."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path


def test_transfers_copy_exactly_the_oracle_or_refuse_in_a_child_process():
    """Fuzzed transfers in a child process copy exactly what the oracle copies or refuse, and never
    crash it."""
    child = Path(__file__).parent / "transfer_fuzz_child.py"
    examples = "300" if os.environ.get("HYPOTHESIS_PROFILE") == "ci" else "60"
    result = subprocess.run([sys.executable, str(child)], capture_output=True, text=True,
                            env={**os.environ, "HICACHE_FUZZ_EXAMPLES": examples}, timeout=600)
    assert result.returncode == 0 and result.stdout.strip().endswith("ok"), (result.returncode, result.stderr[-4000:])
