"""The controller: keeps one deployment's vLLM instances serving its desired revision, a tick at a time.

Each tick reads the desired revision (or, when the store is down, keeps serving what serves), compares it with the
instances it has, and takes one next step. A step that has to wait (a start, a drain, a stop) leaves an operation
under way (engine/serving/operations.py, a plan of engine/serving/strategies/): the next tick resumes it where it
stopped, so no tick waits for more than one step, and a revision written through the API, the CLI or straight into
the database is applied the same way. Ticks come at least every reconcile_interval_s and at once when something
happens (an instance exits, a probe answers, an operation ends, the API asks).

The rooms: the registry of instances (instances.py), the launcher (the only room touching processes and the
gateway's admission), health (readiness and liveness verdicts), failures (diagnoses into decisions), checks before
a start, forecasts (ETAs and plans, read-only, safe from the API's threads), the status snapshot, and the recorder
(events, audit, revision marks). Everything time-dependent reads the injected clock.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import time
from collections.abc import AsyncIterator, Callable
from typing import Any, Literal

import psutil

from engine.access import AuditLog
from engine.aio import cancel_and_wait
from engine.capacity import Planner
from engine.clock import SYSTEM_CLOCK, Clock
from engine.config import AppConfig
from engine.db import UNAVAILABLE, Revision, unavailable_reason
from engine.errors import ServingError
from engine.events import EventLog
from engine.gateway import Admission
from engine.placement import LocalPlacement, Placement
from engine.revisions import DeploymentRef, EngineSettings, RevisionStore
from engine.schemas import ApplyPlanOut, ApplyProgress, AutoscaleOut, Build, EngineState, StatusOut
from engine.serving.autoscale import Autoscaler, Decision, Policy
from engine.serving.checks import Checks
from engine.serving.context import ServingContext
from engine.serving.eta import Company, Eta, PastStart
from engine.serving.failures import Failures
from engine.serving.forecast import Forecast, Traffic
from engine.serving.gate import Gate
from engine.serving.health import Health
from engine.serving.instances import Instance, Instances
from engine.serving.intent import Intent
from engine.serving.launcher import Launcher
from engine.serving.operations import Operations
from engine.serving.progress import Progress
from engine.serving.recorder import Recorder
from engine.serving.recovery import RecoveryPolicy
from engine.serving.residency import Room, Tenant
from engine.serving.state import StateMachine
from engine.serving.status import StatusView
from engine.serving.strategies import adopt, adoptable
from engine.vllm import ChildLog, Prober, reap_all, vllm_distribution

log = logging.getLogger("llmops.serving")
S = EngineState
ROOM_POLL_S = 0.25  # while it waits for room, it looks again this often (a neighbour becomes idle in 0.2 s)
DESIRED_EVERY_S = 1.0  # while an operation is under way, the desired revision is read again at most this often


class Controller:
    def __init__(self, config: AppConfig, revisions: RevisionStore, events: EventLog, admission: Admission,
                 planner: Planner | None = None, audit: AuditLog | None = None,
                 deployment: DeploymentRef | None = None, *, placement: Placement | None = None,
                 clock: Clock = SYSTEM_CLOCK, build: tuple[Build, str | None] | None = None) -> None:
        self.config = config
        self.deployment = deployment or DeploymentRef()
        self.revisions = revisions
        self.events = events
        self.admission = admission
        self.clock = clock
        self.build, self.vllm_version = build or vllm_distribution()
        self.planner = planner
        self.placement: Placement = placement or LocalPlacement()  # where instances run (the registry hands its own)
        # whether replica ``index`` of these settings fits on a node now (None: it does; else why not)
        self.room: Callable[[str | None, EngineSettings, int], str | None] = lambda _node, _settings, _index: None
        # the memory free on a node (None: no reading): a replica fewer is taken where it is scarcest
        self.free_on: Callable[[str | None], float | None] = lambda _node: None
        # instances of other deployments running on this host now (the CPU build then leaves this one unpinned)
        self.others_running: Callable[[], int] = lambda: 0
        # many models on one GPU: whether these settings may come back now beside the neighbours awake (the
        # registry puts the least recently used idle ones to sleep meanwhile); alone on its host, always
        # (with True: put them to sleep if need be; False: only look)
        self.make_room: Callable[[EngineSettings, bool], Room] = lambda _settings, _evict: Room(True)
        self._by_hand = False  # an operator's start or restart: it comes back, room made for it
        self._granted = False  # let in by the room and not serving yet: its memory counts as taken
        # its instances went to sleep (or stopped) and gave their memory back: neighbours waiting for room look now
        self.released: Callable[[], None] = lambda: None
        self._room_said: str | None = None  # the last 'waiting for room' recorded (said once)
        self.intent = Intent(enabled=config.autostart)
        self.scaler = Autoscaler()  # the replica count the load asks for (autoscaling, scale to zero)
        self._cold_start_s: float | None = None  # what a cold start from zero should take (its ETA)
        # the max_replicas a 'held' warning was said at and when the load last asked past it: said once per
        # episode, not every tick nor each time the count asked for moves; a new one after a stop or a halt, or
        # after scale_down_delay_s within max_replicas
        self._held_said: tuple[int, float] | None = None
        self._asleep_settings: EngineSettings | None = None  # what served last (asleep, its name still reaches it)
        self._last_desired: Revision | None = None  # the latest desired revision read (a wake while the store is down)
        self.instances = Instances()
        self.progress = Progress(clock)
        self.recorder = Recorder(events, revisions, audit, self.deployment)
        self.log = ChildLog(config.logs_dir / self.deployment.log_name, config.log_max_bytes, config.log_backups)
        self.run_dir = config.data_dir / "run"
        self.traffic = Traffic(admission, clock)
        self.forecast = Forecast(config, events, self.instances, self.traffic, self.build, lambda: self.planner,
                                 lambda: self.others_running())
        self.prober = Prober()  # the one HTTP client of this deployment's probes, sleeps and wake-ups
        self.gate = Gate(config, admission, self.instances, self.progress, self.recorder, clock, self.wake)
        self.launcher = Launcher(config, self.deployment, self.build, self.gate, self.instances, self.progress,
                                 self.recorder, self.forecast, clock, self.log, self.run_dir, lambda: self.placement,
                                 lambda: self.planner, lambda: self.others_running(), self.wake, self.prober)
        self.health = Health(config, clock, self.wake, self.prober)
        self.policy = RecoveryPolicy(config.backoff_initial_s, config.backoff_max_s, config.crashloop_max_failures,
                                     config.crashloop_window_s)
        self.failures = Failures(self.policy, revisions, self.instances, self.launcher, self.gate, self.progress,
                                 self.recorder, self.intent, clock)
        self.checks = Checks(config, self.instances, self.progress, self.recorder, self.intent, clock, self.log)
        self.ctx = ServingContext(config, self.build, self.instances, self.launcher, self.gate, self.health,
                                  self.failures,
                                  self.progress, self.recorder, self.intent, clock, self._desired)
        self.operations = Operations(self.ctx, self.forecast,
                                     lambda node, settings, index: self.room(node, settings, index))
        self.view = StatusView(self.deployment, self.progress, self.instances, admission, self.intent, revisions,
                               self.build, self.vllm_version, lambda: self.launcher.starts,
                               lambda: self.launcher.last_start, lambda: self._loop, self.autoscale_view)
        self._work: AsyncIterator[None] | None = None  # the operation under way
        self.work_name: str | None = None  # what it is, for the log and tests
        self._desired_seen: tuple[bool, int | None] = (False, None)  # (read, the desired revision's id)
        self._desired_read_at = float("-inf")
        self.database_down_since: float | None = None  # the desired revision could not be read since (monotonic)
        self._wake = asyncio.Event()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._task: asyncio.Task[None] | None = None
        self._pids: tuple[tuple[int, ...], float, set[int]] = ((), 0.0, set())
        admission.on_wait = self.wake  # a request that waits for a deployment scaled to zero wakes it

    # --- what the API, the registry and the gateway read --------------------------------------------------------

    @property
    def enabled(self) -> bool:
        return self.intent.enabled

    @enabled.setter
    def enabled(self, value: bool) -> None:
        self.intent.enabled = value

    @property
    def sm(self) -> StateMachine:
        return self.progress.sm

    @property
    def apply(self) -> ApplyProgress | None:
        return self.progress.apply

    @property
    def halted(self) -> str | None:
        return self.intent.halted

    @property
    def unrecorded(self) -> int:
        return self.recorder.unrecorded

    @property
    def primary(self) -> Instance | None:
        return self.instances.primary

    @property
    def running(self) -> Revision | None:
        """The revision that serves (or is starting, when nothing serves)."""
        p = self.primary
        return p.revision if p else None

    def served_model(self) -> str | None:
        p = self.primary
        return p.settings.served_model_name if p else None

    def served_names(self) -> set[str]:
        """The names the instances that serve now answer to (vLLM's --served-model-name); scaled to zero, the
        names they answered to (a request for one wakes them)."""
        listed = self.listed_settings()
        return {i.settings.served_model_name for i in self.instances.serving()} | \
            ({listed.served_model_name} if listed is not None else set())

    def listed_settings(self) -> EngineSettings | None:
        """The settings /v1/models shows: those of an instance that serves; scaled to zero (and while it comes
        back), those it served with: a request for its name wakes it. None while stopped, halted or down."""
        serving = self.instances.serving()
        if serving:
            return serving[0].settings
        zero = self.scaler.policy is not None and self.scaler.policy.zero_after_s is not None
        if not self.intent.enabled or self.intent.halted is not None or not (self.scaler.asleep or zero):
            return None
        return self._asleep_settings

    def status(self) -> StatusOut:
        """What the API shows of the deployment (reads the desired revision: call from a thread)."""
        return self.view.status()

    def plan_for(self, settings: EngineSettings, restart: bool = False) -> ApplyPlanOut | None:
        return self.forecast.plan_for(settings, restart)

    def eta_for(self, values: dict[str, Any], company: Company = "alone", env: dict[str, str] | None = None) -> Eta:
        return self.forecast.eta_for(values, company, env)

    def past_starts(self, limit: int = 100) -> list[PastStart]:
        return self.forecast.past_starts(limit)

    def vllm_pids(self) -> set[int]:
        """Pids of every vLLM instance of this deployment and their descendants (called from the sampler thread;
        cached 5 s)."""
        roots = tuple(sorted(i.child.pid for i in self.instances if i.child.pid is not None and i.child.local))
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

    def pending(self) -> list[asyncio.Task[Any]]:
        """The tasks serving has under way (probes, operations, watchers): a test waits for them."""
        return self.launcher.pending() + self.gate.pending() + self.health.pending()

    # --- operators' commands (from the API's threads) ---------------------------------------------------------

    def request_start(self) -> None:
        self.scaler.reset()  # started by hand: it runs now, asleep or not
        self._by_hand = True
        self.intent.enabled = True
        self.intent.stop_reason = None
        self.intent.halted = None
        self.policy.reset()
        self.intent.next_attempt = 0.0
        self.wake()

    def request_stop(self, reason: str | None = None) -> None:
        """Stop serving; requests get 503 with ``reason`` (default: stopped by an operator) until it starts."""
        self.intent.enabled = False
        self.intent.stop_reason = reason or self._operator_stop()
        self.wake()

    def request_restart(self) -> None:
        self.scaler.reset()
        self._by_hand = True
        self.intent.enabled = True
        self.intent.halted = None
        self.intent.restart_requested = True
        self.intent.next_attempt = 0.0
        self.wake()

    def _operator_stop(self) -> str:
        where = "/api/engine/start" if self.deployment.default else \
            f"/api/deployments/{self.deployment.name}/engine/start"
        return f"vLLM is stopped by an operator; start it with POST {where}"

    def wake(self) -> None:
        """Tick now. Callable from any thread (sync API handlers run in a thread pool)."""
        if self._loop is not None and self._loop.is_running():
            self._loop.call_soon_threadsafe(self._wake.set)
        else:
            self._wake.set()

    # --- lifecycle --------------------------------------------------------------------------------------------

    async def start(self, reap: bool = True) -> None:
        """Begin (from the event loop): stop what a dead engine left (unless the registry did, once for every
        deployment), then tick."""
        if reap:
            stray = await asyncio.to_thread(reap_all, self.run_dir)
            if stray:
                await self.recorder.event("stray_killed", f"stopped vLLM processes {stray} left by an engine that "
                                          "died", "warning")
        self._loop = asyncio.get_running_loop()
        self._task = asyncio.create_task(self._run(), name=f"serving-{self.deployment.name}")

    def attach(self) -> None:
        """Tick by hand (tests): the loop the status reads on is this one."""
        self._loop = asyncio.get_running_loop()

    async def shutdown(self) -> None:
        await cancel_and_wait(self._task)
        await self._drop_work()
        await self.admission.close()
        self.gate.close_watchers()
        await self.launcher.close_down()
        await self.prober.close()
        self.progress.enter_if(S.STOPPING, "engine shutting down")
        self.log.close()

    async def _run(self) -> None:
        while True:
            try:
                await self.tick()
            except ServingError as exc:
                await self._survive(str(exc))
            except Exception as exc:  # a bug must not stop serving: logged, evented, retried
                log.exception("serving: unexpected error")
                await self._survive(f"internal error {type(exc).__name__}: {exc}")
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._wake.wait(), self.config.reconcile_interval_s)
            self._wake.clear()

    async def _survive(self, reason: str) -> None:
        """Record a failure of the loop itself; if even that fails (a full disk, a locked database), log it and
        go on: the loop must outlive its own errors."""
        try:
            await self._loop_failed(reason)
        except Exception:  # logged; serving continues at the next tick
            log.exception("serving: could not record the failure (%s)", reason)
            self.intent.next_attempt = self.clock.monotonic() + self.config.backoff_max_s

    async def _loop_failed(self, reason: str) -> None:
        await self._drop_work()
        await self.admission.close()
        for inst in self.instances:
            if not inst.child.exited:
                await inst.child.stop(self.config.stop_timeout_s)
            self.launcher.forget(inst)
        self.progress.enter_if(S.FAILED, reason)
        self.intent.next_attempt = self.clock.monotonic() + self.config.backoff_max_s
        await self.recorder.event("failed", f"{reason}; next attempt in {self.config.backoff_max_s:.0f} s", "error")

    async def _drop_work(self) -> None:
        work, self._work, self.work_name = self._work, None, None
        if work is not None:
            with contextlib.suppress(Exception):
                await work.aclose()  # type: ignore[attr-defined]

    # --- the tick ---------------------------------------------------------------------------------------------

    def _desired(self) -> tuple[bool, int | None]:
        return self._desired_seen

    async def tick(self) -> None:
        """One step: advance the operation under way, or look at what is desired and begin the next one."""
        self.traffic.recent()
        self.scaler.sample(self.clock.monotonic(), self.admission.in_flight, self.admission.waiting,
                           self.admission.admitted, self.admission.queue_wait(time.monotonic()))
        if self._work is None:
            await self._next()
            if self._work is None:
                return
        else:
            await self._read_desired()
        work = self._work
        try:
            await work.__anext__()
        except StopAsyncIteration:
            done, self._work, self.work_name = self.work_name, None, None
            self.wake()  # what comes next is looked at now
            if done in ("to_zero", "stop"):
                self.released()
        except BaseException:
            self._work, self.work_name = None, None
            raise

    def _begin(self, name: str, work: AsyncIterator[None]) -> None:
        self._work, self.work_name = work, name

    async def _read_desired(self) -> None:
        """While an operation is under way: the desired revision, at most every DESIRED_EVERY_S (a start of
        another is given up). A store that cannot be read changes nothing."""
        now = self.clock.monotonic()
        if now - self._desired_read_at < DESIRED_EVERY_S:
            return
        self._desired_read_at = now
        try:
            self._desired_seen = (True, await asyncio.to_thread(self.revisions.desired_revision_id))
        except UNAVAILABLE:
            self._desired_seen = (False, None)

    async def _next(self) -> None:
        """Between operations: failures first, then what operators asked, then the desired revision. A failure is
        looked for again after each wait (the store's thread, an event written): vLLM may exit meanwhile, and what
        then looks like "nothing serves" is a crash to recover from, not a scale from zero."""
        if self._failure_begun():
            return
        if self.intent.halted is not None:
            self._granted, self._room_said, self._held_said = False, None, None
            return
        if not self.intent.enabled:
            self._granted, self._room_said, self._held_said = False, None, None
            self.scaler.evicting = None
            await self.gate.refuse(self.intent.stop_reason or self._operator_stop())
            if self.instances:
                self._begin("stop", self.operations.stop_all("stop requested"))
            elif self.progress.state != S.STOPPED:  # (a start given up by the stop ends here: starting → stopped)
                if not self.progress.sm.can(S.STOPPED) and self.progress.sm.can(S.STOPPING):
                    self.progress.enter(S.STOPPING, "stop requested")
                if self.progress.sm.can(S.STOPPED):
                    self.progress.enter(S.STOPPED, "stop requested")
            return
        if self.admission.refusal is not None:
            await self.gate.refuse(None)
        desired = await self._desired_revision()
        if self._failure_begun():  # (before the store-down path too: it may start or wake an instance)
            return
        if desired is False:
            await self._store_down()
            return
        if desired is None:
            self._granted = False
            if self.instances:
                self._begin("stop", self.operations.stop_all("no revision can be applied"))
            elif self.progress.state != S.FAILED:
                self.progress.enter(S.FAILED, "no revision can be applied: write new settings")
            return
        assert isinstance(desired, Revision) and desired.id is not None
        self._last_desired = desired
        now = self.clock.monotonic()
        serving = self.instances.serving()
        decision = self.scaler.decide(Policy.of(EngineSettings.model_construct(**desired.values)), now,
                                      self.admission.waiting, len(serving))
        if decision is not None:
            await self._scaled(decision, desired)
        await self._say_held(desired)
        if self._failure_begun():
            return
        if serving:
            self._asleep_settings = serving[0].settings  # the name it answers to, asleep too
            self._granted = False
        if not serving:
            if self.scaler.asleep:
                self._granted = False
                sleeping = [i for i in self.instances if i.role == "sleeping" and not i.busy]
                if self.intent.restart_requested:  # asked while asleep: the next request starts it afresh
                    self.intent.restart_requested = False
                    if sleeping:
                        self._begin("stop", self.operations.stop_all("restart requested while scaled to zero: "
                                                                     "the next request starts it afresh"))
                return
            await self._from_zero(desired, decision.reason if decision else "a request arrived")
            return
        if self.scaler.asleep:
            self._begin("to_zero", self.operations.to_zero(self._zero_reason(decision)))
            return
        proper = [i for i in serving if not i.bridge and i.revision.id == desired.id]
        if len(proper) < len(serving) or self.intent.restart_requested:
            if not self.intent.restart_requested and adoptable(serving, desired.values):
                scaling = await adopt(self, desired, serving)  # only replicas or max_num_seqs: nothing restarts
                self.progress.say(self.instances.text() + scaling)
                return
            if await self._startable(desired):
                restart, self.intent.restart_requested = self.intent.restart_requested, False
                self._begin("apply", self.operations.apply(desired, restart))
            return
        want = self.scaler.want or 1
        if len(proper) < want and now >= self.intent.next_attempt:
            self._begin("replica", self.operations.add_replica(desired, len(proper)))
        elif len(proper) > want:
            self._begin("retire", self.operations.retire_replica(
                self._scarcest(proper), f"revision {desired.id} runs {want} replica(s)"))
        else:
            for inst in serving:
                if self.health.unhealthy(inst):
                    self._failed(inst, f"vLLM instance {inst.name} stopped answering /health (3 probes in a row)",
                                 None)
                    return

    def _scarcest(self, candidates: list[Instance]) -> Instance:
        """The replica to retire: the one on the node with the least memory free (on Ray, the node that most needs
        it back); among equals, the last launched."""
        free = {node: self.free_on(node) for node in {i.child.node for i in candidates}}

        def room(inst: Instance) -> float:
            value = free.get(inst.child.node)
            return value if value is not None else math.inf

        return min(reversed(candidates), key=room)

    async def _from_zero(self, desired: Revision, why: str) -> None:
        """Nothing serves: wake the instances asleep (as many as are wanted; the others stop), else start the
        revision afresh (after a failure's backoff) — once it fits beside the neighbours awake on its GPUs."""
        sleeping = [i for i in self.instances if i.role == "sleeping" and not i.busy]
        if not sleeping and self.clock.monotonic() < self.intent.next_attempt:
            return  # a failure's backoff: no room is taken (nor neighbours put to sleep) before it can start
        if self.scaler.evicting is not None or not await self._roomy(desired):
            return
        if sleeping:
            self._begin("wake", self.operations.wake(sleeping, max(1, self.scaler.want or 1),
                                                     f"waking revision {desired.id}: {why}"))
        elif self.clock.monotonic() >= self.intent.next_attempt and await self._startable(desired):
            self.intent.restart_requested = False
            self._begin("start", self.operations.start_fresh(desired))

    async def _store_down(self) -> None:
        """The desired revision cannot be read: what serves serves on. A request that waits for a deployment
        scaled to zero wakes what it ran (wanted again, so that it is not put back to sleep when the store is back;
        the event is not recorded); a neighbour that needs the memory still has this one put to sleep; one that
        waits for room keeps looking."""
        last, policy = self._last_desired, self.scaler.policy
        if last is None or policy is None:
            return
        now, serving = self.clock.monotonic(), self.instances.serving()
        if self.scaler.evicting is not None and serving:
            decision = self.scaler.decide(policy, now, self.admission.waiting, len(serving))
            if decision is not None and decision.action == "to_zero":
                self._begin("to_zero", self.operations.to_zero(self._zero_reason(decision)))
            return
        if self.scaler.asleep and self.admission.waiting:
            self.scaler.decide(policy, now, self.admission.waiting, 0)
            await self._from_zero(last, "a request arrived while the database cannot be read")
        elif not serving and self._room_said is not None and self.admission.waiting:
            await self._from_zero(last, "a request waits while the database cannot be read")

    async def _roomy(self, desired: Revision) -> bool:
        """Many models on one GPU: True when it fits beside the neighbours awake; else it waits (said once, and in
        the status) while the least recently used idle ones are put to sleep for it."""
        self._granted = False
        policy = self.scaler.policy
        pinned = policy is None or policy.zero_after_s is None
        demand = self.admission.waiting > 0 or self._by_hand or pinned
        room = self.make_room(EngineSettings.model_construct(**desired.values), demand)
        if not room.fits and not demand:  # nobody asks for it (the engine's start): asleep until a request does
            self._room_said = None
            self.scaler.evict(f"no room beside the deployments awake on its GPU, and no request for it yet "
                              f"({room.waiting})")
            self.wake()
            return False
        if room.fits:  # it holds its room from now (a neighbour asking meanwhile sees it), until it serves
            self._by_hand, self._granted = False, True
        waiting = None if room.fits else room.waiting
        if waiting is not None and self._loop is not None:  # a neighbour quiet for IDLE_GRACE_S is idle: look again
            self._loop.call_later(ROOM_POLL_S, self.wake)
        if waiting != self._room_said:
            self._room_said = waiting
            if waiting is not None:
                await self.recorder.event("room_waiting", f"not coming back yet: {waiting}",
                                          "info" if room.evict or waiting.startswith("waiting for") else "warning",
                                          revision_id=desired.id, data={"evict": list(room.evict)})
            if waiting is not None and self.progress.state == S.STOPPED:
                self.progress.say(f"wanted, not back yet: {waiting}")
        return room.fits

    def evict(self, reason: str) -> None:
        """A neighbour needs its memory: to zero at the next tick (drained first, then asleep or stopped)."""
        self.scaler.evict(reason)
        self.wake()

    def settings_claimed(self) -> EngineSettings | None:
        """The settings whose memory this deployment takes while awake: what serves, else what it served or is
        about to start (no store read)."""
        p = self.primary
        if p is not None:
            return p.settings
        if self._last_desired is not None:
            return EngineSettings.model_construct(**self._last_desired.values)
        return self._asleep_settings

    def tenant(self, claims: dict[str, float]) -> Tenant:
        """This deployment as the room sees it (engine/serving/residency.py), with what it claims awake."""
        holds = any(i.role != "sleeping" for i in self.instances)
        policy = self.scaler.policy
        granted = self._granted and self.intent.enabled and self.intent.halted is None
        return Tenant(self.deployment.name, claims, holds=holds or granted,
                      leaving=self.scaler.evicting is not None or (self.scaler.asleep and holds),
                      sleeps=policy is not None and policy.zero_after_s is not None,
                      idle=self.admission.in_flight == 0 and self.admission.waiting == 0 and self._work is None
                      and self.scaler.quiet(self.clock.monotonic(), self.admission.admitted),
                      last_active=self.scaler.last_active)

    async def _scaled(self, decision: Decision, desired: Revision) -> None:
        """Record an autoscaling decision: an event with its reason and the signal's value."""
        policy = Policy.of(EngineSettings.model_construct(**desired.values))
        if decision.action == "to_zero" and not self.ctx.sleep_mode:
            eta = await asyncio.to_thread(self.forecast.eta_for, desired.values)
            self._cold_start_s = round(eta.total_s, 1) if eta.total_s else None
        what = {"up": f"scale up {decision.before} → {decision.after}",
                "down": f"scale down {decision.before} → {decision.after} (drained first)",
                "to_zero": f"scale to zero ({decision.before} → 0)",
                "wake": f"wake from zero (0 → {decision.after})"}[decision.action]
        await self.recorder.event("autoscale", f"{what}: {decision.reason}", revision_id=desired.id, data={
            "action": decision.action, "from": decision.before, "to": decision.after, "load": decision.load,
            "target_in_flight": policy.target, "reason": decision.reason,
            "wake": ("sleep" if self.ctx.sleep_mode and self.instances.serving() else "cold_start")
            if decision.action == "to_zero" else None})

    async def _say_held(self, desired: Revision) -> None:
        """Say once why the count does not follow the load (at max_replicas): once while the load keeps asking
        past it, whatever count it asks for; again only at a new max_replicas, after a stop or a halt, or after the
        load stayed within it for scale_down_delay_s (so a load that hovers at the edge does not warn every few
        ticks)."""
        held, policy, now = self.scaler.held, self.scaler.policy, self.clock.monotonic()
        said = self._held_said
        if held is None or policy is None:
            if said is not None and policy is not None and now - said[1] >= policy.down_delay_s:
                self._held_said = None
            return
        self._held_said = (policy.ceiling, now)
        if said is None or said[0] != policy.ceiling:
            await self.recorder.event("autoscale_held", f"not scaling up: {held}", "warning",
                                      revision_id=desired.id, data={"load": round(self.scaler.load, 2)})

    def _wake_kind(self) -> Literal["sleep", "cold_start"]:
        """How it comes back from zero: asleep, the instances that sleep wake; none asleep (the CPU build, sleep
        mode off, or one that could not sleep and was stopped), a cold start."""
        if self.scaler.asleep:
            return "sleep" if any(i.role == "sleeping" for i in self.instances) else "cold_start"
        return "sleep" if self.ctx.sleep_mode else "cold_start"

    def _zero_reason(self, decision: Decision | None) -> str:
        why = decision.reason if decision is not None else "scaled to zero"
        comes_back = "the next request wakes it in about a second (sleep mode)" if self.ctx.sleep_mode else \
            "the next request starts it again (a cold start" + \
            (f", about {self._cold_start_s:.{0 if self._cold_start_s >= 10 else 1}f} s)" if self._cold_start_s else ")")
        return f"scaled to zero: {why}; {comes_back}"

    def autoscale_view(self) -> AutoscaleOut | None:
        """Where the replica count stands (None before the first revision was read)."""
        policy, want = self.scaler.policy, self.scaler.want
        if policy is None or want is None:
            return None
        now = self.clock.monotonic()
        active = self.scaler.last_active
        return AutoscaleOut(
            autoscaled=policy.autoscaled, min_replicas=policy.floor, max_replicas=policy.ceiling,
            target_in_flight=policy.target, target_queue_wait_s=policy.queue_target,
            queue_wait_s=round(self.scaler.queue_wait, 3), wanted=want, serving=len(self.instances.serving()),
            load=round(self.scaler.load, 2), asleep=self.scaler.asleep,
            idle_s=round(now - active, 1) if active is not None else None,
            scale_to_zero_after_s=policy.zero_after_s,
            wake=self._wake_kind() if policy.zero_after_s is not None or self.scaler.asleep else None,
            cold_start_s=self._cold_start_s, pending=self.scaler.cooling(now),
            held=self.scaler.held or self._room_said or (f"a replica waits for room: {self.operations.waiting_room}"
                                                         if self.operations.waiting_room else None))

    def _failure_begun(self) -> bool:
        """An instance exited without being asked to (and no operation of its own is under way): its failure is
        handled from now on."""
        for inst in self.instances:
            if inst.child.exited and not inst.child.stop_requested and not inst.gone and not inst.busy \
                    and inst.role != "starting":
                code = inst.child.returncode
                why = f" with code {code}" if code is not None else ""
                self._failed(inst, f"vLLM instance {inst.name} exited{why} while {inst.role} (not asked to)", code)
                return True
        return False

    def _failed(self, inst: Instance, reason: str, exit_code: int | None) -> None:
        """An instance failed (exited, or stopped answering): the others serve on, or nothing does."""
        if any(i.serving for i in self.instances if i is not inst):
            self._begin("failure", self.failures.beside(inst, reason))
        else:
            self._begin("recovery", self.failures.recover(inst, reason, exit_code, was_ready=inst.ready_at is not None))

    async def _desired_revision(self) -> Revision | bool | None:
        """The desired revision (None: none can be applied); False when the store cannot be read now: what serves
        goes on serving, and the next tick reads it again."""
        try:
            desired = await asyncio.to_thread(self.revisions.desired_revision)
        except UNAVAILABLE as exc:
            if self.database_down_since is None:
                self.database_down_since = self.clock.monotonic()
                log.warning("serving: the desired revision cannot be read (%s); vLLM keeps serving what it serves "
                            "until the database is back", unavailable_reason(exc))
            self._desired_seen = (False, None)
            return False
        if self.database_down_since is not None:
            log.info("serving: the database is back after %.0f s", self.clock.monotonic() - self.database_down_since)
            self.database_down_since = None
        self._desired_seen = (True, desired.id if desired is not None else None)
        self._desired_read_at = self.clock.monotonic()
        return desired

    async def _startable(self, revision: Revision) -> bool:
        """The checks before a start; the demo model, when missing, is built first (an operation of its own)."""
        verdict = await self.checks.verdict(revision)
        if verdict == "build":
            self._begin("demo-model", self.checks.build_demo_model())
        elif verdict == "invalid":
            self.wake()  # the last good revision is desired now
        return verdict == "ok"

    # --- what a soft change needs (engine/serving/strategies/soft.py SoftContext) ------------------------------

    async def relabel(self, inst: Instance, revision: Revision, settings: EngineSettings) -> None:
        await self.gate.relabel(inst, revision, settings)

    async def mark_applied(self, revision_id: int) -> None:
        await self.recorder.mark_applied(revision_id)

    async def event(self, kind: str, message: str, severity: str = "info", revision_id: int | None = None,
                    data: dict[str, Any] | None = None) -> None:
        await self.recorder.event(kind, message, severity, revision_id, data)

    def monotonic(self) -> float:
        return self.clock.monotonic()

