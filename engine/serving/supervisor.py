"""The supervisor: keeps one vLLM child running the desired settings revision.

A reconcile loop compares the desired revision in SQLite with the running one at least once a second, so a
revision written through the API, the CLI or straight into the database is applied the same way: drain the
gateway, stop the old child's whole process group, start the new child, wait until it is really ready.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import os
import signal
import time
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import httpx
import psutil

from engine.access import AuditLog
from engine.aio import cancel_and_wait
from engine.capacity import Planner, logged_batched_tokens, parse_start
from engine.config import AppConfig
from engine.db import Revision
from engine.errors import SupervisorError
from engine.events import EventLog
from engine.gateway import Admission
from engine.revisions import EngineSettings, RevisionStore, model_path, names_local_path, resolve_local_model
from engine.schemas import EngineState, GatewayCounts, StartupView, StatusOut
from engine.serving.child import VllmChild, free_port, kill_group, reap_orphans
from engine.serving.command import build_command, build_env, vllm_distribution
from engine.serving.logs import ChildLog
from engine.serving.readiness import probe
from engine.serving.recovery import Decision, RecoveryPolicy
from engine.serving.startup import Eta, PastStart, compile_key, estimate, past_start
from engine.serving.state import StateMachine

log = logging.getLogger("llmops.supervisor")


def when(ts: float | None) -> datetime | None:
    return None if ts is None else datetime.fromtimestamp(ts, UTC)
S = EngineState


@dataclass
class StartOutcome:
    ready: bool
    reason: str
    seconds: float
    exit_code: int | None = None
    aborted: bool = False


class Supervisor:
    def __init__(self, config: AppConfig, revisions: RevisionStore, events: EventLog, admission: Admission,
                 planner: Planner | None = None,
                 audit: AuditLog | None = None) -> None:
        self.config = config
        self.revisions = revisions
        self.events = events
        self.admission = admission
        self.sm = StateMachine()
        self.child: VllmChild | None = None
        self.running: Revision | None = None  # the revision of the current child, starting or ready
        self.enabled = config.autostart
        self.restart_requested = False
        self.halted: str | None = None  # why restarts stopped (crash loop), until an operator starts again
        self.planner = planner
        self.audit = audit
        self.recovery = RecoveryPolicy(config.backoff_initial_s, config.backoff_max_s,
                                       config.crashloop_max_failures, config.crashloop_window_s)
        self.build, self.vllm_version = vllm_distribution()
        self.log = ChildLog(config.logs_dir / "vllm.log", config.log_max_bytes, config.log_backups)
        self.pidfile = config.data_dir / "run" / "vllm.json"
        self.ready_at: float | None = None
        self.starts = 0
        self._wake = asyncio.Event()
        self._next_attempt = 0.0
        self._predicted: dict[str, Any] | None = None
        self._eta: Eta | None = None
        self._missing_model: int | None = None  # the revision whose local model folder is missing, once said
        self.last_start: dict[str, Any] | None = None  # the phases of the latest start, once it has ended
        self._health_failures = 0
        self._last_health = 0.0
        self._task: asyncio.Task[None] | None = None
        self._pids: tuple[int | None, float, set[int]] = (None, 0.0, set())
        self._loop: asyncio.AbstractEventLoop | None = None

    # --- what the API sees and asks ---------------------------------------------------------------------------

    def status(self) -> StatusOut:
        """What the API shows of the engine (reads the desired revision: call from a thread)."""
        return StatusOut(
            state=self.sm.state, since=when(self.sm.since), reason=self.sm.reason,
            running_revision=self.running.id if self.running else None,
            desired_revision=self.revisions.desired_revision_id(),
            model=str(self.running.values.get("served_model_name")) if self.running else None,
            pid=self.child.pid if self.child else None, vllm_version=self.vllm_version, vllm_build=self.build,
            enabled=self.enabled, halted=self.halted, ready_since=when(self.ready_at),
            restarts=max(0, self.starts - 1), startup=self.startup_view(),
            gateway=GatewayCounts(in_flight=self.admission.in_flight, waiting=self.admission.waiting,
                                  rejected=self.admission.rejected))

    def startup_view(self) -> StartupView | None:
        """The start in progress, phase by phase with its ETA; else the latest start's record."""
        child = self.child
        if child is not None and child.proc is not None and self.sm.state == S.STARTING:
            return StartupView(revision=child.revision_id, **child.tracker.view(self._eta))
        return StartupView.model_validate(self.last_start) if self.last_start else None

    def past_starts(self, limit: int = 100) -> list[PastStart]:
        """Successful starts recorded by this engine's ready events, oldest first (SQLite: call off the loop)."""
        events = self.events.events(kinds=["ready"], limit=limit, newest_first=True)
        return [s for s in (past_start(e.data) for e in reversed(events)) if s is not None]

    def eta_for(self, values: dict[str, Any]) -> Eta | None:
        """How long a start with these values should take, from this engine's earlier starts."""
        return estimate(compile_key(values), str(values.get("model")), self.past_starts())

    def served_model(self) -> str | None:
        return str(self.running.values.get("served_model_name")) if self.running else None

    def vllm_pids(self) -> set[int]:
        """Pids of the current vLLM child and its descendants (called from the sampler thread; cached 5 s)."""
        child = self.child
        pid = child.pid if child is not None else None
        if pid is None:
            return set()
        now = time.monotonic()
        if self._pids[0] != pid or now - self._pids[1] > 5:
            pids = {pid}
            with contextlib.suppress(psutil.Error):
                pids.update(p.pid for p in psutil.Process(pid).children(recursive=True))
            self._pids = (pid, now, pids)
        return self._pids[2]

    def request_start(self) -> None:
        self.enabled = True
        self.halted = None
        self.recovery.reset()
        self._next_attempt = 0.0
        self.wake()

    def request_stop(self) -> None:
        self.enabled = False
        self.wake()

    def request_restart(self) -> None:
        self.enabled = True
        self.halted = None
        self.restart_requested = True
        self._next_attempt = 0.0
        self.wake()

    def wake(self) -> None:
        """Run the reconcile loop now. Callable from any thread (sync API handlers run in a thread pool)."""
        if self._loop is not None and self._loop.is_running():
            self._loop.call_soon_threadsafe(self._wake.set)
        else:
            self._wake.set()

    # --- lifecycle --------------------------------------------------------------------------------------------

    async def start(self) -> None:
        """Begin supervising (from the event loop): stop what a dead engine left, then run the reconcile loop."""
        stray = await asyncio.to_thread(reap_orphans, self.pidfile)
        if stray:
            await self._event("stray_killed", f"stopped vLLM processes {stray} left by an engine that died", "warning")
        self._loop = asyncio.get_running_loop()
        self._task = asyncio.create_task(self._run(), name="supervisor")

    async def shutdown(self) -> None:
        await cancel_and_wait(self._task)
        if self.child is not None:
            await self.admission.close()
            await self._stop_child("engine shutting down")
        self.log.close()

    async def _run(self) -> None:
        while True:
            try:
                await self._reconcile()
            except SupervisorError as exc:
                await self._survive(str(exc))
            except Exception as exc:  # a bug must not stop supervision: logged, evented, retried
                log.exception("supervisor: unexpected error")
                await self._survive(f"internal error {type(exc).__name__}: {exc}")
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._wake.wait(), self.config.reconcile_interval_s)
            self._wake.clear()

    async def _survive(self, reason: str) -> None:
        """Record a failure of the loop itself; if even that fails (a full disk, a locked database), log it and
        go on: the loop must outlive its own errors."""
        try:
            await self._loop_failed(reason)
        except Exception:  # logged; supervision continues at the next tick
            log.exception("supervisor: could not record the failure (%s)", reason)
            self._next_attempt = time.monotonic() + self.config.backoff_max_s

    async def _loop_failed(self, reason: str) -> None:
        if self.child is not None and self.child.returncode is None:
            await self.child.stop(self.config.stop_timeout_s)
        self.child = None
        await self.admission.close()
        if self.sm.can(S.FAILED):
            await self._enter(S.FAILED, reason)
        self._next_attempt = time.monotonic() + self.config.backoff_max_s
        await self._event("failed", f"{reason}; next attempt in {self.config.backoff_max_s:.0f} s", "error")

    async def _reconcile(self) -> None:
        if self.child is not None and self.child.returncode is not None and not self.child.stop_requested:
            code = self.child.returncode
            await self._fail(f"vLLM exited with code {code} while {self.sm.state} (not asked to)", code,
                             was_ready=self.ready_at is not None)
        if self.halted is not None:
            return
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
        desired = await asyncio.to_thread(self.revisions.desired_revision)
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
            await self._drain_and_stop(why)
            await self._start(desired)
        elif self.sm.state == S.READY:
            await self._check_health()

    # --- start, stop, fail --------------------------------------------------------------------------------------

    async def _start(self, revision: Revision) -> None:
        assert revision.id is not None
        settings = EngineSettings.model_construct(**revision.values)
        data_dir = self.config.data_dir.resolve()
        if not await self._model_present(revision.id, settings.model, data_dir):
            return
        self.restart_requested = False  # this start is the restart that was asked for
        args = build_command(settings, python=self.config.vllm_python, port=free_port(), data_dir=data_dir,
                             build=self.build)
        env = build_env(offline=resolve_local_model(settings.model, data_dir) is not None,
                        hf_token=self.config.hf_token.get_secret_value() if self.config.hf_token else None)
        port = int(args[args.index("--port") + 1])
        self.child = VllmChild(args, env, port, revision.id, self.log, self.pidfile)
        self.running = revision
        self.starts += 1
        self.ready_at = None
        self._predicted = await asyncio.to_thread(self.planner.predict_now, settings) if self.planner else None
        self._eta = await asyncio.to_thread(self.eta_for, revision.values)
        self.last_start = None
        await self._enter(S.STARTING, f"starting revision {revision.id}")
        await self._event("starting", f"starting vLLM with revision {revision.id}"
                    + (f"; expected ready in {self._eta.describe()}" if self._eta else ""), revision_id=revision.id,
                    data={"args": args[1:], "predicted": self._predicted,
                          "eta_s": self._eta.total_s if self._eta else None})
        await self.child.spawn()
        outcome = await self._wait_ready(self.child, revision)
        tracker = self.child.tracker
        if outcome.ready:
            tracker.ready()
        else:
            tracker.fail(outcome.reason)
        self.last_start = {"revision": revision.id, **tracker.view(self._eta)}
        if outcome.aborted:
            await self._stop_child(outcome.reason)
            return
        if not outcome.ready:
            await self._fail(f"start of revision {revision.id} failed: {outcome.reason}", outcome.exit_code,
                             was_ready=False)
            return
        self.child.remember_descendants()
        self.recovery.ready()
        self._health_failures = 0
        self._last_health = time.monotonic()
        self.ready_at = time.time()
        await asyncio.to_thread(self.revisions.mark_applied, revision.id)
        await self.admission.open(self.child.url, revision.id)
        seconds = tracker.ready_s or outcome.seconds
        await self._enter(S.READY, f"revision {revision.id} ready after {seconds:.1f} s")
        startup: dict[str, Any] = {"phases": tracker.durations(), "compile_key": compile_key(revision.values),
                                   "model": settings.model}
        eta_text = ""
        if self._eta is not None:
            error = seconds - self._eta.total_s
            startup.update(eta_s=self._eta.total_s, eta_basis=self._eta.basis, error_s=round(error, 1),
                           error_pct=round(100 * error / self._eta.total_s, 1) if self._eta.total_s else None)
            eta_text = f" (expected {self._eta.total_s:.0f} s, {error:+.0f} s)"
        self.last_start = {"revision": revision.id, **tracker.view(self._eta), **{
            k: startup.get(k) for k in ("error_s", "error_pct")}}
        measured = await asyncio.to_thread(self._measure_start, settings, revision.id)  # calibration writes SQLite
        await self._event("ready", f"vLLM ready with revision {revision.id} after {seconds:.1f} s{eta_text}",
                          revision_id=revision.id, data={"startup_s": round(seconds, 2), "pid": self.child.pid,
                                                         "startup": startup, **measured})

    def _measure_start(self, settings: EngineSettings, revision_id: int) -> dict[str, Any]:
        """What vLLM logged about memory at this start; calibrates the capacity model on GPUs."""
        report = parse_start(list(self.log.run_lines))
        out: dict[str, Any] = {"kv_tokens": report.kv_tokens, "kv_gib": report.kv_gib,
                               "weights_gib": report.weights_gib, "activation_gib": report.activation_gib,
                               "non_torch_gib": report.non_torch_gib}
        if self.planner is not None:
            out["capacity"] = self.planner.compare(settings, report, self._predicted)
            if self.build == "cuda":
                self.planner.calibrate(report, settings, logged_batched_tokens(self.log.run_lines), revision_id)
        return out

    async def _model_present(self, revision_id: int, model: str, data_dir: Path) -> bool:
        """A revision whose model is a local folder that is not there does not start vLLM: the demo model is built
        (the first run of a data dir), any other missing folder is said, and looked for again every few seconds."""
        if not names_local_path(model) or resolve_local_model(model, data_dir) is not None:
            self._missing_model = None
            return True
        where = model_path(model, data_dir)
        if where == Path(os.path.abspath(self.config.demo_model_dir.resolve())) and await self._build_demo_model():
            return True
        message = (f"the model folder {where} has no config.json: copy the model there, or write settings that "
                   f"name another model (`llmops demo-model --data-dir {self.config.data_dir}` builds the demo model)")
        if self._missing_model != revision_id:
            self._missing_model = revision_id
            await self._event("model_missing", message, "error", revision_id, data={"model": model, "path": str(where)})
        await self._enter(S.FAILED, message)
        self._next_attempt = time.monotonic() + 5.0
        return False

    async def _build_demo_model(self) -> bool:
        """Train the demo model into the data dir (about two minutes on two cores), its progress as the reason."""
        await self._enter(S.STARTING, "building the demo model: the first run of this data dir (about 2 minutes)")
        await self._event("demo_model_building", "building the demo model for the first run of this data dir")
        args = [self.config.vllm_python, "-m", "engine.cli", "demo-model", "--data-dir", str(self.config.data_dir)]
        proc = await asyncio.create_subprocess_exec(*args, stdin=asyncio.subprocess.DEVNULL,
                                                    stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT,
                                                    start_new_session=True, cwd=str(Path(__file__).parent.parent))
        assert proc.stdout is not None
        t0 = time.monotonic()
        try:
            async for raw in proc.stdout:
                line = raw.decode("utf-8", "replace").rstrip()
                self.log.write(f"[demo-model] {line}")
                if "step" in line:
                    self.sm.reason = f"building the demo model ({time.monotonic() - t0:.0f} s): {line.strip()}"
            await proc.wait()
        except asyncio.CancelledError:
            kill_group(proc.pid, signal.SIGKILL)
            raise
        built = proc.returncode == 0 and (self.config.demo_model_dir / "config.json").is_file()
        await self._event("demo_model_built" if built else "demo_model_failed",
                    f"demo model built in {time.monotonic() - t0:.0f} s" if built else
                    f"building the demo model failed (exit {proc.returncode}); see vLLM's log",
                    "info" if built else "error")
        return built

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
                    desired = await asyncio.to_thread(self.revisions.desired_revision_id)
                    if desired != revision.id:
                        return StartOutcome(False, f"revision {desired} was written during start-up", now - t0,
                                            aborted=True)
                if now >= deadline:
                    return StartOutcome(False, f"not ready within {self.config.startup_timeout_s:.0f} s", now - t0)
                if await probe(client, served):
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
            await self._fail("vLLM stopped answering /health (3 probes in a row)", None, was_ready=True)

    async def _drain_and_stop(self, reason: str) -> None:
        await self.admission.close()
        if self.sm.state == S.READY:
            await self._enter(S.DRAINING, reason)
            left = await self.admission.drain(self.config.drain_timeout_s)
            await self._event("drained", f"draining for: {reason}; {left} requests still in flight after "
                        f"{self.config.drain_timeout_s:.0f} s" if left else f"drained in-flight requests: {reason}",
                        "warning" if left else "info", self.running.id if self.running else None)
        await self._stop_child(reason)

    async def _stop_child(self, reason: str) -> None:
        child, rev_id = self.child, (self.running.id if self.running else None)
        if self.sm.can(S.STOPPING):
            await self._enter(S.STOPPING, reason)
        if child is not None:
            old_pids = set(self.vllm_pids())
            seconds = await child.stop(self.config.stop_timeout_s)
            released = True
            if self.planner is not None:
                released = await asyncio.to_thread(self.planner.wait_released, old_pids, 30.0)
            await self._event("stopped", f"vLLM stopped in {seconds:.1f} s: {reason}"
                        + ("" if released else "; its GPU memory was still held after 30 s"),
                        "info" if released else "warning", rev_id,
                        data={"stop_s": round(seconds, 2), "exit_code": child.returncode})
        self.child = None
        self.ready_at = None
        if self.sm.state == S.STOPPING:
            await self._enter(S.STOPPED, reason)

    async def _fail(self, reason: str, exit_code: int | None, *, was_ready: bool) -> None:
        """vLLM stopped without being asked: stop what is left of it, diagnose, then roll back, retry or halt."""
        await self.admission.close()
        child, rev = self.child, self.running
        if child is not None:
            await child.stop(self.config.stop_timeout_s)
        self.child = None
        self.ready_at = None
        rev_id = rev.id if rev else None
        status = (await asyncio.to_thread(self.revisions.get_revision, rev_id)).status if rev_id else None
        decision = self.recovery.decide(rev_id, status, was_ready, list(self.log.run_lines))
        diag = decision.diagnosis
        await self._enter(S.FAILED, f"{reason}: {diag.kind}")
        await self._event("failed", reason, "error", rev_id, data={"exit_code": exit_code, "was_ready": was_ready,
                                                             "last_lines": list(self.log.run_lines)[-30:]})
        await self._event("diagnosis", f"{diag.kind}: {diag.explanation} Fix: {diag.fix}", "error", rev_id,
                    data=diag.as_dict())
        await self._act(decision, rev_id)

    async def _act(self, decision: Decision, rev_id: int | None) -> None:
        diag = decision.diagnosis
        if decision.action == "rollback" and rev_id is not None:
            await asyncio.to_thread(self.revisions.mark_rejected, rev_id, f"{diag.kind}: {diag.explanation}")
            back = await asyncio.to_thread(self.revisions.desired_revision_id)
            self._next_attempt = 0.0
            await self._event("rollback", decision.message + (f" (revision {back})" if back else
                                                        "; no revision was ever ready: write new settings"),
                        "error", rev_id, data={"rejected": rev_id, "back_to": back, "diagnosis": diag.kind})
            if self.audit is not None:
                await asyncio.to_thread(functools.partial(
                    self.audit.record, actor="engine", action="settings.auto_rollback", target=f"revision {rev_id}",
                    before={"revision": rev_id}, after={"revision": back}, detail=decision.message))
        elif decision.action == "halt":
            self.halted = decision.message
            await self.admission.refuse(f"vLLM is halted: {decision.message}")
            self.sm.reason = decision.message
            await self._event("crash_loop", decision.message, "critical", rev_id, data={"diagnosis": diag.kind})
            if self.audit is not None:
                await asyncio.to_thread(functools.partial(
                    self.audit.record, actor="engine", action="engine.halt", target=f"revision {rev_id}",
                    detail=decision.message))
        else:
            self._next_attempt = time.monotonic() + decision.delay_s
            await self._event("restart_scheduled", decision.message, "warning", rev_id,
                        data={"delay_s": decision.delay_s, "diagnosis": diag.kind})

    async def _enter(self, state: EngineState, reason: str) -> None:
        if self.sm.state == state:
            self.sm.reason = reason
            return
        self.sm.to(state, reason)
        log.info("engine %s: %s", state, reason)

    async def _event(self, kind: str, message: str, severity: str = "info", revision_id: int | None = None,
                     data: dict[str, Any] | None = None) -> None:
        await self.events.emit(kind, message, severity=severity, revision_id=revision_id, data=data)
