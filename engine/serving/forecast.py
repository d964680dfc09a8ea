"""Forecasts: what a start should take (its ETA, by its kind) and how an apply would keep serving (its plan, each
step with an ETA). Read-only: nothing here starts, stops or writes, so the API's threads call it directly (it reads
SQLite, NVML's latest sample and a copy of the instance list); the controller calls it off the event loop.
"""

from __future__ import annotations

import collections
import logging
import os
import threading
from collections.abc import Callable
from typing import Any, Protocol

from sqlalchemy.exc import SQLAlchemyError

from engine.capacity import Planner
from engine.clock import Clock
from engine.config import AppConfig
from engine.events import EventLog
from engine.revisions import EngineSettings
from engine.schemas import ApplyPlanOut
from engine.serving.eta import Company, Eta, EtaTable, PastStart, estimate, host_load, past_start, past_steps, past_wake
from engine.serving.instances import Instances
from engine.serving.strategies.soft import adoptable, soft_plan
from engine.vllm import compile_key

log = logging.getLogger("llmops.serving")


class InFlight(Protocol):
    @property
    def in_flight(self) -> int: ...


class Traffic:
    """The most requests in flight at a tick of the last seconds: between its requests a client has none in flight,
    so one reading of now misses a steady load. Written by the loop, read by the API's threads."""

    def __init__(self, admission: InFlight, clock: Clock) -> None:
        self.admission = admission
        self.clock = clock
        self._samples: collections.deque[tuple[float, int]] = collections.deque(maxlen=64)  # (when, in flight)
        self._lock = threading.Lock()

    def recent(self, window_s: float = 10.0) -> int:
        now = self.clock.monotonic()
        with self._lock:
            self._samples.append((now, self.admission.in_flight))
            return max(n for t, n in self._samples if now - t <= window_s)


class Forecast:
    def __init__(self, config: AppConfig, events: EventLog, instances: Instances, traffic: Traffic, build: str,
                 planner: Callable[[], Planner | None], others_running: Callable[[], int]) -> None:
        self.config = config
        self.events = events
        self.instances = instances
        self.traffic = traffic
        self.build = build
        self._planner = planner  # the registry may hand its scoped planner after construction
        self._others_running = others_running

    @property
    def planner(self) -> Planner | None:
        return self._planner()

    def past_starts(self, limit: int = 100) -> list[PastStart]:
        """Successful starts recorded by this engine's ready events (and its wake-ups from sleep), oldest first
        (SQLite; a store that cannot be read now gives none: the estimates are priors then, and say so)."""
        try:
            events = self.events.events(kinds=["ready", "woken"], limit=limit, newest_first=True)
        except SQLAlchemyError as exc:
            log.warning("serving: earlier starts cannot be read (%s): ETAs from priors", exc)
            return []
        primary = self.instances.primary
        model = primary.settings.model if primary else None
        starts = (past_start(e.data) if e.kind == "ready" else past_wake(e.data, model) for e in reversed(events))
        return [s for s in starts if s is not None]

    def compile_env(self, beside: bool) -> dict[str, str]:
        """The part of a new instance's environment vLLM's compile cache sees (COMPILE_ENV): on the CPU build one
        started beside another instance is not pinned to cores (the launcher), unless the engine's own environment
        says how to pin."""
        bind = os.environ.get("VLLM_CPU_OMP_THREADS_BIND")
        if bind is None and self.build == "cpu" and (beside or self._others_running() > 0):
            bind = "nobind"
        return {} if bind is None else {"VLLM_CPU_OMP_THREADS_BIND": bind}

    def eta_for(self, values: dict[str, Any], company: Company = "alone", env: dict[str, str] | None = None) -> Eta:
        """How long a start with these values should take (``company``: alone, beside an instance that serves, a
        bridge; ``env``: its environment, else the one it would get), from this engine's earlier starts of its
        kind."""
        load, cores = host_load()
        env = env if env is not None else self.compile_env(company != "alone")
        return estimate(compile_key(values, env), str(values.get("model")), self.past_starts(), company=company,
                        build=self.build, load_1m=load, cores=cores)

    def eta_table(self) -> EtaTable:
        """The ETAs of a plan's steps: earlier starts by kind, earlier applies' steps (SQLite)."""
        try:
            applies = self.events.events(kinds=["apply_done"], limit=50, newest_first=True)
        except SQLAlchemyError as exc:
            log.warning("serving: earlier applies cannot be read (%s): step ETAs from priors", exc)
            applies = []
        load, cores = host_load()
        planner = self.planner
        device = planner.device() if planner is not None and self.build == "cuda" else None
        gpus = device.count if device is not None else 0
        return EtaTable(self.past_starts(), [s for e in reversed(applies) for s in past_steps(e.data)],
                        build=self.build, in_flight=self.traffic.recent(), load_1m=load, cores=cores,
                        neighbours=self.build == "cpu" and self._others_running() > 0, env_for=self.compile_env,
                        own_device=lambda settings: self.build == "cuda" and settings.most_replicas >= 2
                        and gpus >= settings.replicas * settings.tensor_parallel_size)

    def plan_for(self, settings: EngineSettings, restart: bool = False) -> ApplyPlanOut | None:
        """How applying ``settings`` now would keep serving (reads NVML's latest sample and SQLite). A ``restart``
        starts new instances even of what serves now: it is never "in effect now"."""
        planner = self.planner
        if planner is None:
            return None
        serving = self.instances.serving()
        if not restart and adoptable(serving, settings.model_dump()):
            return soft_plan(serving, settings)
        old = next((i for i in serving if not i.bridge), serving[0] if serving else None)
        return planner.plan(settings, None if old is None else old.settings,
                            replicas=len([i for i in serving if not i.bridge]) or (1 if old else 0),
                            memory_bytes=planner.vllm_memory(), eta_new_s=None, eta_bridge_s=None,
                            times=self.eta_table(), sleep=self.build == "cuda" and self.config.sleep_mode)
