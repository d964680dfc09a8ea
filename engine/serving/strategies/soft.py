"""The soft change: a revision the running instances take on as they run, no restart (plan kind ``soft``).

What a running vLLM can take on: ``replicas`` (a scale: the controller adds or retires replicas one by one
afterwards), ``max_num_seqs`` within the ceiling it was started with (the gateway holds each instance to it
from the next request) and ``routing`` (the gateway's, from the next request). The instances that serve become
the revision's own: no restart, no gap.
"""

from __future__ import annotations

from typing import Any, Protocol

from engine.db import Revision
from engine.revisions import EngineSettings
from engine.schemas import ApplyPlanOut
from engine.serving.instances import Instance

SOFT_FIELDS = ("replicas", "max_num_seqs", "max_num_seqs_ceiling", "routing", "min_replicas", "max_replicas",
               "target_in_flight", "target_queue_wait_s", "scale_up_delay_s", "scale_down_delay_s",
               "scale_to_zero_after_s")
SCALING_FIELDS = SOFT_FIELDS[4:]  # autoscaling's: the controller reads them at each tick


def soft_change(inst: Instance, values: dict[str, Any]) -> bool:
    """Whether ``inst`` can serve a revision of ``values`` as it runs: nothing it was started with differs, and
    a new max_num_seqs fits under the ceiling it was started with (a new ceiling needs a restart)."""
    current = inst.revision.values
    if {**current, **dict.fromkeys(SOFT_FIELDS)} != {**values, **dict.fromkeys(SOFT_FIELDS)}:
        return False
    seqs, ceiling = int(values.get("max_num_seqs") or 1), values.get("max_num_seqs_ceiling")
    if seqs == current.get("max_num_seqs") and ceiling == current.get("max_num_seqs_ceiling"):
        return True  # only replicas or routing
    # a new max_num_seqs without a restart only under a ceiling the operator asked for, the one it runs with
    return ceiling is not None and ceiling == inst.launched_seqs and seqs <= ceiling


def adoptable(serving: list[Instance], values: dict[str, Any]) -> bool:
    """Whether the instances that serve can all take a revision of ``values`` on as they run (no bridge among
    them: a bridge runs the old revision, small)."""
    return bool(serving) and not any(i.bridge for i in serving) and all(soft_change(i, values) for i in serving)


def soft_plan(serving: list[Instance], settings: EngineSettings) -> ApplyPlanOut:
    """The plan of a change the running instances take on as they run (no restart)."""
    old = serving[0].settings
    steps = []
    if old.max_num_seqs != settings.max_num_seqs:
        steps.append(f"the gateway holds each instance to max_num_seqs {settings.max_num_seqs} from the next request "
                     f"(vLLM runs with a ceiling of {min(i.launched_seqs for i in serving)})")
    if old.routing != settings.routing:
        steps.append(f"the gateway routes by {settings.routing.replace('_', ' ')} from the next request")
    if settings.max_replicas is not None:  # the count follows the load: replicas is only where it starts
        steps.append(f"autoscaling between {settings.min_replicas} and {settings.max_replicas} replicas on the "
                     f"load; {len(serving)} serve now")
    elif settings.replicas > len(serving):
        steps.append(f"start {settings.replicas - len(serving)} more replica(s) beside those that serve")
    elif settings.replicas < len(serving):
        steps.append(f"drain and stop {len(serving) - settings.replicas} replica(s); the others serve")
    return ApplyPlanOut(kind="soft", reason="in effect now, no restart: nothing the running instances were started "
                        "with changes", pause_s=0.0, expected_s=0.0 if settings.max_replicas is not None or
                        settings.replicas <= len(serving) else None,
                        capacity_dip_pct=0.0, steps=steps or ["record the revision: nothing changes"])


def gateway_limit(inst: Instance) -> int | None:
    """How many requests the gateway lets the instance run at once: its revision's max_num_seqs (under a higher
    ceiling, or the one it was started with). The rest wait in the gateway's fair queue, not in vLLM's own,
    which is first come, first served: on an H100 at 16 sequences a light key waited 3.5 s behind a heavy one
    (docs/teams.md); a cap of N costs within 3 % of vLLM held to N itself (docs/gpu-validation.md)."""
    return inst.settings.max_num_seqs


class SoftContext(Protocol):
    """What adopting a revision needs of the rest of serving."""

    async def relabel(self, inst: Instance, revision: Revision, settings: EngineSettings) -> None: ...

    async def mark_applied(self, revision_id: int) -> None: ...

    async def event(self, kind: str, message: str, severity: str = "info", revision_id: int | None = None,
                    data: dict[str, Any] | None = None) -> None: ...

    def monotonic(self) -> float: ...


async def adopt(ctx: SoftContext, desired: Revision, serving: list[Instance]) -> str:
    """The instances that serve take ``desired`` on as they run; returns what serves now, for the state's reason."""
    assert desired.id is not None
    before = sorted({i.revision.id or 0 for i in serving})
    old = serving[0].settings
    settings = EngineSettings.model_construct(**desired.values)
    t0 = ctx.monotonic()
    for inst in serving:
        await ctx.relabel(inst, desired, settings)
    seconds = ctx.monotonic() - t0
    await ctx.mark_applied(desired.id)
    want = settings.replicas
    changed = []
    if old.max_num_seqs != settings.max_num_seqs:
        changed.append(f"max_num_seqs {old.max_num_seqs} → {settings.max_num_seqs} in effect now (within the "
                       f"ceiling of {min(i.launched_seqs for i in serving)} they were started with)")
    if old.routing != settings.routing:
        changed.append(f"routing {old.routing} → {settings.routing} from the next request")
    if settings.max_replicas is not None:
        want = len(serving)  # the autoscaler, not the revision, moves the count
        if (old.min_replicas, old.max_replicas) != (settings.min_replicas, settings.max_replicas):
            changed.append(f"autoscaling between {settings.min_replicas} and {settings.max_replicas} replicas")
    elif old.replicas != want:
        changed.append(f"replicas {len(serving)} → {want}")
    await ctx.event("applied_soft", f"revision {desired.id}: " + "; ".join(changed or ["no change"])
                    + f"; instances {', '.join(i.name for i in serving)} serve it, nothing restarts",
                    revision_id=desired.id, data={"from_revisions": before, "replicas": want,
                                                  "max_num_seqs": settings.max_num_seqs,
                                                  "routing": settings.routing,
                                                  "in_effect_s": round(seconds, 4)})
    return f"; scaling to {want} replica(s)" if want != len(serving) else ""
