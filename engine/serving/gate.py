"""The gate: the gateway's side of serving's instances — an instance that serves is open in the gateway's admission;
one that is replaced is closed (no new requests), then drained (its requests, streams included, end, up to
drain_timeout_s); a new one takes its first requests beside the one it replaces (the handover). Nothing here
waits: a drain or a handover is begun, a watcher wakes the controller the moment it is over, and the next tick
looks (with the clock's deadline)."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import Any

from engine.clock import Clock
from engine.config import AppConfig
from engine.db import Revision
from engine.gateway import Admission, Upstream
from engine.revisions import EngineSettings
from engine.serving.instances import Drain, Instance, Instances
from engine.serving.progress import Progress
from engine.serving.recorder import Recorder
from engine.serving.strategies.soft import gateway_limit


class Gate:
    def __init__(self, config: AppConfig, admission: Admission, instances: Instances, progress: Progress,
                 recorder: Recorder, clock: Clock, wake: Callable[[], None]) -> None:
        self.config = config
        self.admission = admission
        self.instances = instances
        self.progress = progress
        self.recorder = recorder
        self.clock = clock
        self.wake = wake
        self._tasks: set[asyncio.Task[Any]] = set()  # watchers under way

    def pending(self) -> list[asyncio.Task[Any]]:
        return [t for t in self._tasks if not t.done()]

    def _task(self, coro: Awaitable[Any], name: str) -> asyncio.Task[Any]:
        task: asyncio.Task[Any] = asyncio.ensure_future(coro)
        task.set_name(name)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return task

    def close_watchers(self) -> None:
        for task in list(self._tasks):
            task.cancel()

    async def open(self, inst: Instance) -> Upstream:
        """``inst`` takes traffic (with its own API key, held to its max_num_seqs under a higher ceiling)."""
        assert inst.revision.id is not None
        child = inst.child
        self.admission.routing = inst.settings.routing
        upstream = await self.admission.open(child.url, inst.revision.id, instance=inst.name, api_key=child.api_key,
                                             limit=gateway_limit(inst), cache_tokens=inst.kv_tokens,
                                             tokens_per_event=inst.settings.tokens_per_event)
        inst.upstream = upstream
        self.progress.gap_closed()
        return upstream

    async def relabel(self, inst: Instance, revision: Revision, settings: EngineSettings) -> None:
        """A serving instance takes a revision on as it runs (a soft change): the gateway holds it to its new
        max_num_seqs and routing from the next request."""
        inst.revision, inst.settings = revision, settings
        self.admission.routing = settings.routing
        await self.admission.relabel(inst.name, revision.id, gateway_limit(inst))

    # --- the gateway -------------------------------------------------------------------------------------------

    async def close(self, inst: Instance) -> list[Upstream]:
        """No new requests to ``inst``; the upstreams closed (their requests may still be in flight)."""
        closed = await self.admission.close(inst.name)
        inst.upstream = None
        if not self.admission.upstreams:
            self.progress.gap_opened()
        return closed

    async def close_all(self) -> None:
        await self.admission.close()
        for inst in self.instances:
            inst.upstream = None
        self.progress.gap_opened()

    async def refuse(self, refusal: str | None) -> None:
        """While nothing serves on purpose, new requests get ``refusal`` at once (None: they wait in the queue)."""
        if self.admission.refusal != refusal:
            await self.admission.refuse(refusal)

    def in_flight(self) -> int:
        return self.admission.in_flight

    async def begin_drain(self, inst: Instance, reason: str) -> None:
        """No new requests to ``inst``; its requests (streams included) get up to drain_timeout_s to end."""
        closed = await self.close(inst)
        inst.role = "draining"
        now = self.clock.monotonic()
        inst.drain = Drain(now, now + self.config.drain_timeout_s, sum(u.outstanding for u in closed), closed,
                           reason)
        if closed:
            inst.drain.watcher = self._task(self._watch_drain(closed), f"drain-{inst.name}")

    async def _watch_drain(self, upstreams: list[Upstream] | None) -> None:
        await self.admission.drain(self.config.drain_timeout_s, upstreams)
        self.wake()

    def _left(self, upstreams: list[Upstream] | None) -> int:
        return self.admission.in_flight if upstreams is None else sum(u.outstanding for u in upstreams)

    async def drained(self, inst: Instance) -> bool:
        """Whether ``inst``'s drain is over (its requests ended, or drain_timeout_s passed); its end is booked
        once."""
        drain = inst.drain
        if drain is None:
            return True
        left = self._left(drain.upstreams)
        now = self.clock.monotonic()
        if left and now < drain.deadline:
            return False
        inst.drain = None
        drain.over()
        self.progress.timed("drain", inst.name, now - drain.since, drain.in_flight)
        await self.recorder.event(
            "drained", f"instance {inst.name}: {left} requests still in flight after "
            f"{self.config.drain_timeout_s:.0f} s ({drain.reason})" if left else
            f"drained instance {inst.name}: {drain.reason}", "warning" if left else "info", inst.revision.id,
            data={"instance": inst.name, "left": left})
        return True

    def begin_drain_all(self) -> Drain:
        """Every request in flight gets up to drain_timeout_s to end (the upstreams already closed)."""
        now = self.clock.monotonic()
        return Drain(now, now + self.config.drain_timeout_s, self.admission.in_flight, [], "",
                     self._task(self._watch_drain(None), "drain-all"))

    def drained_all(self, drain: Drain) -> int | None:
        """None while requests are in flight and drain_timeout_s has not passed; else how many are left."""
        left = self.admission.in_flight
        if left and self.clock.monotonic() < drain.deadline:
            return None
        drain.over()
        return left

    def begin_handover(self, new: Instance) -> float | None:
        """``new`` takes its first requests beside the instances it replaces until it has ended as many as it runs
        at once (at most 8), or handover_s: a cold instance's first batch is its slowest, and clients must not
        wait on it alone meanwhile. Its deadline (None: no traffic, nobody to hand over to)."""
        upstream = new.upstream
        if self.config.handover_s <= 0 or self.admission.in_flight == 0 or upstream is None:
            return None
        target = min(8, max(1, new.settings.max_num_seqs))
        new.handover = self._task(self._watch_handover(upstream, target), f"handover-{new.name}")
        return self.clock.monotonic() + self.config.handover_s

    async def _watch_handover(self, upstream: Upstream, target: int) -> None:
        await self.admission.finished(upstream, target, self.config.handover_s)
        self.wake()

    def handed_over(self, new: Instance, deadline: float) -> bool:
        upstream = new.upstream
        target = min(8, max(1, new.settings.max_num_seqs))
        over = upstream is None or upstream not in self.admission.upstreams or upstream.finished >= target or \
            self.clock.monotonic() >= deadline
        if over and new.handover is not None:
            new.handover.cancel()
            new.handover = None
        return over
