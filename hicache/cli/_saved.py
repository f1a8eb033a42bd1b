"""Reading a saved plan (`--plan FILE`) for `doctor` and `apply`: one error line per problem."""

from __future__ import annotations

from hicache.cli._common import PLAN_LIMIT_BYTES, CliError, read_json_file
from hicache.errors import PlanError
from hicache.plan import CapacityPlan, PoolPlan, from_jsonable


def load_plan(path: str):
    data = read_json_file(path, "--plan", PLAN_LIMIT_BYTES,
                          "pass a file written by `hicache plan --format json --out FILE`", "bad-plan")
    try:
        plan = from_jsonable(data)
    except PlanError as error:
        raise CliError("bad-plan", f"{path}: {error}", "regenerate it with `hicache plan --format json`") from None
    if not isinstance(plan, (CapacityPlan, PoolPlan)):
        raise CliError("bad-plan", f"{path} holds a single-buffer plan, not a pool or capacity plan", "use `hicache plan --format json`")
    return plan


def pool_plans(plan) -> list[tuple[str, PoolPlan]]:
    if isinstance(plan, PoolPlan):
        return [("pool", plan)]
    return [(p.name, p.plan) for p in plan.pools]
