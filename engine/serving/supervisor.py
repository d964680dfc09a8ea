"""The supervisor: keeps a set of vLLM instances serving the desired settings revision.

A reconcile loop compares the desired revision in SQLite with what serves at least once a second, so a revision
written through the API, the CLI or straight into the database is applied the same way. An apply is a plan
(engine/capacity/plans.py) that keeps something serving whenever the memory allows:

- **blue/green**: the new instance starts beside the old one; the gateway moves to it; the old one drains.
- **bridge**: a small instance of the old revision starts beside the old one and takes the traffic; the old one
  drains and stops; the new one starts beside the bridge and takes the traffic; the bridge drains and stops.
- **rolling** (2 or more replicas): one replica at a time drains, stops and comes back on the new revision.
- **pause**: drain, stop (on CUDA with sleep mode: put to sleep), start, serve the queue.

A new instance that fails to become ready is stopped and its revision rejected and diagnosed; traffic stays on
what served (after a pause, the sleeping old instance is woken, or the last good revision started again).
"""

from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import contextlib
import functools
import logging
import os
import secrets
import signal
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, Literal

import httpx
import psutil
from sqlalchemy.exc import SQLAlchemyError

from engine.access import AuditLog
from engine.aio import cancel_and_wait
from engine.capacity import Planner, logged_batched_tokens, parse_start
from engine.config import AppConfig
from engine.db import UNAVAILABLE, Revision, unavailable_reason
from engine.errors import InvalidSettingsError, SupervisorError
from engine.events import EventLog
from engine.gateway import Admission, Upstream
from engine.placement import Child, ChildSpec, LocalPlacement, Placement
from engine.revisions import (
    EngineSettings,
    RevisionStore,
    model_path,
    names_local_path,
    resolve_local_model,
    validate_settings,
)
from engine.schemas import (
    ApplyPlanOut,
    ApplyProgress,
    EngineState,
    GatewayCounts,
    InstanceOut,
    InstanceRole,
    StartupView,
    StatusOut,
    StepAction,
    StepTiming,
)
from engine.serving import applies
from engine.serving.child import free_port, kill_group, reap_all
from engine.serving.command import (
    at_nice,
    build_command,
    build_env,
    launch_max_num_seqs,
    renice_group,
    unbound_omp_threads,
    vllm_distribution,
)
from engine.serving.etas import EtaTable, past_steps
from engine.serving.logs import ChildLog
from engine.serving.readiness import probe
from engine.serving.recovery import Decision, RecoveryPolicy
from engine.serving.scope import DeploymentRef
from engine.serving.startup import Company, Eta, PastStart, compile_key, estimate, host_load, past_start, past_wake
from engine.serving.state import StateMachine

log = logging.getLogger("llmops.supervisor")
S = EngineState
NAMES = "abcdefghijklmnopqrstuvwxyz"
STATUS_WAIT_S = 5.0  # how long a status read in a thread waits for the event loop before it reads off the loop


SOFT_FIELDS = ("replicas", "max_num_seqs", "max_num_seqs_ceiling")  # what a running instance can take on


def soft_change(inst: Instance, values: dict[str, Any]) -> bool:
    """Whether ``inst`` can serve a revision of ``values`` as it runs: nothing it was started with differs, and
    a new max_num_seqs fits under the ceiling it was started with (a new ceiling needs a restart)."""
    current = inst.revision.values
    if {**current, **dict.fromkeys(SOFT_FIELDS)} != {**values, **dict.fromkeys(SOFT_FIELDS)}:
        return False
    seqs, ceiling = int(values.get("max_num_seqs") or 1), values.get("max_num_seqs_ceiling")
    if seqs == current.get("max_num_seqs") and ceiling == current.get("max_num_seqs_ceiling"):
        return True  # only replicas
    # a new max_num_seqs without a restart only under a ceiling the operator asked for, the one it runs with
    return ceiling is not None and ceiling == inst.launched_seqs and seqs <= ceiling


def soft_plan(serving: list[Instance], settings: EngineSettings) -> ApplyPlanOut:
    """The plan of a change the running instances take on as they run (no restart)."""
    old = serving[0].settings
    steps = []
    if old.max_num_seqs != settings.max_num_seqs:
        steps.append(f"the gateway holds each instance to max_num_seqs {settings.max_num_seqs} from the next request "
                     f"(vLLM runs with a ceiling of {min(i.launched_seqs for i in serving)})")
    if settings.replicas > len(serving):
        steps.append(f"start {settings.replicas - len(serving)} more replica(s) beside those that serve")
    elif settings.replicas < len(serving):
        steps.append(f"drain and stop {len(serving) - settings.replicas} replica(s); the others serve")
    return ApplyPlanOut(kind="soft", reason="in effect now, no restart: nothing the running instances were started "
                        "with changes", pause_s=0.0, expected_s=0.0 if settings.replicas <= len(serving) else None,
                        capacity_dip_pct=0.0, steps=steps or ["record the revision: nothing changes"])


def gateway_limit(inst: Instance) -> int | None:
    """How many requests the gateway lets the instance run at once: its revision's max_num_seqs when it was
    started with a higher ceiling; else None (vLLM holds it to max_num_seqs itself, and queues the rest)."""
    seqs = inst.settings.max_num_seqs
    return seqs if seqs < inst.launched_seqs else None


def _code(returncode: int | None) -> str:
    return "" if returncode is None else f" with code {returncode}"


def _on_loop(loop: asyncio.AbstractEventLoop) -> bool:
    try:
        return asyncio.get_running_loop() is loop
    except RuntimeError:  # no loop runs in this thread
        return False


def when(ts: float | None) -> datetime | None:
    return None if ts is None else datetime.fromtimestamp(ts, UTC)


@dataclass
class StartOutcome:
    ready: bool
    reason: str
    seconds: float
    exit_code: int | None = None
    aborted: bool = False


@dataclass(eq=False)
class Instance:
    """One vLLM instance: its process, the revision (and settings: a bridge's are the old revision's, smaller) it
    runs, its role, and the GPUs it is pinned to."""

    name: str
    child: Child
    revision: Revision
    settings: EngineSettings
    role: InstanceRole = "starting"
    device: str | None = None
    bridge: bool = False
    since: float = field(default_factory=time.time)
    eta: Eta | None = None  # what its start should take, by its kind (eta.kind)
    compile_key: str = ""  # its settings and environment as vLLM's compile cache sees them
    predicted: dict[str, Any] | None = None
    launched_seqs: int = 0  # the max_num_seqs vLLM was started with (its ceiling)
    lowered: bool = False  # started at start_beside_nice (beside one that serves): raised to vllm_nice once it serves
    ready_at: float | None = None
    health_failures: int = 0
    last_health: float = 0.0

    @property
    def serving(self) -> bool:
        return self.role in ("serving", "bridge")


class Supervisor:
    def __init__(self, config: AppConfig, revisions: RevisionStore, events: EventLog, admission: Admission,
                 planner: Planner | None = None, audit: AuditLog | None = None,
                 deployment: DeploymentRef | None = None) -> None:
        self.config = config
        self.deployment = deployment or DeploymentRef()
        # instances of other deployments running on this host now (the CPU build then leaves this one unpinned)
        self.others_running: Callable[[], int] = lambda: 0
        self.placement: Placement = LocalPlacement()  # where instances run (the registry hands the configured one)
        # whether one more instance of these settings fits on a node now (None: it does; else why not)
        self.room: Callable[[str | None, EngineSettings], str | None] = lambda _node, _settings: None
        self._waiting_room: str | None = None
        self.revisions = revisions
        self.events = events
        self.admission = admission
        self.sm = StateMachine()
        self.instances: list[Instance] = []
        self.enabled = config.autostart
        self.stop_reason: str | None = None  # why requests are refused while stopped (None: an operator stopped it)
        self.restart_requested = False
        self.halted: str | None = None  # why restarts stopped (crash loop), until an operator starts again
        self.planner = planner
        self.audit = audit
        self.recovery = RecoveryPolicy(config.backoff_initial_s, config.backoff_max_s,
                                       config.crashloop_max_failures, config.crashloop_window_s)
        self.build, self.vllm_version = vllm_distribution()
        self.log = ChildLog(config.logs_dir / self.deployment.log_name, config.log_max_bytes, config.log_backups)
        self.run_dir = config.data_dir / "run"
        self.starts = 0
        self.apply: ApplyProgress | None = None  # the apply under way, or the latest one
        self._wake = asyncio.Event()
        self._next_attempt = 0.0
        self._missing_model: int | None = None  # the revision whose local model folder is missing, once said
        self.last_start: dict[str, Any] | None = None  # the phases of the latest start, once it has ended
        self._task: asyncio.Task[None] | None = None
        self._pids: tuple[tuple[int, ...], float, set[int]] = ((), 0.0, set())
        self._loop: asyncio.AbstractEventLoop | None = None
        self._gap_since: float | None = None  # since when nothing serves (during an apply)
        self.unrecorded = 0  # events and bookkeeping writes the database could not take
        self._tasks: set[asyncio.Task[None]] = set()  # short tasks started from callbacks (an instance's exit)
        self.database_down_since: float | None = None  # the desired revision could not be read since (monotonic)
        self._traffic: collections.deque[tuple[float, int]] = collections.deque(maxlen=64)  # (when, in flight)
        self._traffic_lock = threading.Lock()  # read by API threads (a plan), written by the loop

    # --- what the API sees and asks ---------------------------------------------------------------------------

    @property
    def primary(self) -> Instance | None:
        """The instance that stands for the engine: a serving one of the revision (not a bridge), else a bridge,
        else one starting."""
        for want in (lambda i: i.role == "serving", lambda i: i.role == "bridge", lambda i: True):
            found = next((i for i in self.instances if want(i)), None)
            if found is not None:
                return found
        return None

    @property
    def child(self) -> Child | None:
        p = self.primary
        return p.child if p else None

    @property
    def running(self) -> Revision | None:
        """The revision that serves (or is starting, when nothing serves)."""
        p = self.primary
        return p.revision if p else None

    @property
    def ready_at(self) -> float | None:
        p = self.primary
        return p.ready_at if p else None

    def status(self) -> StatusOut:
        """What the API shows of the engine (reads the desired revision: call from a thread).

        The in-memory part is read on the event loop, between two of its steps: a reader in a thread would
        otherwise see half of a step (an apply already "applied" beside the reason of its last step, "draining
        instance a"). Should the loop not answer within ``STATUS_WAIT_S`` (it is blocked), the snapshot is read here
        as it stands."""
        desired = self.revisions.desired_revision_id()
        loop = self._loop
        if loop is None or not loop.is_running() or _on_loop(loop):
            return self._snapshot(desired)

        async def snapshot() -> StatusOut:
            return self._snapshot(desired)

        future = asyncio.run_coroutine_threadsafe(snapshot(), loop)
        try:
            return future.result(timeout=STATUS_WAIT_S)
        except concurrent.futures.TimeoutError:
            future.cancel()
            log.warning("the event loop did not answer within %.0f s: status read off the loop", STATUS_WAIT_S)
            return self._snapshot(desired)

    def _snapshot(self, desired: int | None) -> StatusOut:
        p = self.primary
        return StatusOut(
            deployment=self.deployment.name, state=self.sm.state, since=when(self.sm.since), reason=self.sm.reason,
            running_revision=p.revision.id if p else None,
            desired_revision=desired,
            model=p.settings.served_model_name if p else None,
            pid=p.child.pid if p else None, vllm_version=self.vllm_version, vllm_build=self.build,
            enabled=self.enabled, halted=self.halted, ready_since=when(self.ready_at),
            restarts=max(0, self.starts - 1), startup=self.startup_view(),
            gateway=GatewayCounts(in_flight=self.admission.in_flight, waiting=self.admission.waiting,
                                  rejected=self.admission.rejected),
            instances=[self._instance_out(i) for i in self.instances], apply=self.apply)

    def _instance_out(self, inst: Instance) -> InstanceOut:
        upstream = next((u for u in self.admission.upstreams if u.instance == inst.name), None)
        startup = None
        if inst.role == "starting" and inst.child.started:
            startup = StartupView(revision=inst.revision.id, **inst.child.tracker.view(inst.eta))
        return InstanceOut(name=inst.name, role=inst.role, revision=inst.revision.id, port=inst.child.port,
                           pid=inst.child.pid, device=inst.device, node=inst.child.node,
                           address=inst.child.url if inst.child.started else None, serving=upstream is not None,
                           outstanding=upstream.outstanding if upstream else 0, since=when(inst.since),
                           startup=startup)

    def startup_view(self) -> StartupView | None:
        """The start in progress, phase by phase with its ETA; else the latest start's record."""
        starting = next((i for i in self.instances if i.role == "starting" and i.child.started), None)
        if starting is not None:
            return StartupView(revision=starting.revision.id, **starting.child.tracker.view(starting.eta))
        return StartupView.model_validate(self.last_start) if self.last_start else None

    def past_starts(self, limit: int = 100) -> list[PastStart]:
        """Successful starts recorded by this engine's ready events (and its wake-ups from sleep), oldest first
        (SQLite: call off the loop)."""
        events = self.events.events(kinds=["ready", "woken"], limit=limit, newest_first=True)
        model = self.primary.settings.model if self.primary else None
        starts = (past_start(e.data) if e.kind == "ready" else past_wake(e.data, model) for e in reversed(events))
        return [s for s in starts if s is not None]

    def eta_for(self, values: dict[str, Any], company: Company = "alone", env: dict[str, str] | None = None) -> Eta:
        """How long a start with these values should take (``company``: alone, beside an instance that serves, a
        bridge; ``env``: its environment, else the one it would get), from this engine's earlier starts of its
        kind."""
        load, cores = host_load()
        env = env if env is not None else self.compile_env(company != "alone")
        return estimate(compile_key(values, env), str(values.get("model")), self.past_starts(), company=company,
                        build=self.build, load_1m=load, cores=cores)

    def compile_env(self, beside: bool) -> dict[str, str]:
        """The part of a new instance's environment vLLM's compile cache sees (COMPILE_ENV): on the CPU build one
        started beside another instance is not pinned to cores (_launch), unless the engine's own environment
        says how to pin."""
        bind = os.environ.get("VLLM_CPU_OMP_THREADS_BIND")
        if bind is None and self.build == "cpu" and (beside or self.others_running() > 0):
            bind = "nobind"
        return {} if bind is None else {"VLLM_CPU_OMP_THREADS_BIND": bind}

    def eta_table(self) -> EtaTable:
        """The ETAs of a plan's steps: earlier starts by kind, earlier applies' steps (SQLite: call off the loop)."""
        applies = self.events.events(kinds=["apply_done"], limit=50, newest_first=True)
        load, cores = host_load()
        device = self.planner.device() if self.planner is not None and self.build == "cuda" else None
        gpus = device.count if device is not None else 0
        return EtaTable(self.past_starts(), [s for e in reversed(applies) for s in past_steps(e.data)],
                        build=self.build, in_flight=self.recent_in_flight(), load_1m=load, cores=cores,
                        neighbours=self.build == "cpu" and self.others_running() > 0, env_for=self.compile_env,
                        own_device=lambda settings: self.build == "cuda" and settings.replicas >= 2
                        and gpus >= settings.replicas * settings.tensor_parallel_size)

    def plan_for(self, settings: EngineSettings, restart: bool = False) -> ApplyPlanOut | None:
        """How applying ``settings`` now would keep serving (call from a thread: reads NVML's latest sample and
        SQLite). A ``restart`` starts new instances even of what serves now: it is never "in effect now"."""
        if self.planner is None:
            return None
        serving = [i for i in self.instances if i.serving]
        values = settings.model_dump()
        if not restart and serving and not any(i.bridge for i in serving) and \
                all(soft_change(i, values) for i in serving):
            return soft_plan(serving, settings)
        old = next((i for i in serving if not i.bridge), serving[0] if serving else None)
        return self.planner.plan(settings, None if old is None else old.settings,
                                 replicas=len([i for i in serving if not i.bridge]) or (1 if old else 0),
                                 memory_bytes=self.planner.vllm_memory(), eta_new_s=None, eta_bridge_s=None,
                                 times=self.eta_table(), sleep=self.build == "cuda" and self.config.sleep_mode)

    def served_model(self) -> str | None:
        p = self.primary
        return p.settings.served_model_name if p else None

    def vllm_pids(self) -> set[int]:
        """Pids of every vLLM instance of this deployment and their descendants (called from the sampler thread;
        cached 5 s)."""
        roots = tuple(sorted(i.child.pid for i in list(self.instances) if i.child.pid is not None and i.child.local))
        if not roots:
            return set()
        now = time.monotonic()
        if self._pids[0] != roots or now - self._pids[1] > 5:
            pids = set(roots)
            for pid in roots:
                with contextlib.suppress(psutil.Error):
                    pids.update(p.pid for p in psutil.Process(pid).children(recursive=True))
            self._pids = (roots, now, pids)
        return self._pids[2]

    def request_start(self) -> None:
        self.enabled = True
        self.stop_reason = None
        self.halted = None
        self.recovery.reset()
        self._next_attempt = 0.0
        self.wake()

    def request_stop(self, reason: str | None = None) -> None:
        """Stop serving; requests get 503 with ``reason`` (default: stopped by an operator) until it starts."""
        self.enabled = False
        self.stop_reason = reason or self._operator_stop()
        self.wake()

    def _operator_stop(self) -> str:
        where = "/api/engine/start" if self.deployment.default else \
            f"/api/deployments/{self.deployment.name}/engine/start"
        return f"vLLM is stopped by an operator; start it with POST {where}"

    def served_names(self) -> set[str]:
        """The names the instances that serve now answer to (vLLM's --served-model-name)."""
        return {i.settings.served_model_name for i in list(self.instances) if i.serving}

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

    async def start(self, reap: bool = True) -> None:
        """Begin supervising (from the event loop): stop what a dead engine left (unless the registry did, once
        for every deployment), then run the reconcile loop."""
        if reap:
            stray = await asyncio.to_thread(reap_all, self.run_dir)
            if stray:
                await self._event("stray_killed", f"stopped vLLM processes {stray} left by an engine that died",
                                  "warning")
        self._loop = asyncio.get_running_loop()
        self._task = asyncio.create_task(self._run(), name=f"supervisor-{self.deployment.name}")

    async def shutdown(self) -> None:
        await cancel_and_wait(self._task)
        await self.admission.close()
        for inst in list(self.instances):
            await self._stop(inst, "engine shutting down")
        if self.sm.can(S.STOPPING):
            await self._enter(S.STOPPING, "engine shutting down")
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
        await self.admission.close()
        for inst in list(self.instances):
            if inst.child.returncode is None:
                await inst.child.stop(self.config.stop_timeout_s)
            self._forget(inst)
        if self.sm.can(S.FAILED):
            await self._enter(S.FAILED, reason)
        self._next_attempt = time.monotonic() + self.config.backoff_max_s
        await self._event("failed", f"{reason}; next attempt in {self.config.backoff_max_s:.0f} s", "error")

    def _spawn_task(self, coro: Any, name: str) -> None:
        task = asyncio.get_running_loop().create_task(coro, name=name)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _instance_exited(self, inst: Instance) -> None:
        """An instance's server process exited without being asked to (seen the moment it happened, whatever
        the reconcile loop is doing: an apply can take minutes): the gateway sends it nothing more, at once, and
        the exit is on record; the loop then handles it (diagnosis, restart, rollback) at its next step."""
        if inst.child.stop_requested or inst not in self.instances:
            return
        role = inst.role
        closed = await self._close(inst) if inst.serving else []
        in_flight = sum(u.outstanding for u in closed)
        if inst.serving:
            inst.role = "failed"
        # when it was seen (the event is written after: its time waits for a database thread on a busy host)
        seen = time.time() - (time.monotonic() - inst.child.exited_at) if inst.child.exited_at else time.time()
        lost = getattr(inst.child, "lost", None)  # a remote instance gone without an exit says how it was seen
        how = f"lost ({lost})" if lost else "exited"
        message = (f"vLLM instance {inst.name} (revision {inst.revision.id}) {how} while {role}: no new requests go "
                   "to it" + (f"; {in_flight} in flight on it fail" if in_flight else ""))
        await self._event("instance_exited", message,
                          "error", inst.revision.id, data={"instance": inst.name, "role": role,
                                                           "exit_code": inst.child.returncode,
                                                           "in_flight": in_flight, "pid": inst.child.pid,
                                                           "seen_at": round(seen, 3), "lost": lost})
        self.wake()

    # --- the loop ----------------------------------------------------------------------------------------------

    def recent_in_flight(self, window_s: float = 10.0) -> int:
        """The most requests in flight now or at a tick of the last ``window_s`` (between its requests a client
        has none in flight: one reading of now misses a steady load)."""
        now = time.monotonic()
        with self._traffic_lock:
            self._traffic.append((now, self.admission.in_flight))
            return max(n for t, n in self._traffic if now - t <= window_s)

    async def _reconcile(self) -> None:
        self.recent_in_flight()
        for inst in list(self.instances):
            if inst.child.exited and not inst.child.stop_requested:
                await self._crashed(inst, f"vLLM instance {inst.name} exited{_code(inst.child.returncode)} "
                                    f"while {inst.role} (not asked to)", inst.child.returncode)
        if self.halted is not None:
            return
        if not self.enabled:
            refusal = self.stop_reason or self._operator_stop()
            if self.admission.refusal != refusal:
                await self.admission.refuse(refusal)
            if self.instances:
                await self._pause_out("stop requested")
            if self.sm.state != S.STOPPED and self.sm.can(S.STOPPED):
                await self._enter(S.STOPPED, "stop requested")
            return
        if self.admission.refusal is not None:
            await self.admission.refuse(None)
        try:
            desired = await asyncio.to_thread(self.revisions.desired_revision)
        except UNAVAILABLE as exc:
            # the database is down or restarting: what serves goes on serving, and the next tick reads it again
            if self.database_down_since is None:
                self.database_down_since = time.monotonic()
                log.warning("supervisor: the desired revision cannot be read (%s); vLLM keeps serving what it "
                            "serves until the database is back", unavailable_reason(exc))
            return
        if self.database_down_since is not None:
            log.info("supervisor: the database is back after %.0f s", time.monotonic() - self.database_down_since)
            self.database_down_since = None
        if desired is None:
            if self.instances:
                await self._pause_out("no revision can be applied")
            if self.sm.state != S.FAILED:
                await self._enter(S.FAILED, "no revision can be applied: write new settings")
            return
        serving = [i for i in self.instances if i.serving]
        if not serving:
            if time.monotonic() >= self._next_attempt:
                await self._start_fresh(desired)
            return
        proper = [i for i in serving if not i.bridge and i.revision.id == desired.id]
        if len(proper) < len(serving) or self.restart_requested:
            if not self.restart_requested and await self._adopt(desired, serving):
                return  # only replicas changed: nothing restarts; the next tick adds or retires replicas
            await self._apply(desired)
            return
        want = int(desired.values.get("replicas") or 1)
        if len(proper) < want and time.monotonic() >= self._next_attempt:
            await self._add_replica(desired, len(proper))
        elif len(proper) > want:
            await self._retire(proper[-1], f"revision {desired.id} runs {want} replica(s)")
        else:
            await self._check_health()

    async def _adopt(self, desired: Revision, serving: list[Instance]) -> bool:
        """A revision that changes nothing the running instances were started with is not an apply: only
        ``replicas`` (a scale: replicas are then added or retired one by one) and ``max_num_seqs`` within the
        ceiling they were started with (the gateway holds each to it from the next request). The instances that
        serve become its own: no restart, no gap."""
        if any(i.bridge for i in serving) or not all(soft_change(i, desired.values) for i in serving):
            return False
        assert desired.id is not None
        before = sorted({i.revision.id or 0 for i in serving})
        old = serving[0].settings
        settings = EngineSettings.model_construct(**desired.values)
        t0 = time.monotonic()
        for inst in serving:
            inst.revision, inst.settings = desired, settings
            await self.admission.relabel(inst.name, desired.id, gateway_limit(inst))
        seconds = time.monotonic() - t0
        await self._write(f"revision {desired.id} as applied", self.revisions.mark_applied, desired.id)
        want = settings.replicas
        changed = []
        if old.max_num_seqs != settings.max_num_seqs:
            changed.append(f"max_num_seqs {old.max_num_seqs} → {settings.max_num_seqs} in effect now (within the "
                           f"ceiling of {min(i.launched_seqs for i in serving)} they were started with)")
        if old.replicas != want:
            changed.append(f"replicas {len(serving)} → {want}")
        await self._event("applied_soft", f"revision {desired.id}: " + "; ".join(changed or ["no change"])
                          + f"; instances {', '.join(i.name for i in serving)} serve it, nothing restarts",
                          revision_id=desired.id, data={"from_revisions": before, "replicas": want,
                                                        "max_num_seqs": settings.max_num_seqs,
                                                        "in_effect_s": round(seconds, 4)})
        self.sm.reason = f"{self._serving_text()}" + (f"; scaling to {want} replica(s)" if want != len(serving)
                                                      else "")
        return True

    # --- starting and stopping instances -----------------------------------------------------------------------

    def _node_for(self, index: int, settings: EngineSettings) -> str | None:
        """Where replica ``index`` goes: the placement's choice among nodes with room, beside this deployment's
        other instances (None: this host)."""
        taken = [i.child.node for i in self.instances if i.serving or i.role == "starting"]
        return self.placement.place(index, taken, settings.tensor_parallel_size if self.build == "cuda" else 0)

    def _free_name(self) -> str:
        used = {i.name for i in self.instances}
        return next(n for n in NAMES if n not in used)

    def _device_for(self, index: int, settings: EngineSettings) -> str | None:
        """The GPUs of replica ``index``: its own tensor-parallel group when the deployment's GPUs (the host's,
        when it names none) are enough for every replica, else the deployment's shared (None: CUDA_VISIBLE_DEVICES
        left as it is)."""
        if self.build != "cuda":
            return None
        placed = self.deployment.gpus
        tp = settings.tensor_parallel_size
        if settings.replicas < 2 or self.planner is None:
            return None if not placed else ",".join(map(str, placed))
        device = self.planner.device(tp)
        gpus = placed or (list(range(device.count)) if device is not None else [])
        if len(gpus) < settings.replicas * tp:
            return None if not placed else ",".join(map(str, placed))
        return ",".join(str(g) for g in gpus[index * tp:(index + 1) * tp])

    async def _ready_to_start(self, revision: Revision) -> bool:
        settings = EngineSettings.model_construct(**revision.values)
        data_dir = self.config.data_dir.resolve()
        return await self._model_present(revision.id or 0, settings.model, data_dir) and \
            await self._valid(revision, data_dir)

    async def _launch(self, revision: Revision, settings: EngineSettings, *, name: str, device: str | None,
                      bridge: bool = False, node: str | None = None, index: int = 0) -> Instance:
        """Spawn an instance (role starting) on ``node`` (None: where the placement puts replica ``index``); the
        caller waits for it with _await_ready."""
        if node is None or not await asyncio.to_thread(self.placement.alive, node):  # Ray asks its GCS: a thread
            node = await asyncio.to_thread(self._node_for, index, settings)
        assert revision.id is not None
        data_dir = self.config.data_dir.resolve()
        sleep = self.build == "cuda" and self.config.sleep_mode
        # on the CPU build a start beside an instance that serves gets the cores serving leaves (see
        # start_beside_nice); a local child only (a Ray node's processes are not this host's to renice)
        lowered = (self.build == "cpu" and self.placement.kind == "local" and any(i.serving for i in self.instances)
                   and self.config.start_beside_nice > self.config.vllm_nice)
        args = build_command(settings, python=self.config.vllm_python, port=free_port(), data_dir=data_dir,
                             build=self.build, sleep_mode=sleep,
                             nice=self.config.start_beside_nice if lowered else self.config.vllm_nice)
        key = secrets.token_urlsafe(32)  # vLLM answers /v1 to the gateway only, not to any local user of the port
        cluster = self.config.ray_address if settings.pipeline_parallel_size > 1 else None
        env = build_env(offline=resolve_local_model(settings.model, data_dir) is not None,
                        hf_token=self.config.hf_token.get_secret_value() if self.config.hf_token else None,
                        devices=device, dev_endpoints=sleep, api_key=key)
        if cluster:  # vLLM's Ray executor joins the engine's cluster for the stages' workers
            env["RAY_ADDRESS"] = cluster
        if self.build == "cpu" and (self.instances or self.others_running()) and \
                "VLLM_CPU_OMP_THREADS_BIND" not in env:
            # the CPU build pins its worker to cores on its own ("auto"); a second instance pinned to the same
            # cores hung at start (vLLM 0.32, two cores): one started beside another is left to the OS scheduler,
            # with the thread count pinning would have given it (unpinned, vLLM runs one per core)
            env["VLLM_CPU_OMP_THREADS_BIND"] = "nobind"
            env.setdefault("OMP_NUM_THREADS", str(unbound_omp_threads(settings.tensor_parallel_size)))
        port = int(args[args.index("--port") + 1])
        child = self.placement.child(ChildSpec(
            args=args, env=env, port=port, revision_id=revision.id, log=self.log,
            pidfile=self.run_dir / self.deployment.pidfile_name(name), name=name, cwd=data_dir, api_key=key,
            node=node, gpus=settings.tensor_parallel_size if self.build == "cuda" and
            settings.pipeline_parallel_size == 1 else 0))  # in stages, vLLM's Ray executor places its workers
        inst = Instance(name, child, revision, settings, device=device, bridge=bridge,
                        launched_seqs=launch_max_num_seqs(settings), lowered=lowered)
        child.on_exit = lambda _: self._spawn_task(self._instance_exited(inst), f"exited-{name}")
        inst.predicted = await asyncio.to_thread(self.planner.predict_now, settings) if self.planner else None
        inst.compile_key = compile_key(settings.model_dump(), env)
        inst.eta = await asyncio.to_thread(self.eta_for, settings.model_dump(), self._company(device, bridge), env)
        self.instances.append(inst)
        self.starts += 1
        what = "a bridge of revision" if bridge else "revision"
        await self._event("starting", f"starting vLLM instance {name} with {what} {revision.id} ({inst.eta.kind} start)"
                          + (f" on node {node[:12]}" if node else "") + (f" on GPU {device}" if device else "")
                          + (f"; expected ready in {inst.eta.describe()}" if inst.eta else ""),
                          revision_id=revision.id,
                          data={"args": args[1:], "predicted": inst.predicted, "instance": name, "bridge": bridge,
                                "device": device, "node": node, "eta_s": inst.eta.total_s, "kind": inst.eta.kind,
                                "load_1m": inst.eta.load_1m})
        await child.spawn()
        return inst

    def _company(self, device: str | None, bridge: bool) -> Company:
        """What a new instance starts beside: a bridge; an instance that serves requests on its device (the CPU
        build: on the host, another deployment's too: they share its cores; a GPU: the GPU and the host's cores
        its server needs), which slows a start by what it takes; else alone (an idle instance takes nothing)."""
        if bridge:
            return "bridge"
        if self.build == "cpu" and self.others_running() > 0:
            return "beside"
        if self.recent_in_flight() == 0:
            return "alone"
        live = [i for i in self.instances if i.serving or i.role == "draining"]

        def gpus(d: str | None) -> set[str] | None:
            return None if d is None else set(d.split(","))

        mine = gpus(device)
        shared = [i for i in live if self.build == "cpu" or mine is None or gpus(i.device) is None
                  or mine & (gpus(i.device) or set())]
        return "beside" if shared else "alone"

    def _timed(self, action: StepAction, instance: str, seconds: float, in_flight: int,
               start_kind: Any = None) -> None:
        """A step of the apply under way as it ran (its time, beside what the plan expected of such a step)."""
        if self.apply is None or self.apply.outcome != "running":
            return
        # the plan's n-th step of this action for the n-th one taken: a start's kind is worked out again at its
        # launch, and a start that ended meanwhile may change it (a repeat that missed vLLM's compile cache)
        planned = [s for s in self.apply.plan.step_etas if s.action == action]
        taken = sum(1 for t in self.apply.timings if t.action == action)
        expected = planned[taken].eta_s if taken < len(planned) else None
        self.apply.timings.append(StepTiming(action=action, instance=instance, seconds=round(seconds, 2),
                                             start_kind=start_kind, in_flight=in_flight, eta_s=expected))

    async def _await_ready(self, inst: Instance, *, abort_on_new_desired: bool = True) -> StartOutcome:
        in_flight = self.admission.in_flight
        outcome = await self._wait_ready(inst, abort_on_new_desired)
        tracker = inst.child.tracker
        if outcome.ready:
            tracker.ready()
            self._timed("start", inst.name, tracker.ready_s or outcome.seconds, in_flight,
                        inst.eta.kind if inst.eta else None)
        else:
            tracker.fail(outcome.reason)
        self.last_start = {"revision": inst.revision.id, **tracker.view(inst.eta)}
        return outcome

    async def _promote(self, inst: Instance, *, woken: bool = False) -> Upstream:
        """A ready instance takes traffic; the ready event records its start (phases, ETA error, calibration).
        A ``woken`` instance (back from sleep mode) takes traffic again; its start was recorded when it began."""
        assert inst.revision.id is not None
        inst.child.remember_descendants()
        if inst.lowered and inst.child.pid is not None:  # it serves now: the priority of any instance that serves
            inst.lowered = False
            if problem := renice_group(inst.child.pid, self.config.vllm_nice):
                await self._event("nice_refused", f"vLLM instance {inst.name} serves at nice "
                                  f"{self.config.start_beside_nice}, as it started: {problem}. Give the engine "
                                  "CAP_SYS_NICE, or set start_beside_nice to vllm_nice", "warning",
                                  inst.revision.id)
        inst.role = "bridge" if inst.bridge else "serving"
        inst.ready_at = time.time()
        inst.since = time.time()
        inst.last_health = time.monotonic()
        self.recovery.ready()
        if not inst.bridge:
            await self._write(f"revision {inst.revision.id} as applied", self.revisions.mark_applied,
                              inst.revision.id)
        upstream = await self.admission.open(inst.child.url, inst.revision.id, instance=inst.name,
                                             api_key=inst.child.api_key, limit=gateway_limit(inst))
        self._gap_closed()
        seconds = inst.child.tracker.ready_s or 0.0
        if woken:
            if self.sm.state != S.READY and self.sm.can(S.READY):
                await self._enter(S.READY, f"revision {inst.revision.id} serves again after wake-up")
            return upstream
        startup: dict[str, Any] = {"phases": inst.child.tracker.durations(),
                                   "compile_key": inst.compile_key or compile_key(inst.settings.model_dump()),
                                   "model": inst.settings.model, "compile_cache": inst.child.tracker.compile_cache}
        if inst.eta is not None:  # the kind it was started as, and the host's load then
            startup.update(kind=inst.eta.kind, load_1m=inst.eta.load_1m, cores=inst.eta.cores)
        eta_text = ""
        if inst.eta is not None:
            error = seconds - inst.eta.total_s
            startup.update(eta_s=inst.eta.total_s, eta_basis=inst.eta.basis, error_s=round(error, 1),
                           error_pct=round(100 * error / inst.eta.total_s, 1) if inst.eta.total_s else None)
            eta_text = f" (expected {inst.eta.total_s:.0f} s, {error:+.0f} s)"
        self.last_start = {"revision": inst.revision.id, **inst.child.tracker.view(inst.eta),
                           **{k: startup.get(k) for k in ("error_s", "error_pct")}}
        measured = await asyncio.to_thread(self._measure_start, inst)  # calibration writes SQLite
        if self.sm.state != S.READY:
            if self.sm.can(S.READY):
                await self._enter(S.READY, f"revision {inst.revision.id} ready after {seconds:.1f} s")
        else:
            self.sm.reason = f"revision {inst.revision.id} serving"
        what = "bridge of revision" if inst.bridge else "revision"
        await self._event("ready", f"vLLM instance {inst.name} ready with {what} {inst.revision.id} after "
                          f"{seconds:.1f} s{eta_text}", revision_id=inst.revision.id,
                          data={"startup_s": round(seconds, 2), "pid": inst.child.pid, "instance": inst.name,
                                "bridge": inst.bridge, "startup": startup, **measured})
        return upstream

    async def _handover(self, new: Instance, upstream: Upstream) -> None:
        """The instances ``new`` replaces keep serving beside it (each request to whichever has fewer in flight)
        until it has ended its first requests, as many as it runs at once (at most 8), or handover_s: a cold
        instance's first batch is its slowest, and clients must not wait on it alone meanwhile."""
        if self.config.handover_s <= 0 or self.admission.in_flight == 0:  # no traffic: nobody to hand over
            return
        self._step(f"instance {new.name} takes its first requests beside the one it replaces")
        t0, in_flight = time.monotonic(), self.admission.in_flight
        await self.admission.finished(upstream, min(8, max(1, new.settings.max_num_seqs)), self.config.handover_s)
        self._timed("handover", new.name, time.monotonic() - t0, in_flight)

    def _forget(self, inst: Instance) -> None:
        with contextlib.suppress(ValueError):
            self.instances.remove(inst)

    async def _stop(self, inst: Instance, reason: str) -> None:
        """Stop an instance that no longer takes traffic (its requests drained or given up). While others serve,
        its shutdown runs at the lowest CPU priority: it must not slow them."""
        was = inst.role
        inst.role = "stopping"
        old_pids: set[int] = set()
        local = inst.child.local
        if local and inst.child.pid is not None and any(i.serving for i in self.instances if i is not inst):
            renice_group(inst.child.pid, 19)  # raising a nice value is always allowed
        if local and inst.child.pid is not None:
            old_pids = {inst.child.pid}
            with contextlib.suppress(psutil.Error):
                old_pids.update(p.pid for p in psutil.Process(inst.child.pid).children(recursive=True))
        seconds = await inst.child.stop(self.config.stop_timeout_s)
        if was in ("serving", "bridge", "draining"):  # a step of an apply (not a start given up)
            self._timed("stop", inst.name, seconds, self.admission.in_flight)
        released = True
        if self.planner is not None:
            released = await asyncio.to_thread(self.planner.wait_released, old_pids, 30.0)
        self._forget(inst)
        await self._event("stopped", f"vLLM instance {inst.name} stopped in {seconds:.1f} s: {reason}"
                          + ("" if released else "; its GPU memory was still held after 30 s"),
                          "info" if released else "warning", inst.revision.id,
                          data={"stop_s": round(seconds, 2), "exit_code": inst.child.returncode,
                                "instance": inst.name})

    async def _close(self, inst: Instance) -> list[Upstream]:
        """No new requests to ``inst``; the upstreams closed (their requests may still be in flight)."""
        closed = await self.admission.close(inst.name)
        if not self.admission.upstreams and self._gap_since is None:
            self._gap_since = time.monotonic()
        return closed

    def _gap_closed(self) -> None:
        if self._gap_since is not None:
            gap = time.monotonic() - self._gap_since
            self._gap_since = None
            if self.apply is not None and self.apply.outcome == "running":
                self.apply.longest_gap_s = round(max(self.apply.longest_gap_s or 0.0, gap), 2)

    async def _drain(self, inst: Instance, reason: str) -> None:
        """No new requests to ``inst``; wait for those it has (streams included), up to drain_timeout_s."""
        closed = await self._close(inst)
        inst.role = "draining"
        t0, in_flight = time.monotonic(), sum(u.outstanding for u in closed)
        left = await self.admission.drain(self.config.drain_timeout_s, closed) if closed else 0
        self._timed("drain", inst.name, time.monotonic() - t0, in_flight)
        await self._event("drained", f"instance {inst.name}: {left} requests still in flight after "
                          f"{self.config.drain_timeout_s:.0f} s ({reason})" if left else
                          f"drained instance {inst.name}: {reason}", "warning" if left else "info",
                          inst.revision.id, data={"instance": inst.name, "left": left})

    async def _retire(self, inst: Instance, reason: str) -> None:
        await self._drain(inst, reason)
        await self._stop(inst, reason)

    async def _pause_out(self, reason: str) -> None:
        """Take every instance out: drain all (requests that arrive meanwhile wait in the queue), stop all."""
        for inst in [i for i in self.instances if i.serving]:
            await self._close(inst)
        if self.sm.state == S.READY:
            await self._enter(S.DRAINING, reason)
            left = await self.admission.drain(self.config.drain_timeout_s)
            message = (f"draining for: {reason}; {left} requests still in flight after "
                       f"{self.config.drain_timeout_s:.0f} s" if left else f"drained in-flight requests: {reason}")
            await self._event("drained", message, "warning" if left else "info",
                              self.running.id if self.running else None)
        if self.sm.can(S.STOPPING):
            await self._enter(S.STOPPING, reason)
        for inst in list(self.instances):
            await self._stop(inst, reason)
        if self.sm.state == S.STOPPING:
            await self._enter(S.STOPPED, reason)

    # --- a start from nothing ----------------------------------------------------------------------------------

    async def _start_fresh(self, revision: Revision) -> None:
        """Nothing serves: start the revision (its first replica; the others join once it serves)."""
        assert revision.id is not None
        if not await self._ready_to_start(revision):
            return
        self.restart_requested = False
        settings = EngineSettings.model_construct(**revision.values)
        if self.sm.state != S.STARTING:
            if self.sm.state == S.READY:
                await self._enter(S.DRAINING, "nothing serves")
            if self.sm.can(S.STOPPING) and self.sm.state != S.FAILED:
                await self._enter(S.STOPPING, "nothing serves")
            if self.sm.state == S.STOPPING:
                await self._enter(S.STOPPED, "nothing serves")
            await self._enter(S.STARTING, f"starting revision {revision.id}")
        inst = await self._launch(revision, settings, name=self._free_name(), device=self._device_for(0, settings))
        outcome = await self._await_ready(inst)
        if outcome.aborted:
            await self._stop(inst, outcome.reason)
            return
        if not outcome.ready:
            await self._start_failed(inst, outcome)
            return
        await self._promote(inst)

    async def _add_replica(self, revision: Revision, index: int) -> None:
        """One more replica beside those that serve (a revision that asks for more, or one lost with its node),
        where the placement puts it, once its memory is free there."""
        settings = EngineSettings.model_construct(**revision.values)
        node = await asyncio.to_thread(self._node_for, index, settings)
        short = await asyncio.to_thread(self.room, node, settings)
        if short is not None:
            self._next_attempt = time.monotonic() + 10.0
            if self._waiting_room != short:
                self._waiting_room = short
                await self._event("replica_waiting", f"replica {index + 1} of revision {revision.id} waits for "
                                  f"memory: {short}; it starts when there is room (looked at every 10 s)",
                                  "warning", revision.id, data={"node": node, "why": short})
            return
        self._waiting_room = None
        inst = await self._launch(revision, settings, name=self._free_name(), device=self._device_for(index, settings),
                                  node=node, index=index)
        outcome = await self._await_ready(inst)
        if outcome.ready:
            await self._promote(inst)
            return
        await self._stop(inst, outcome.reason)
        if not outcome.aborted:
            self._next_attempt = time.monotonic() + self.config.backoff_max_s
            await self._event("replica_failed", f"replica {index + 1} of revision {revision.id} did not start: "
                              f"{outcome.reason}; the others serve, next try in {self.config.backoff_max_s:.0f} s",
                              "error", revision.id, data={"last_lines": list(inst.child.lines)[-30:]})

    # --- applies -----------------------------------------------------------------------------------------------

    async def _apply(self, desired: Revision) -> None:
        """Replace what serves by instances of ``desired``, by the plan that keeps serving."""
        assert desired.id is not None
        if not await self._ready_to_start(desired):
            return
        settings = EngineSettings.model_construct(**desired.values)
        restart = self.restart_requested
        self.restart_requested = False
        plan = await asyncio.to_thread(self.plan_for, settings, restart)
        if plan is None:
            plan = ApplyPlanOut(kind="pause", reason="no planner", steps=[])
        old = self.primary
        self.apply = ApplyProgress(revision=desired.id, from_revision=old.revision.id if old else None, plan=plan,
                                   step="starting", started=datetime.now(UTC))
        what = "restart" if restart else f"apply of revision {desired.id}"
        await self._event("apply_plan", f"{what}: {plan.kind.replace('_', '/')} — {plan.reason}",
                          revision_id=desired.id, data={"plan": plan.model_dump(), "restart": restart})
        try:
            if plan.kind == "blue_green" or plan.kind == "start":
                await applies.blue_green(self, desired, settings)
            elif plan.kind == "bridge":
                await applies.bridge(self, desired, settings, plan)
            elif plan.kind == "rolling":
                await applies.rolling(self, desired, settings)
            else:
                await applies.pause(self, desired, settings)
        finally:
            if self.apply is not None and self.apply.outcome == "running":
                self.apply.outcome = "aborted"
            if self.apply is not None:
                self.apply.finished = datetime.now(UTC)
                self.apply.step = "done"
                if self.sm.state == S.READY:  # the last step ("draining instance b") is over: say what serves now
                    self.sm.reason = f"{self._serving_text()} ({what}: {self.apply.outcome})"
                await self._event("apply_done", f"{what}: {self.apply.outcome}; longest stretch with nothing "
                                  f"serving {self.apply.longest_gap_s or 0:.1f} s", revision_id=desired.id,
                                  data=self.apply.model_dump(mode="json"))

    def _serving_text(self) -> str:
        serving = [i for i in self.instances if i.serving]
        if not serving:
            return "nothing serves"
        revisions = sorted({i.revision.id or 0 for i in serving if not i.bridge}) or \
            sorted({i.revision.id or 0 for i in serving})
        return (f"revision {', '.join(map(str, revisions))} serving on instance"
                f"{'s' if len(serving) > 1 else ''} {', '.join(i.name for i in serving)}")

    def _step(self, text: str) -> None:
        if self.apply is not None:
            self.apply.step = text
        self.sm.reason = text

    def _done(self, outcome: Literal["applied", "rejected", "aborted"]) -> None:
        if self.apply is not None and self.apply.outcome == "running":
            self.apply.outcome = outcome

    # --- failures ----------------------------------------------------------------------------------------------

    async def _new_failed(self, new: Instance, outcome: StartOutcome) -> None:
        """A new instance did not become ready while another serves: stop it; unless the start was aborted (a
        newer revision, a stop), reject its revision with a diagnosis. Traffic never left what served."""
        await self._stop(new, outcome.reason)
        if not outcome.aborted:
            await self._reject(new, outcome)

    async def _reject(self, new: Instance, outcome: StartOutcome) -> None:
        rev_id = new.revision.id
        diagnosis = self.recovery.decide(rev_id, "pending", False, list(new.child.lines)).diagnosis
        await self._event("failed", f"start of revision {rev_id} failed: {outcome.reason}", "error", rev_id,
                          data={"exit_code": outcome.exit_code, "was_ready": False, "instance": new.name,
                                "last_lines": list(new.child.lines)[-30:]})
        await self._event("diagnosis", f"{diagnosis.kind}: {diagnosis.explanation} Fix: {diagnosis.fix}", "error",
                          rev_id, data=diagnosis.as_dict())
        assert rev_id is not None
        await self._write(f"revision {rev_id} as rejected", self.revisions.mark_rejected, rev_id,
                          f"{diagnosis.kind}: {diagnosis.explanation}")
        back = self.primary.revision.id if self.primary else None
        gap = (self.apply.longest_gap_s or 0.0) if self.apply is not None else 0.0
        stayed = (f"traffic stayed on revision {back}" if gap == 0 else
                  f"revision {back} serves again after {gap:.1f} s with nothing serving")
        message = (f"revision {rev_id} never became ready ({diagnosis.kind}): rejected; {stayed}" if back else
                   f"revision {rev_id} never became ready: rejected")
        await self._event("rollback", message, "error", rev_id,
                          data={"rejected": rev_id, "back_to": back, "diagnosis": diagnosis.kind, "gap_s": gap})
        self._done("rejected")
        if self.audit is not None:
            await self._write("the automatic rollback", functools.partial(
                self.audit.record, actor="engine", action="settings.auto_rollback", target=f"revision {rev_id}",
                deployment=self.deployment.name,
                before={"revision": rev_id}, after={"revision": back}, detail=message))

    async def _start_failed(self, inst: Instance, outcome: StartOutcome) -> None:
        """Nothing serves and the instance that was to serve did not start: diagnose, then roll back, retry or halt
        (as for a crash)."""
        await self._fail(inst, f"start of revision {inst.revision.id} failed: {outcome.reason}", outcome.exit_code,
                         was_ready=False)

    async def _crashed(self, inst: Instance, reason: str, exit_code: int | None) -> None:
        was_serving = inst.serving or inst.role == "failed"
        if inst.role == "starting":  # its _await_ready sees the exit and handles it
            return
        await self._close(inst)
        if any(i.serving for i in self.instances if i is not inst):
            await inst.child.stop(self.config.stop_timeout_s)
            self._forget(inst)
            decision = self.recovery.decide(inst.revision.id, "applied", was_serving, list(inst.child.lines))
            self._next_attempt = time.monotonic() + decision.delay_s
            await self._event("instance_failed", f"{reason}; the other instances serve", "error", inst.revision.id,
                              data={"instance": inst.name, "diagnosis": decision.diagnosis.as_dict(),
                                    "last_lines": list(inst.child.lines)[-30:]})
            return
        await self._fail(inst, reason, exit_code, was_ready=inst.ready_at is not None)

    async def _fail(self, inst: Instance, reason: str, exit_code: int | None, *, was_ready: bool) -> None:
        """vLLM stopped without being asked and nothing else serves: stop what is left, diagnose, then roll back,
        retry or halt."""
        await self.admission.close()
        # failed from now: what is left of its process group (an engine core, workers) may take stop_timeout_s
        # to go, and its log is only complete for diagnosis once it has
        if self.sm.can(S.FAILED):
            await self._enter(S.FAILED, f"{reason}; stopping what is left of it")
        else:
            self.sm.reason = f"{reason}; stopping what is left of it"
        for other in list(self.instances):
            await other.child.stop(self.config.stop_timeout_s)
            self._forget(other)
        rev_id = inst.revision.id
        status = (await asyncio.to_thread(self.revisions.get_revision, rev_id)).status if rev_id else None
        decision = self.recovery.decide(rev_id, status, was_ready, list(inst.child.lines))
        diag = decision.diagnosis
        self.sm.reason = f"{reason}: {diag.kind}"
        await self._event("failed", reason, "error", rev_id, data={"exit_code": exit_code, "was_ready": was_ready,
                                                                  "last_lines": list(inst.child.lines)[-30:]})
        await self._event("diagnosis", f"{diag.kind}: {diag.explanation} Fix: {diag.fix}", "error", rev_id,
                          data=diag.as_dict())
        if decision.action == "rollback":
            self._done("rejected")
        await self._act(decision, rev_id)

    async def _act(self, decision: Decision, rev_id: int | None) -> None:
        diag = decision.diagnosis
        if decision.action == "rollback" and rev_id is not None:
            await self._write(f"revision {rev_id} as rejected", self.revisions.mark_rejected, rev_id,
                              f"{diag.kind}: {diag.explanation}")
            back = await asyncio.to_thread(self.revisions.desired_revision_id)
            self._next_attempt = 0.0
            await self._event("rollback", decision.message + (f" (revision {back})" if back else
                                                              "; no revision was ever ready: write new settings"),
                              "error", rev_id, data={"rejected": rev_id, "back_to": back, "diagnosis": diag.kind})
            if self.audit is not None:
                await self._write("the automatic rollback", functools.partial(
                    self.audit.record, actor="engine", action="settings.auto_rollback", target=f"revision {rev_id}",
                    deployment=self.deployment.name,
                    before={"revision": rev_id}, after={"revision": back}, detail=decision.message))
        elif decision.action == "halt":
            self.halted = decision.message
            await self.admission.refuse(f"vLLM is halted: {decision.message}")
            self.sm.reason = decision.message
            await self._event("crash_loop", decision.message, "critical", rev_id, data={"diagnosis": diag.kind})
            if self.audit is not None:
                await self._write("the halt", functools.partial(
                    self.audit.record, actor="engine", action="engine.halt", target=f"revision {rev_id}",
                    deployment=self.deployment.name,
                    detail=decision.message))
        else:
            self._next_attempt = time.monotonic() + decision.delay_s
            await self._event("restart_scheduled", decision.message, "warning", rev_id,
                              data={"delay_s": decision.delay_s, "diagnosis": diag.kind})

    # --- readiness and health ----------------------------------------------------------------------------------

    async def _wait_ready(self, inst: Instance, abort_on_new_desired: bool) -> StartOutcome:
        """Ready = /health answers 200 and a real 1-token completion succeeds (/health alone can lie)."""
        child = inst.child
        t0 = time.monotonic()
        deadline = t0 + self.config.startup_timeout_s
        last_desired_check = 0.0
        wanted = inst.revision.id
        async with httpx.AsyncClient(base_url=child.url, timeout=10.0, headers=child.headers) as client:
            while True:
                now = time.monotonic()
                if child.exited:
                    lost = getattr(child, "lost", None)  # a remote instance gone without an exit code says why
                    return StartOutcome(False, f"vLLM exited{_code(child.returncode)} during start-up"
                                        + (f" ({lost})" if lost else ""), now - t0, child.returncode)
                if not self.enabled:
                    return StartOutcome(False, "stop requested during start-up", now - t0, aborted=True)
                if abort_on_new_desired and now - last_desired_check >= 1.0:
                    last_desired_check = now
                    desired = await asyncio.to_thread(self.revisions.desired_revision_id)
                    if desired != wanted and not inst.bridge:
                        return StartOutcome(False, f"revision {desired} was written during start-up", now - t0,
                                            aborted=True)
                if now >= deadline:
                    return StartOutcome(False, f"not ready within {self.config.startup_timeout_s:.0f} s", now - t0)
                await self._close_dead()
                if await probe(client, inst.settings.served_model_name):
                    return StartOutcome(True, "ready", time.monotonic() - t0)
                await asyncio.sleep(0.5)

    async def _close_dead(self) -> None:
        """While an instance starts, one that serves may die: no request may be sent to it meanwhile (the loop
        handles it once the start is over)."""
        for other in [i for i in self.instances if i.serving]:
            if other.child.exited and not other.child.stop_requested:
                await self._close(other)
                other.role = "failed"

    async def _check_health(self) -> None:
        now = time.monotonic()
        for inst in [i for i in self.instances if i.serving]:
            if now - inst.last_health < self.config.health_interval_s:
                continue
            inst.last_health = now
            try:
                async with httpx.AsyncClient(timeout=5.0) as client:
                    ok = (await client.get(f"{inst.child.url}/health")).status_code == 200
            except httpx.HTTPError:
                ok = False
            inst.health_failures = 0 if ok else inst.health_failures + 1
            if inst.health_failures >= 3:
                await self._crashed(inst, f"vLLM instance {inst.name} stopped answering /health (3 probes in a row)",
                                    None)

    # --- checks before a start ---------------------------------------------------------------------------------

    def _measure_start(self, inst: Instance) -> dict[str, Any]:
        """What vLLM logged about memory at this start; calibrates the capacity model on GPUs."""
        report = parse_start(list(inst.child.lines))
        out: dict[str, Any] = {"kv_tokens": report.kv_tokens, "kv_gib": report.kv_gib,
                               "weights_gib": report.weights_gib, "activation_gib": report.activation_gib,
                               "non_torch_gib": report.non_torch_gib}
        if self.planner is not None:
            out["capacity"] = self.planner.compare(inst.settings, report, inst.predicted)
            if self.build == "cuda":
                try:
                    self.planner.calibrate(report, inst.settings, logged_batched_tokens(inst.child.lines),
                                           inst.revision.id)
                except SQLAlchemyError as exc:  # next start calibrates again
                    self.unrecorded += 1
                    log.error("supervisor: could not record the calibration of revision %s: %s", inst.revision.id,
                              exc)
        return out

    async def _valid(self, revision: Revision, data_dir: Path) -> bool:
        """A revision written past the API (straight into SQLite) is checked as the API checks one before vLLM
        is given it: a model outside the roots, a flag not allowed, a name vLLM would misread. An invalid one is
        rejected, and the last good revision serves."""
        assert revision.id is not None
        try:
            await asyncio.to_thread(validate_settings, dict(revision.values), data_dir, self.config.model_roots)
        except InvalidSettingsError as exc:
            reasons = exc.describe()
            await self._write(f"revision {revision.id} as rejected", self.revisions.mark_rejected, revision.id,
                              f"invalid: {reasons}")
            await self._event("rejected", f"revision {revision.id} was not started: {reasons}", "error",
                              revision.id, data={"errors": exc.errors})
            self.wake()
            return False
        return True

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
        if not any(i.serving for i in self.instances):
            if self.sm.can(S.FAILED):
                await self._enter(S.FAILED, message)
            else:
                self.sm.reason = message
        self._next_attempt = time.monotonic() + 5.0
        return False

    async def _build_demo_model(self) -> bool:
        """Train the demo model into the data dir (about two minutes on two cores), its progress as the reason."""
        await self._enter(S.STARTING, "building the demo model: the first run of this data dir (about 2 minutes)")
        await self._event("demo_model_building", "building the demo model for the first run of this data dir")
        args = at_nice([self.config.vllm_python, "-m", "engine.cli", "demo-model", "--data-dir",
                        str(self.config.data_dir)], self.config.vllm_nice)
        proc = await asyncio.create_subprocess_exec(*args, stdin=asyncio.subprocess.DEVNULL,
                                                    stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT,
                                                    start_new_session=True, cwd=str(Path(__file__).parents[2]))
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

    # --- bookkeeping -------------------------------------------------------------------------------------------

    async def _enter(self, state: EngineState, reason: str) -> None:
        if self.sm.state == state:
            self.sm.reason = reason
            return
        self.sm.to(state, reason)
        log.info("engine %s: %s", state, reason)

    async def _event(self, kind: str, message: str, severity: str = "info", revision_id: int | None = None,
                     data: dict[str, Any] | None = None) -> None:
        """Record an event. A database that cannot take it (a full disk, a lock held too long) loses the event,
        loudly in the engine's log, and nothing else: vLLM keeps serving and the loop goes on."""
        try:
            await self.events.emit(kind, message, severity=severity, revision_id=revision_id, data=data)
        except SQLAlchemyError as exc:
            self.unrecorded += 1
            log.error("supervisor: could not record the event %s (%s): %s", kind, message, exc)

    async def _write(self, what: str, fn: Callable[..., Any], *args: Any) -> None:
        """A bookkeeping write of the loop (a revision marked applied, a calibration): like events, a failure is
        logged and counted, never a reason to stop a vLLM that serves."""
        try:
            await asyncio.to_thread(fn, *args)
        except SQLAlchemyError as exc:
            self.unrecorded += 1
            log.error("supervisor: could not record %s: %s", what, exc)
