"""The rooms of serving joined behind the narrow protocol plans see (engine/serving/strategies/base.py Context):
each call goes to the one room that owns it, and nothing else is reachable from a plan."""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable
from typing import Any

from engine.clock import Clock
from engine.config import AppConfig
from engine.db import Revision
from engine.revisions import EngineSettings
from engine.schemas import EngineState, StepAction
from engine.serving.failures import Failures
from engine.serving.gate import Gate
from engine.serving.health import Health
from engine.serving.instances import Drain, Instance, Instances, Verdict
from engine.serving.intent import Intent
from engine.serving.launcher import Launcher
from engine.serving.progress import Outcome, Progress
from engine.serving.recorder import Recorder


class ServingContext:
    def __init__(self, config: AppConfig, build: str, instances: Instances, launcher: Launcher, gate: Gate,
                 health: Health,
                 failures: Failures, progress: Progress, recorder: Recorder, intent: Intent, clock: Clock,
                 desired_seen: Callable[[], tuple[bool, int | None]]) -> None:
        self.config = config
        self.build = build
        self.registry = instances
        self.launcher = launcher
        self.gate = gate
        self.health = health
        self.failures = failures
        self.progress = progress
        self.recorder = recorder
        self.intent = intent
        self.clock = clock
        self._desired_seen = desired_seen  # (read, the desired revision's id) as the controller last read it

    @property
    def sleep_mode(self) -> bool:
        return self.build == "cuda" and self.config.sleep_mode

    @property
    def state(self) -> EngineState:
        return self.progress.state

    def monotonic(self) -> float:
        return self.clock.monotonic()

    def serving(self) -> list[Instance]:
        return self.registry.serving()

    def instances(self) -> list[Instance]:
        return self.registry.all()

    def device_for(self, index: int, settings: EngineSettings) -> str | None:
        return self.launcher.device_for(index, settings)

    async def launch(self, revision: Revision, settings: EngineSettings, *, device: str | None,
                     node: str | None = None, bridge: bool = False, index: int = 0,
                     abortable: bool = True) -> Instance:
        return await self.launcher.launch(revision, settings, device=device, bridge=bridge, node=node, index=index,
                                          abortable=abortable)

    def verdict(self, inst: Instance) -> Verdict | None:
        if inst.verdict is None:
            known, desired = self._desired_seen()
            verdict = self.health.readiness(inst, enabled=self.intent.enabled, desired=desired, known=known)
            if verdict is not None:
                inst.verdict = verdict
                self.launcher.start_ended(inst)
        return inst.verdict

    async def promote(self, inst: Instance) -> None:
        await self.launcher.promote(inst)

    def begin_handover(self, new: Instance) -> float | None:
        return self.gate.begin_handover(new)

    def handed_over(self, new: Instance, deadline: float) -> bool:
        return self.gate.handed_over(new, deadline)

    def in_flight(self) -> int:
        return self.gate.in_flight()

    async def close(self, inst: Instance) -> None:
        await self.gate.close(inst)

    async def begin_drain(self, inst: Instance, reason: str) -> None:
        await self.gate.begin_drain(inst, reason)

    async def drained(self, inst: Instance) -> bool:
        return await self.gate.drained(inst)

    def begin_drain_all(self) -> Drain:
        return self.gate.begin_drain_all()

    def drained_all(self, drain: Drain) -> int | None:
        return self.gate.drained_all(drain)

    def stop(self, inst: Instance, reason: str) -> None:
        self.health.forget(inst)
        self.launcher.stop(inst, reason)

    def stopped(self, inst: Instance) -> bool:
        return self.launcher.stopped(inst)

    def sleep(self, inst: Instance) -> None:
        self.launcher.sleep(inst)

    def wake_up(self, inst: Instance) -> None:
        self.launcher.wake_up(inst)

    def step(self, text: str) -> None:
        self.progress.step(text)

    def done(self, outcome: Outcome) -> None:
        self.progress.done(outcome, self.registry.text())

    def timed(self, action: StepAction, instance: str, seconds: float, in_flight: int) -> None:
        self.progress.timed(action, instance, seconds, in_flight)

    def enter(self, state: EngineState, reason: str) -> None:
        self.progress.enter(state, reason)

    async def event(self, kind: str, message: str, severity: str = "info", revision_id: int | None = None,
                    data: dict[str, Any] | None = None) -> None:
        await self.recorder.event(kind, message, severity, revision_id, data)

    async def reject(self, new: Instance, verdict: Verdict) -> None:
        await self.failures.reject(new, verdict)

    def recover(self, inst: Instance, reason: str, exit_code: int | None, *,
                was_ready: bool) -> AsyncIterator[None]:
        return self.failures.recover(inst, reason, exit_code, was_ready=was_ready)
