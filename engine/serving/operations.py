"""The controller's operations besides a plan's steps, each an async generator it steps through a tick at a time:
a start from nothing, one more replica, one replica fewer, every instance out (a stop), and an apply (its plan
chosen, recorded, stepped through to its end and recorded again)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable

from engine.db import Revision
from engine.revisions import EngineSettings
from engine.schemas import ApplyPlanOut, EngineState
from engine.serving.context import ServingContext
from engine.serving.forecast import Forecast
from engine.serving.instances import Instance
from engine.serving.strategies import plan_steps
from engine.serving.strategies.base import lost, retire, started, stop

S = EngineState
Steps = AsyncIterator[None]
ROOM_RETRY_S = 10.0  # a replica waiting for memory is looked at again this often


class Operations:
    def __init__(self, ctx: ServingContext, forecast: Forecast,
                 room: Callable[[str | None, EngineSettings, int], str | None]) -> None:
        self.ctx = ctx
        self.forecast = forecast
        self.room = room  # whether one more instance of these settings fits on a node now (None: it does)
        self._waiting_room: str | None = None

    @property
    def waiting_room(self) -> str | None:
        """Why the replica the controller would add does not fit now (None: nothing waits for memory)."""
        return self._waiting_room

    async def start_fresh(self, revision: Revision) -> Steps:
        """Nothing serves: start the revision (its first replica; the others join once it serves)."""
        ctx = self.ctx
        progress = ctx.progress
        settings = EngineSettings.model_construct(**revision.values)
        if progress.state != S.STARTING:
            if progress.state == S.READY:
                progress.enter(S.DRAINING, "nothing serves")
            if progress.sm.can(S.STOPPING) and progress.state != S.FAILED:
                progress.enter(S.STOPPING, "nothing serves")
            if progress.state == S.STOPPING:
                progress.enter(S.STOPPED, "nothing serves")
            progress.enter(S.STARTING, f"starting revision {revision.id}")
        inst = await ctx.launch(revision, settings, device=ctx.device_for(0, settings))
        async for _ in started(ctx, inst):
            yield
        verdict = inst.verdict
        assert verdict is not None
        if verdict.ready:
            await ctx.promote(inst)
            return
        if verdict.aborted or verdict.lost:
            async for _ in stop(ctx, inst, verdict.reason):
                yield
            if verdict.lost:
                ctx.intent.next_attempt = ctx.monotonic() + ctx.config.backoff_initial_s
                await lost(ctx, inst, verdict)
            return
        async for _ in ctx.recover(inst, f"start of revision {inst.revision.id} failed: {verdict.reason}",
                                   verdict.exit_code, was_ready=False):
            yield

    async def add_replica(self, revision: Revision, index: int) -> Steps:
        """One more replica beside those that serve (a revision that asks for more, or one lost with its node),
        where the placement puts it, once its memory is free there."""
        ctx = self.ctx
        settings = EngineSettings.model_construct(**revision.values)
        node = await asyncio.to_thread(ctx.launcher.node_for, index, settings)
        short = await asyncio.to_thread(self.room, node, settings, index)
        if short is not None:  # on a fleet: another node with room, if one has it
            for other in await asyncio.to_thread(ctx.launcher.other_nodes, node, settings):
                if await asyncio.to_thread(self.room, other, settings, index) is None:
                    node, short = other, None
                    break
        if short is not None:
            ctx.intent.next_attempt = ctx.monotonic() + ROOM_RETRY_S
            if self._waiting_room != short:
                self._waiting_room = short
                await ctx.event("replica_waiting", f"replica {index + 1} of revision {revision.id} waits for "
                                f"memory: {short}; it starts when there is room (looked at every "
                                f"{ROOM_RETRY_S:.0f} s)", "warning", revision.id, data={"node": node, "why": short})
            return
        self._waiting_room = None
        inst = await ctx.launch(revision, settings, device=ctx.device_for(index, settings), node=node, index=index)
        async for _ in started(ctx, inst):
            yield
        verdict = inst.verdict
        assert verdict is not None
        if verdict.ready:
            await ctx.promote(inst)
            return
        async for _ in stop(ctx, inst, verdict.reason):
            yield
        if not verdict.aborted:
            backoff = ctx.config.backoff_initial_s if verdict.lost else ctx.config.backoff_max_s
            ctx.intent.next_attempt = ctx.monotonic() + backoff
            await ctx.event("replica_failed", f"replica {index + 1} of revision {revision.id} did not start: "
                            f"{verdict.reason}; the others serve, next try in {backoff:.0f} s",
                            "error", revision.id, data={"last_lines": list(inst.child.lines)[-30:]})

    async def retire_replica(self, inst: Instance, reason: str) -> Steps:
        async for _ in retire(self.ctx, inst, reason):
            yield

    async def stop_all(self, reason: str) -> Steps:
        """Take every instance out: drain all (requests that arrive meanwhile wait in the queue, or are refused),
        stop all."""
        ctx = self.ctx
        progress = ctx.progress
        for inst in ctx.serving():
            await ctx.close(inst)
        if progress.state == S.READY:
            progress.enter(S.DRAINING, reason)
            drain = ctx.begin_drain_all()
            while (left := ctx.drained_all(drain)) is None:
                yield
            primary = ctx.registry.primary
            message = (f"draining for: {reason}; {left} requests still in flight after "
                       f"{ctx.config.drain_timeout_s:.0f} s" if left else f"drained in-flight requests: {reason}")
            await ctx.event("drained", message, "warning" if left else "info",
                            primary.revision.id if primary else None)
        if progress.sm.can(S.STOPPING):
            progress.enter(S.STOPPING, reason)
        for inst in ctx.instances():
            while inst.busy:  # (a sleep or wake-up under way ends first)
                yield
            async for _ in stop(ctx, inst, reason):
                yield
        if progress.state == S.STOPPING:
            progress.enter(S.STOPPED, reason)

    async def to_zero(self, reason: str) -> Steps:
        """Scale to zero: every instance drains (requests that arrive meanwhile wait in the queue, not refused),
        then sleeps (CUDA with sleep mode) or stops; the deployment is stopped, and the next request wakes it."""
        ctx = self.ctx
        progress = ctx.progress
        for inst in ctx.serving():
            await ctx.close(inst)
        if progress.state == S.READY:
            progress.enter(S.DRAINING, reason)
        drain = ctx.begin_drain_all()
        while ctx.drained_all(drain) is None:
            yield
        if progress.sm.can(S.STOPPING):
            progress.enter(S.STOPPING, reason)
        for inst in ctx.instances():
            while inst.busy:
                yield
            if inst.role != "sleeping" and ctx.sleep_mode and not inst.bridge and inst.role != "starting":
                ctx.sleep(inst)  # (one that cannot sleep is stopped)
                while inst.busy:
                    yield
            if inst.role != "sleeping":
                async for _ in stop(ctx, inst, reason):
                    yield
        if progress.state == S.STOPPING:
            progress.enter(S.STOPPED, reason)

    async def wake(self, sleeping: list[Instance], want: int, reason: str) -> Steps:
        """Back from zero with instances asleep: ``want`` of them wake (about a second) and take traffic again, the
        others stop (woken, they would only be drained again); one that does not wake is stopped (the next tick
        starts the revision afresh)."""
        ctx = self.ctx
        progress = ctx.progress
        if progress.state == S.STOPPED:
            progress.enter(S.STARTING, reason)
        waking, extra = sleeping[:want], sleeping[want:]
        for inst in waking:
            ctx.wake_up(inst)
        while any(i.busy for i in waking):
            yield
        for inst in waking:
            if not inst.woken:
                async for _ in stop(ctx, inst, f"instance {inst.name} did not wake up"):
                    yield
        for inst in extra:
            async for _ in stop(ctx, inst, f"{want} replica(s) wanted after the wake"):
                yield

    async def apply(self, desired: Revision, restart: bool) -> Steps:
        """Replace what serves by instances of ``desired``, by the plan that keeps serving."""
        ctx = self.ctx
        assert desired.id is not None
        settings = EngineSettings.model_construct(**desired.values)
        plan = await asyncio.to_thread(self.forecast.plan_for, settings, restart)
        if plan is None:
            plan = ApplyPlanOut(kind="pause", reason="no planner", steps=[])
        old = ctx.registry.primary
        what = "restart" if restart else f"apply of revision {desired.id}"
        ctx.progress.begin(desired.id, old.revision.id if old else None, plan, what)
        await ctx.event("apply_plan", f"{what}: {plan.kind.replace('_', '/')} — {plan.reason}",
                        revision_id=desired.id, data={"plan": plan.model_dump(), "restart": restart})
        try:
            async for _ in plan_steps(ctx, desired, settings, plan):
                yield
        finally:
            record = ctx.progress.finish(ctx.registry.text())  # the reason: what serves now, not the last step
            assert record is not None
            await ctx.event("apply_done", f"{what}: {record.outcome}; longest stretch with nothing serving "
                            f"{record.longest_gap_s or 0:.1f} s", revision_id=desired.id,
                            data=record.model_dump(mode="json"))
