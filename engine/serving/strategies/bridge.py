"""Bridge (plan kind ``bridge``): when the new instance does not fit beside the old one but a small instance of the
old revision does. The bridge starts beside the old instance and takes the traffic; the old one drains and stops;
the new one starts beside the bridge and takes the traffic; the bridge drains and stops. A new revision that fails
brings the old one back at its full size beside the bridge before the bridge goes."""

from __future__ import annotations

from engine.db import Revision
from engine.revisions import EngineSettings
from engine.schemas import ApplyPlanOut
from engine.serving.strategies import pause
from engine.serving.strategies.base import Context, Steps, handover, lost, retire, started, stop


async def run(ctx: Context, desired: Revision, settings: EngineSettings, plan: ApplyPlanOut) -> Steps:
    olds = ctx.serving()
    old = next((i for i in olds if not i.bridge), olds[0])
    assert plan.bridge is not None
    small = old.settings.model_copy(update={"gpu_memory_utilization": plan.bridge.gpu_memory_utilization,
                                            "max_num_seqs": plan.bridge.max_num_seqs, "replicas": 1})
    ctx.step(f"starting a bridge at {plan.bridge.gpu_memory_utilization:.2f} beside instance {old.name}")
    bridge = await ctx.launch(old.revision, small, device=old.device, bridge=True, node=old.child.node)
    async for _ in started(ctx, bridge):
        yield
    verdict = bridge.verdict
    assert verdict is not None
    if not verdict.ready:
        async for _ in stop(ctx, bridge, verdict.reason):
            yield
        await ctx.event("bridge_failed", f"the bridge did not start ({verdict.reason}): pausing instead",
                        "warning", desired.id, data={"last_lines": list(bridge.child.lines)[-30:]})
        if not verdict.aborted:
            async for _ in pause.run(ctx, desired, settings, plan):
                yield
        return
    await ctx.promote(bridge)
    async for _ in handover(ctx, bridge):
        yield
    for inst in olds:
        ctx.step(f"the bridge serves; draining instance {inst.name}")
        async for _ in retire(ctx, inst, "the bridge serves"):
            yield
    ctx.step(f"starting revision {desired.id} beside the bridge")
    new = await ctx.launch(desired, settings, device=old.device, node=old.child.node)
    async for _ in started(ctx, new):
        yield
    verdict = new.verdict
    assert verdict is not None
    if not verdict.ready:
        async for _ in stop(ctx, new, verdict.reason):
            yield
        if verdict.aborted:  # a newer revision: the next tick applies it, from the bridge
            return
        if verdict.lost:  # its node went away: the next tick starts the revision again, from the bridge
            await lost(ctx, new, verdict)
            return
        # The bridge serves; the apply ends when the old revision serves at its full size again.
        ctx.step(f"revision {desired.id} failed; bringing revision {old.revision.id} back beside the bridge")
        back = await ctx.launch(old.revision, old.settings, device=old.device, node=old.child.node, abortable=False)
        async for _ in started(ctx, back):
            yield
        if back.verdict is not None and back.verdict.ready:
            await ctx.promote(back)
            ctx.step("draining the bridge")
            async for _ in retire(ctx, bridge, f"revision {old.revision.id} serves again"):
                yield
        else:
            async for _ in stop(ctx, back, "the old revision did not start again: the bridge keeps serving"):
                yield
        await ctx.reject(new, verdict)
        return
    await ctx.promote(new)
    async for _ in handover(ctx, new):
        yield
    ctx.step("draining the bridge")
    async for _ in retire(ctx, bridge, f"revision {desired.id} serves"):
        yield
    ctx.done("applied")
