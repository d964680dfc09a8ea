"""The supervisor: keeps one vLLM child running the desired settings revision.

A reconcile loop compares the desired revision in SQLite with the running one at least once a second, so a
revision written through the API, the CLI or straight into the database is applied the same way: drain the
gateway, stop the old child's whole process group, start the new child, wait until it is really ready.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

import httpx

from engine.child import ChildLog, VllmChild, free_port, reap_orphans
from engine.config import AppConfig
from engine.errors import SupervisorError
from engine.gateway import Admission
from engine.settings import EngineSettings, resolve_local_model
from engine.state import EngineState, StateMachine
from engine.store import Revision, Store
from engine.vllm_command import build_command, build_env, vllm_distribution

log = logging.getLogger("llmops.supervisor")
S = EngineState


@dataclass
class StartOutcome:
    ready: bool
    reason: str
    seconds: float
    exit_code: int | None = None
    aborted: bool = False


class Supervisor:
    def __init__(self, config: AppConfig, store: Store, admission: Admission) -> None:
        self.config = config
        self.store = store
        self.admission = admission
        self.sm = StateMachine()
        self.child: VllmChild | None = None
        self.running: Revision | None = None  # the revision of the current child, starting or ready
        self.enabled = config.autostart
        self.restart_requested = False
        self.build, self.vllm_version = vllm_distribution()
        self.log = ChildLog(config.logs_dir / "vllm.log", config.log_max_bytes, config.log_backups)
        self.pidfile = config.data_dir / "run" / "vllm.json"
        self.ready_at: float | None = None
        self.starts = 0
        self._wake = asyncio.Event()
        self._attempt = 0
        self._next_attempt = 0.0
        self._health_failures = 0
        self._last_health = 0.0
        self._task: asyncio.Task[None] | None = None
        self.on_state: list[Callable[[EngineState], Awaitable[None]]] = []

    # --- what the API sees and asks ---------------------------------------------------------------------------

    def status(self) -> dict[str, Any]:
        desired = self.store.desired_revision_id()
        return {
            "state": self.sm.state.value,
            "since": self.sm.since,
            "reason": self.sm.reason,
            "running_revision": self.running.id if self.running else None,
            "desired_revision": desired,
            "model": self.running.values.get("served_model_name") if self.running else None,
            "pid": self.child.pid if self.child else None,
            "vllm_version": self.vllm_version,
            "vllm_build": self.build,
            "enabled": self.enabled,
            "ready_since": self.ready_at,
            "restarts": max(0, self.starts - 1),
            "gateway": {"in_flight": self.admission.in_flight, "waiting": self.admission.waiting,
                        "rejected": self.admission.rejected},
        }

    def served_model(self) -> str | None:
        return str(self.running.values.get("served_model_name")) if self.running else None

    def request_start(self) -> None:
        self.enabled = True
        self._next_attempt = 0.0
        self._attempt = 0
        self._wake.set()

    def request_stop(self) -> None:
        self.enabled = False
        self._wake.set()

    def request_restart(self) -> None:
        self.enabled = True
        self.restart_requested = True
        self._next_attempt = 0.0
        self._wake.set()

    def wake(self) -> None:
        self._wake.set()

    # --- lifecycle --------------------------------------------------------------------------------------------

    def start_background(self) -> None:
        stray = reap_orphans(self.pidfile)
        if stray:
            self._event("stray_killed", f"stopped vLLM processes {stray} left by an engine that died", "warning")
        self._task = asyncio.create_task(self._run(), name="supervisor")

    async def shutdown(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        if self.child is not None:
            await self.admission.close()
            await self._stop_child("engine shutting down")
        self.log.close()

    async def _run(self) -> None:
        while True:
            try:
                await self._reconcile()
            except SupervisorError as exc:
                log.error("supervisor: %s", exc)
                await self._enter(S.FAILED, str(exc))
                self._schedule_retry()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._wake.wait(), self.config.reconcile_interval_s)
            self._wake.clear()

    async def _reconcile(self) -> None:
        if self.child is not None and self.child.returncode is not None and not self.child.stop_requested:
            code = self.child.returncode
            await self._fail(f"vLLM exited with code {code} while {self.sm.state} (not asked to)", code)
        if not self.enabled:
            if self.admission.refusal is None:
                await self.admission.refuse("vLLM is stopped by an operator; start it with POST /api/engine/start")
            if self.child is not None:
                await self._drain_and_stop("stop requested")
            if self.sm.state != S.STOPPED and self.sm.can(S.STOPPED):
                await self._enter(S.STOPPED, "stop requested")
            return
        if self.admission.refusal is not None:
            await self.admission.refuse(None)
        desired = await asyncio.to_thread(self.store.desired_revision)
        if desired is None:
            if self.child is not None:
                await self._drain_and_stop("no revision can be applied")
            if self.sm.state != S.FAILED:
                await self._enter(S.FAILED, "no revision can be applied: write new settings")
            return
        if self.child is None:
            if time.monotonic() >= self._next_attempt:
                await self._start(desired)
            return
        assert self.running is not None
        if self.running.id != desired.id or self.restart_requested:
            why = "restart requested" if self.running.id == desired.id else f"applying revision {desired.id}"
            self.restart_requested = False
            await self._drain_and_stop(why)
            await self._start(desired)
        elif self.sm.state == S.READY:
            await self._check_health()

    # --- start, stop, fail --------------------------------------------------------------------------------------

    async def _start(self, revision: Revision) -> None:
        assert revision.id is not None
        settings = EngineSettings.model_construct(**revision.values)
        data_dir = self.config.data_dir.resolve()
        args = build_command(settings, python=self.config.vllm_python, port=free_port(), data_dir=data_dir,
                             build=self.build)
        env = build_env(offline=resolve_local_model(settings.model, data_dir) is not None)
        port = int(args[args.index("--port") + 1])
        self.child = VllmChild(args, env, port, revision.id, self.log, self.pidfile)
        self.running = revision
        self.starts += 1
        self.ready_at = None
        await self._enter(S.STARTING, f"starting revision {revision.id}")
        self._event("starting", f"starting vLLM with revision {revision.id}", revision_id=revision.id,
                    data={"args": args[1:]})
        await self.child.spawn()
        outcome = await self._wait_ready(self.child, revision)
        if outcome.aborted:
            await self._stop_child(outcome.reason)
            return
        if not outcome.ready:
            await self._fail(f"start of revision {revision.id} failed: {outcome.reason}", outcome.exit_code)
            return
        self.child.remember_descendants()
        self._attempt = 0
        self._health_failures = 0
        self._last_health = time.monotonic()
        self.ready_at = time.time()
        await asyncio.to_thread(self.store.mark_applied, revision.id)
        await self.admission.open(self.child.url)
        await self._enter(S.READY, f"revision {revision.id} ready after {outcome.seconds:.1f} s")
        self._event("ready", f"vLLM ready with revision {revision.id} after {outcome.seconds:.1f} s",
                    revision_id=revision.id, data={"startup_s": round(outcome.seconds, 2), "pid": self.child.pid})

    async def _wait_ready(self, child: VllmChild, revision: Revision) -> StartOutcome:
        """Ready = /health answers 200 and a real 1-token completion succeeds (/health alone can lie)."""
        t0 = time.monotonic()
        deadline = t0 + self.config.startup_timeout_s
        served = str(revision.values.get("served_model_name", ""))
        last_desired_check = 0.0
        async with httpx.AsyncClient(base_url=child.url, timeout=10.0) as client:
            while True:
                now = time.monotonic()
                if child.returncode is not None:
                    return StartOutcome(False, f"vLLM exited with code {child.returncode} during start-up",
                                        now - t0, child.returncode)
                if not self.enabled:
                    return StartOutcome(False, "stop requested during start-up", now - t0, aborted=True)
                if now - last_desired_check >= 1.0:
                    last_desired_check = now
                    desired = await asyncio.to_thread(self.store.desired_revision_id)
                    if desired != revision.id:
                        return StartOutcome(False, f"revision {desired} was written during start-up", now - t0,
                                            aborted=True)
                if now >= deadline:
                    return StartOutcome(False, f"not ready within {self.config.startup_timeout_s:.0f} s", now - t0)
                if await _probe(client, served):
                    return StartOutcome(True, "ready", time.monotonic() - t0)
                await asyncio.sleep(0.5)

    async def _check_health(self) -> None:
        if time.monotonic() - self._last_health < self.config.health_interval_s or self.child is None:
            return
        self._last_health = time.monotonic()
        try:
            async with httpx.AsyncClient(timeout=5.0) as client:
                ok = (await client.get(f"{self.child.url}/health")).status_code == 200
        except httpx.HTTPError:
            ok = False
        self._health_failures = 0 if ok else self._health_failures + 1
        if self._health_failures >= 3:
            await self._fail("vLLM stopped answering /health (3 probes in a row)", None)

    async def _drain_and_stop(self, reason: str) -> None:
        await self.admission.close()
        if self.sm.state == S.READY:
            await self._enter(S.DRAINING, reason)
            left = await self.admission.drain(self.config.drain_timeout_s)
            self._event("drained", f"draining for: {reason}; {left} requests still in flight after "
                        f"{self.config.drain_timeout_s:.0f} s" if left else f"drained in-flight requests: {reason}",
                        "warning" if left else "info", self.running.id if self.running else None)
        await self._stop_child(reason)

    async def _stop_child(self, reason: str) -> None:
        child, rev_id = self.child, (self.running.id if self.running else None)
        if self.sm.can(S.STOPPING):
            await self._enter(S.STOPPING, reason)
        if child is not None:
            seconds = await child.stop(self.config.stop_timeout_s)
            self._event("stopped", f"vLLM stopped in {seconds:.1f} s: {reason}", revision_id=rev_id,
                        data={"stop_s": round(seconds, 2), "exit_code": child.returncode})
        self.child = None
        self.ready_at = None
        if self.sm.state == S.STOPPING:
            await self._enter(S.STOPPED, reason)

    async def _fail(self, reason: str, exit_code: int | None) -> None:
        await self.admission.close()
        child, rev = self.child, self.running
        if child is not None:
            await child.stop(self.config.stop_timeout_s)
        self.child = None
        self.ready_at = None
        await self._enter(S.FAILED, reason)
        self._event("failed", reason, "error", rev.id if rev else None,
                    data={"exit_code": exit_code, "last_lines": list(self.log.run_lines)[-30:]})
        self._schedule_retry()

    def _schedule_retry(self) -> None:
        self._attempt += 1
        delay = min(self.config.backoff_max_s, self.config.backoff_initial_s * 2 ** (self._attempt - 1))
        self._next_attempt = time.monotonic() + delay
        self._event("restart_scheduled", f"next start attempt in {delay:.0f} s (attempt {self._attempt})",
                    "warning", self.running.id if self.running else None, data={"delay_s": delay})

    async def _enter(self, state: EngineState, reason: str) -> None:
        if self.sm.state == state:
            self.sm.reason = reason
            return
        self.sm.to(state, reason)
        log.info("engine %s: %s", state, reason)
        for callback in self.on_state:
            await callback(state)

    def _event(self, kind: str, message: str, severity: str = "info", revision_id: int | None = None,
               data: dict[str, Any] | None = None) -> None:
        self.store.add_event(kind, message, severity=severity, revision_id=revision_id, data=data)


async def _probe(client: httpx.AsyncClient, served_model: str) -> bool:
    try:
        if (await client.get("/health")).status_code != 200:
            return False
        resp = await client.post("/v1/completions",
                                 json={"model": served_model, "prompt": "Hello", "max_tokens": 1, "temperature": 0})
        return resp.status_code == 200 and bool(resp.json().get("choices"))
    except (httpx.HTTPError, ValueError):
        return False
