"""`hicache` / `python -m hicache`: `plan` (offline capacity review), `doctor`, `apply`.

One module per command (`_plan`, `_doctor`, `_apply`), the shared plan arguments
(`_plan_args`), rendering (`_render`) and the entry point (`_main`). Imports point one way:
commands -> _plan_args/_common -> hicache.plan; `doctor` and `apply` load hicache.effects when
they run.
"""

from hicache.cli._common import CliError
from hicache.cli._main import main, make_parser
from hicache.cli._plan_args import build_plan

__all__ = ["CliError", "build_plan", "main", "make_parser"]
