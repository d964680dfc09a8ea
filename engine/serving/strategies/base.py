"""What an apply plan may ask of the rest of serving (``Context``, a narrow protocol), and the steps plans share.

A plan is an async generator: it runs until it has to wait for something (a start, a drain, a stop, a handover)
and then yields; the controller resumes it at its next tick, so no tick waits for more than one step. The plan
looks at instances' roles and verdicts and asks the context for the next action; it never reaches past the
protocol into another room.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any, Protocol

from engine.db import Revision
from engine.revisions import EngineSettings
from engine.schemas import EngineState, StepAction
from engine.serving.instances import Drain, Instance, Verdict
from engine.serving.progress import Outcome

Steps = AsyncIterator[None]


class Context(Protocol):
    """The rooms of serving as a plan sees them (engine/serving/context.py joins them)."""

    @property
    def sleep_mode(self) -> bool:
        """A pause may put instances to sleep (CUDA with sleep mode) instead of stopping them."""
        ...

    @property
    def state(self) -> EngineState: ...

    def monotonic(self) -> float: ...

    def serving(self) -> list[Instance]: ...

    def instances(self) -> list[Instance]: ...

    def device_for(self, index: int, settings: EngineSettings) -> str | None: ...

    async def launch(self, revision: Revision, settings: EngineSettings, *, device: str | None,
                     node: str | None = None, bridge: bool = False, index: int = 0,
                     abortable: bool = True) -> Instance: ...

    def verdict(self, inst: Instance) -> Verdict | None: ...

    async def promote(self, inst: Instance) -> None: ...

    def begin_handover(self, new: Instance) -> float | None: ...

    def handed_over(self, new: Instance, deadline: float) -> bool: ...

    def in_flight(self) -> int: ...

    async def close(self, inst: Instance) -> None: ...

    async def begin_drain(self, inst: Instance, reason: str) -> None: ...

    async def drained(self, inst: Instance) -> bool: ...

    def begin_drain_all(self) -> Drain: ...

    def drained_all(self, drain: Drain) -> int | None: ...

    def stop(self, inst: Instance, reason: str) -> None: ...

    def stopped(self, inst: Instance) -> bool: ...

    def sleep(self, inst: Instance) -> None: ...

    def wake_up(self, inst: Instance) -> None: ...

    def step(self, text: str) -> None: ...

    def done(self, outcome: Outcome) -> None: ...

    def timed(self, action: StepAction, instance: str, seconds: float, in_flight: int) -> None: ...

    def enter(self, state: EngineState, reason: str) -> None: ...

    async def event(self, kind: str, message: str, severity: str = "info", revision_id: int | None = None,
                    data: dict[str, Any] | None = None) -> None: ...

    async def reject(self, new: Instance, verdict: Verdict) -> None:
        """A new revision's instance did not become ready while another serves: diagnose it, reject its
        revision, say where traffic stayed."""
        ...

    def recover(self, inst: Instance, reason: str, exit_code: int | None, *, was_ready: bool) -> Steps:
        """vLLM stopped (or never started) and nothing else serves: stop what is left, diagnose, then roll back,
        retry or halt."""
        ...


async def started(ctx: Context, inst: Instance) -> Steps:
    """Until the start of ``inst`` has its verdict (``inst.verdict``)."""
    while ctx.verdict(inst) is None:
        yield


async def stop(ctx: Context, inst: Instance, reason: str) -> Steps:
    """Stop ``inst`` (it takes no traffic), until it is gone."""
    ctx.stop(inst, reason)
    while not ctx.stopped(inst):
        yield


async def retire(ctx: Context, inst: Instance, reason: str) -> Steps:
    """Drain ``inst`` (no new requests; those it has end, up to drain_timeout_s), then stop it."""
    await ctx.begin_drain(inst, reason)
    while not await ctx.drained(inst):
        yield
    async for _ in stop(ctx, inst, reason):
        yield


async def handover(ctx: Context, new: Instance) -> Steps:
    """The instances ``new`` replaces keep serving beside it until it has ended its first requests (as many as it
    runs at once, at most 8) or handover_s: a cold instance's first batch is its slowest."""
    deadline = ctx.begin_handover(new)
    if deadline is None:  # no traffic, or no handover asked for: nobody to hand over to
        return
    ctx.step(f"instance {new.name} takes its first requests beside the one it replaces")
    t0, in_flight = ctx.monotonic(), ctx.in_flight()
    while not ctx.handed_over(new, deadline):
        yield
    ctx.timed("handover", new.name, ctx.monotonic() - t0, in_flight)


async def start_new(ctx: Context, new: Instance) -> Steps:
    """Until ``new`` has its verdict; a start that failed is stopped and, when vLLM failed (not when the engine
    gave the start up: a newer revision, a stop; nor when its node was lost), its revision is rejected with a
    diagnosis. Traffic never left what served."""
    async for _ in started(ctx, new):
        yield
    verdict = new.verdict
    assert verdict is not None
    if not verdict.ready:
        async for _ in stop(ctx, new, verdict.reason):
            yield
        if verdict.lost:
            await lost(ctx, new, verdict)
        elif not verdict.aborted:
            await ctx.reject(new, verdict)


async def lost(ctx: Context, inst: Instance, verdict: Verdict) -> None:
    """A start lost with its node (or its Ray actor) says nothing of its revision: it is not rejected, and the
    next tick starts it again where the placement has room (a lost node gets nothing new for a while)."""
    await ctx.event("start_lost", f"instance {inst.name} of revision {inst.revision.id} was lost during its start "
                    f"({verdict.reason}): the revision is not rejected; it starts again on another node",
                    "warning", inst.revision.id, data={"instance": inst.name, "node": inst.child.node})
