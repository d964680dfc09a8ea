"""Readiness and health: verdicts, never waits. Each tick asks; a probe due is begun as a task (engine/vllm/probe.py)
and its answer read on a later tick, so a slow vLLM never holds the controller.

- **Readiness** of a starting instance: its verdict once known. Ready = /health answers 200 and a real 1-token
  completion succeeds (/health alone can lie). Not ready: vLLM exited (or its node was lost), the start ran past
  startup_timeout_s, or the engine gave it up (a stop asked for, a newer revision written meanwhile).
- **Health** of a serving instance: /health every health_interval_s; three failures in a row and it is unhealthy.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any

from engine.clock import Clock
from engine.config import AppConfig
from engine.serving.instances import Instance, Verdict
from engine.vllm import Prober

PROBE_EVERY_S = 0.5  # a starting instance is probed at most this often
UNHEALTHY_AFTER = 3  # /health failures in a row


def _code(returncode: int | None) -> str:
    return "" if returncode is None else f" with code {returncode}"


class Health:
    def __init__(self, config: AppConfig, clock: Clock, wake: Callable[[], None], prober: Prober) -> None:
        self.config = config
        self.prober = prober
        self.clock = clock
        self.wake = wake
        self._probes: dict[int, asyncio.Task[bool]] = {}  # id(instance) → its probe under way

    def pending(self) -> list[asyncio.Task[Any]]:
        return [t for t in self._probes.values() if not t.done()]

    def forget(self, inst: Instance) -> None:
        task = self._probes.pop(id(inst), None)
        if task is not None:
            task.cancel()

    def _probe(self, inst: Instance, make: Callable[[], Any]) -> bool | None:
        """The answer of the instance's latest probe once there is one (then forgotten); else None, and a new
        probe begun when one is due."""
        now = self.clock.monotonic()
        held = self._probes.get(id(inst))
        if held is not None:
            if not held.done():
                return None
            del self._probes[id(inst)]
            if held.cancelled() or held.exception() is not None:
                return False
            return held.result()
        if inst.last_probe is not None and now - inst.last_probe < PROBE_EVERY_S:
            return None
        inst.last_probe = now
        task: asyncio.Task[bool] = asyncio.ensure_future(make())
        task.add_done_callback(lambda _: self.wake())
        self._probes[id(inst)] = task
        return None

    def readiness(self, inst: Instance, *, enabled: bool, desired: int | None, known: bool = True) -> Verdict | None:
        """A starting instance's verdict, once known (``desired``: the revision now desired, when ``known``: the
        store could be read; a start of another, abortable, is given up)."""
        child = inst.child
        now = self.clock.monotonic()
        seconds = now - inst.launched_at
        if child.exited:
            self.forget(inst)
            return Verdict(False, f"vLLM exited{_code(child.returncode)} during start-up"
                           + (f" ({child.lost})" if child.lost else ""), seconds, child.returncode,
                           lost=child.lost is not None)
        if inst.abortable and not enabled:
            self.forget(inst)
            return Verdict(False, "stop requested during start-up", seconds, aborted=True)
        if inst.abortable and known and desired != inst.revision.id:
            self.forget(inst)
            return Verdict(False, f"revision {desired} was written during start-up", seconds, aborted=True)
        if seconds >= self.config.startup_timeout_s:
            self.forget(inst)
            return Verdict(False, f"not ready within {self.config.startup_timeout_s:.0f} s", seconds)
        if not child.started:
            return None
        answer = self._probe(inst, lambda: self.prober.ready(child.url, child.headers, inst.settings.served_model_name))
        if answer:
            return Verdict(True, "ready", self.clock.monotonic() - inst.launched_at)
        return None

    def unhealthy(self, inst: Instance) -> bool:
        """Whether a serving instance has failed /health UNHEALTHY_AFTER times in a row (probed every
        health_interval_s)."""
        now = self.clock.monotonic()
        held = self._probes.get(id(inst))
        if held is None and now - inst.last_health < self.config.health_interval_s:
            return False
        if held is None:
            inst.last_health = now
            inst.last_probe = None
        answer = self._probe(inst, lambda: self.prober.alive(inst.child.url, inst.child.headers))
        if answer is None:
            return False
        inst.health_failures = 0 if answer else inst.health_failures + 1
        return inst.health_failures >= UNHEALTHY_AFTER
