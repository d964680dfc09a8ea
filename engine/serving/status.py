"""The status snapshot: what the API shows of one deployment's serving (its state and reason, the instances, the
start in progress, the apply under way, the gateway's counts).

The in-memory part is read on the event loop, between two of its steps: a reader in a thread would otherwise see
half of a step (an apply already "applied" beside the reason of its last step, "draining instance a"). Should the
loop not answer within ``STATUS_WAIT_S`` (it is blocked), the snapshot is read in the caller's thread as it stands.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
from collections.abc import Callable
from datetime import UTC, datetime
from typing import Any

from engine.gateway import Admission, Upstream
from engine.revisions import DeploymentRef, RevisionStore
from engine.schemas import AutoscaleOut, Build, GatewayCounts, InstanceOut, RoutingCounts, StartupView, StatusOut
from engine.serving.eta import start_view
from engine.serving.instances import Instance, Instances
from engine.serving.intent import Intent
from engine.serving.progress import Progress

log = logging.getLogger("llmops.serving")
STATUS_WAIT_S = 5.0  # how long a status read in a thread waits for the event loop before it reads off the loop


def when(ts: float | None) -> datetime | None:
    return None if ts is None else datetime.fromtimestamp(ts, UTC)


def _on_loop(loop: asyncio.AbstractEventLoop) -> bool:
    try:
        return asyncio.get_running_loop() is loop
    except RuntimeError:  # no loop runs in this thread
        return False


class StatusView:
    def __init__(self, deployment: DeploymentRef, progress: Progress, instances: Instances, admission: Admission,
                 intent: Intent, revisions: RevisionStore, build: Build, vllm_version: str | None,
                 starts: Callable[[], int], last_start: Callable[[], dict[str, Any] | None],
                 loop: Callable[[], asyncio.AbstractEventLoop | None],
                 autoscale: Callable[[], AutoscaleOut | None] = lambda: None) -> None:
        self.deployment = deployment
        self.progress = progress
        self.instances = instances
        self.admission = admission
        self.intent = intent
        self.revisions = revisions
        self.build = build
        self.vllm_version = vllm_version
        self._starts = starts
        self._last_start = last_start
        self._loop = loop
        self._autoscale = autoscale

    def status(self) -> StatusOut:
        """The snapshot (reads the desired revision: call from a thread)."""
        desired = self.revisions.desired_revision_id()
        loop = self._loop()
        if loop is None or not loop.is_running() or _on_loop(loop):
            return self.snapshot(desired)

        async def snapshot() -> StatusOut:
            return self.snapshot(desired)

        future = asyncio.run_coroutine_threadsafe(snapshot(), loop)
        try:
            return future.result(timeout=STATUS_WAIT_S)
        except concurrent.futures.TimeoutError:
            future.cancel()
            log.warning("the event loop did not answer within %.0f s: status read off the loop", STATUS_WAIT_S)
            return self.snapshot(desired)

    def snapshot(self, desired: int | None) -> StatusOut:
        """What the status shows, its apply a copy (the caller's thread serializes it while the loop goes on).
        Off the loop (the fallback above), the apply's outcome is read first, then the rest of it, then the state:
        the loop writes them the other way round (Progress.done), so an outcome seen is seen with the step and the
        reason it ended with."""
        apply = self.progress.apply
        if apply is not None:
            outcome = apply.outcome
            apply = apply.model_copy(deep=True)
            apply.outcome = outcome
        p = self.instances.primary
        sm = self.progress.sm
        state, since, reason = sm.state, sm.since, sm.reason
        return StatusOut(
            deployment=self.deployment.name, state=state, since=when(since), reason=reason,
            running_revision=p.revision.id if p else None,
            desired_revision=desired,
            model=p.settings.served_model_name if p else None,
            pid=p.child.pid if p else None, vllm_version=self.vllm_version, vllm_build=self.build,
            enabled=self.intent.enabled, halted=self.intent.halted, ready_since=when(p.ready_at if p else None),
            restarts=max(0, self._starts() - 1), startup=self.startup_view(),
            gateway=GatewayCounts(in_flight=self.admission.in_flight, waiting=self.admission.waiting,
                                  rejected=self.admission.rejected, routing=self.admission.routing),
            instances=[self.instance_out(i) for i in self.instances], apply=apply,
            autoscale=self._autoscale())

    def instance_out(self, inst: Instance) -> InstanceOut:
        upstream = next((u for u in self.admission.upstreams if u.instance == inst.name), None)
        startup = None
        if inst.role == "starting" and inst.child.started:
            startup = StartupView(revision=inst.revision.id, **start_view(inst.child.tracker, inst.eta))
        return InstanceOut(name=inst.name, role=inst.role, revision=inst.revision.id, port=inst.child.port,
                           pid=inst.child.pid, device=inst.device, node=inst.child.node,
                           address=inst.child.url if inst.child.started else None, serving=upstream is not None,
                           outstanding=upstream.outstanding if upstream else 0, since=when(inst.since),
                           startup=startup, routing=routing_counts(upstream) if upstream else None)

    def startup_view(self) -> StartupView | None:
        """The start in progress, phase by phase with its ETA; else the latest start's record."""
        starting = next((i for i in self.instances if i.role == "starting" and i.child.started), None)
        if starting is not None:
            return StartupView(revision=starting.revision.id, **start_view(starting.child.tracker, starting.eta))
        last = self._last_start()
        return StartupView.model_validate(last) if last else None


def routing_counts(upstream: Upstream) -> RoutingCounts:
    """How the gateway routed to an instance, and what vLLM's own metrics say of its cache."""
    counts = upstream.routed.counts
    return RoutingCounts(prefix=counts.prefix, home=counts.home, load=counts.load,
                         matched_share=round(counts.matched_blocks / counts.blocks, 3) if counts.blocks else None,
                         kv_cache_usage=upstream.kv_usage, prefix_cache_hit_pct=upstream.cache_hit_pct)
