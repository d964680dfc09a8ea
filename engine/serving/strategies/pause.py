"""Pause (plan kind ``pause``): nothing fits beside what serves. It drains (requests that arrive meanwhile wait in
the gateway's queue) and stops (on CUDA with sleep mode: goes to sleep, so a revision that fails is rolled back in
about a second), then the new revision starts and serves the queue."""

from __future__ import annotations

from engine.db import Revision
from engine.revisions import EngineSettings
from engine.schemas import ApplyPlanOut, EngineState
from engine.serving.instances import Instance
from engine.serving.strategies.base import Context, Steps, lost, started, stop

S = EngineState


async def run(ctx: Context, desired: Revision, settings: EngineSettings, plan: ApplyPlanOut) -> Steps:
    olds = ctx.serving()
    for inst in olds:
        await ctx.close(inst)
    ctx.step(f"draining for revision {desired.id}")
    if ctx.state == S.READY:
        ctx.enter(S.DRAINING, f"applying revision {desired.id}")
    drain = ctx.begin_drain_all()
    while (left := ctx.drained_all(drain)) is None:
        yield
    ctx.timed("drain", ",".join(i.name for i in olds), ctx.monotonic() - drain.since, drain.in_flight)
    await ctx.event("drained", f"{left} requests still in flight after {drain.deadline - drain.since:.0f} s"
                    if left else f"drained in-flight requests: applying revision {desired.id}",
                    "warning" if left else "info", olds[0].revision.id if olds else None)
    ctx.enter(S.STOPPING, f"applying revision {desired.id}")
    sleepers: list[Instance] = []
    for inst in olds:
        if ctx.sleep_mode and not inst.bridge:
            ctx.sleep(inst)
            while inst.busy:
                yield
            if inst.role == "sleeping":
                sleepers.append(inst)
                continue
        async for _ in stop(ctx, inst, f"applying revision {desired.id}"):
            yield
    for inst in [i for i in ctx.instances() if i not in sleepers]:
        async for _ in stop(ctx, inst, f"applying revision {desired.id}"):
            yield
    ctx.enter(S.STOPPED, f"applying revision {desired.id}")
    ctx.enter(S.STARTING, f"starting revision {desired.id}")
    ctx.step(f"starting revision {desired.id}")
    new = await ctx.launch(desired, settings, device=ctx.device_for(0, settings),
                           node=olds[0].child.node if olds else None)
    async for _ in started(ctx, new):
        yield
    verdict = new.verdict
    assert verdict is not None
    if verdict.ready:
        await ctx.promote(new)
        for inst in sleepers:
            async for _ in stop(ctx, inst, f"revision {desired.id} serves"):
                yield
        ctx.done("applied")
        return
    if sleepers:
        async for _ in stop(ctx, new, verdict.reason):
            yield
        for inst in sleepers:  # first serve again (the gap closes), then diagnose
            ctx.wake_up(inst)
            while inst.busy:
                yield
            if not inst.woken:
                async for _ in stop(ctx, inst, "it did not wake up"):
                    yield
        if verdict.lost:
            await lost(ctx, new, verdict)
        elif not verdict.aborted:
            await ctx.reject(new, verdict)
        return
    if verdict.aborted or verdict.lost:
        async for _ in stop(ctx, new, verdict.reason):
            yield
        if verdict.lost:
            await lost(ctx, new, verdict)
        return
    async for _ in ctx.recover(new, f"start of revision {desired.id} failed: {verdict.reason}", verdict.exit_code,
                               was_ready=False):
        yield
