"""How an apply replaces what serves: one module per plan kind (engine/capacity/plans.py chooses which), each an
async generator over the narrow ``Context`` of engine/serving/strategies/base.py.

- **soft**: the running instances take the revision on as they run (replicas, max_num_seqs within its ceiling).
- **blue/green** (and **start**): the new instance starts beside the old one; the gateway moves; the old drains.
- **bridge**: a small instance of the old revision carries the traffic while the old one is replaced.
- **rolling**: one replica at a time drains, stops and comes back on the new revision.
- **pause**: drain, stop (or sleep), start, serve the queue.
"""

from __future__ import annotations

from collections.abc import Callable

from engine.db import Revision
from engine.revisions import EngineSettings
from engine.schemas import ApplyPlanOut, PlanKind
from engine.serving.strategies import blue_green, bridge, pause, rolling
from engine.serving.strategies.base import Context, Steps
from engine.serving.strategies.soft import adopt, adoptable, gateway_limit, soft_change, soft_plan

Plan = Callable[[Context, Revision, EngineSettings, ApplyPlanOut], Steps]
PLANS: dict[PlanKind, Plan] = {
    "start": blue_green.run,
    "blue_green": blue_green.run,
    "bridge": bridge.run,
    "rolling": rolling.run,
    "pause": pause.run,
}


def plan_steps(ctx: Context, desired: Revision, settings: EngineSettings, plan: ApplyPlanOut) -> Steps:
    """The steps of ``plan`` (a soft plan is adopted by the controller, not stepped: it has none to wait for)."""
    return PLANS.get(plan.kind, pause.run)(ctx, desired, settings, plan)


__all__ = ["PLANS", "Context", "Plan", "Steps", "adopt", "adoptable", "gateway_limit", "plan_steps", "soft_change",
           "soft_plan"]
