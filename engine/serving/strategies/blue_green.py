"""Blue/green (plan kind ``blue_green``, and ``start`` when nothing serves yet): the new instance starts beside the
old one; the gateway moves to it once it is ready; the old one drains and stops. Something serves throughout."""

from __future__ import annotations

from engine.db import Revision
from engine.revisions import EngineSettings
from engine.schemas import ApplyPlanOut
from engine.serving.strategies.base import Context, Steps, handover, retire, start_new


async def run(ctx: Context, desired: Revision, settings: EngineSettings, plan: ApplyPlanOut) -> Steps:
    olds = ctx.serving()
    ctx.step(f"starting revision {desired.id} beside the instance that serves")
    new = await ctx.launch(desired, settings, device=ctx.device_for(0, settings),
                           node=olds[0].child.node if olds else None)
    async for _ in start_new(ctx, new):
        yield
    if new.verdict is None or not new.verdict.ready:
        return
    await ctx.promote(new)
    async for _ in handover(ctx, new):
        yield
    for old in olds:
        ctx.step(f"draining instance {old.name}")
        async for _ in retire(ctx, old, f"revision {desired.id} serves on instance {new.name}"):
            yield
    ctx.done("applied")
