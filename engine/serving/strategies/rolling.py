"""Rolling (plan kind ``rolling``, 2 or more replicas): one replica at a time drains, stops and comes back on the
new revision, on its node and GPUs, so capacity never falls below (N-1)/N; the next one drains once the new one has
ended its first requests. A replica whose new revision fails comes back on the old revision, and the apply ends
there (its revision rejected)."""

from __future__ import annotations

from engine.db import Revision
from engine.revisions import EngineSettings
from engine.schemas import ApplyPlanOut
from engine.serving.strategies.base import Context, Steps, handover, retire, start_new, started, stop


async def run(ctx: Context, desired: Revision, settings: EngineSettings, plan: ApplyPlanOut) -> Steps:
    olds = ctx.serving()
    for index, old in enumerate(olds):
        ctx.step(f"replica {index + 1} of {len(olds)}: draining instance {old.name}")
        async for _ in retire(ctx, old, f"rolling to revision {desired.id}"):
            yield
        ctx.step(f"replica {index + 1} of {len(olds)}: starting revision {desired.id}")
        new = await ctx.launch(desired, settings, device=old.device, node=old.child.node, index=index)
        async for _ in start_new(ctx, new):
            yield
        verdict = new.verdict
        assert verdict is not None
        if not verdict.ready:
            if not verdict.aborted and not verdict.lost:  # the replica it replaced comes back on the old revision
                ctx.step(f"replica {index + 1} of {len(olds)}: bringing revision {old.revision.id} back")
                back = await ctx.launch(old.revision, old.settings, device=old.device, node=old.child.node,
                                        index=index, abortable=False)
                async for _ in started(ctx, back):
                    yield
                if back.verdict is not None and back.verdict.ready:
                    await ctx.promote(back)
                else:
                    async for _ in stop(ctx, back, "could not bring the replica back"):
                        yield
            return
        await ctx.promote(new)
        if index + 1 < len(olds):  # a cold instance's first batch is its slowest: the next one drains after it
            async for _ in handover(ctx, new):
                yield
    ctx.done("applied")
