"""The launcher: the only room of serving that touches vLLM processes and the gateway's admission. It launches an
instance, promotes a ready one into the gateway, closes and drains one, stops one, puts one to sleep and wakes it,
and moves each instance from one role to the next (engine/serving/instances.py).

Nothing here waits long: what takes seconds (a stop, a sleep, a wake-up) runs as the instance's operation, a task
that tells the controller when it has ended (``wake``); a drain or a handover is begun here and looked at again on
the next tick, a watcher waking the controller the moment it is over.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import secrets
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import psutil
from sqlalchemy.exc import SQLAlchemyError

from engine.capacity import Planner, logged_batched_tokens, parse_start
from engine.clock import Clock
from engine.config import AppConfig
from engine.db import Revision, database_url
from engine.gateway import Upstream
from engine.placement import Placement
from engine.revisions import DeploymentRef, EngineSettings, resolve_local_model
from engine.schemas import Build, EngineState
from engine.serving.eta import Company, start_view
from engine.serving.forecast import Forecast
from engine.serving.gate import Gate
from engine.serving.instances import Instance, Instances
from engine.serving.progress import Progress
from engine.serving.recorder import Recorder
from engine.vllm import (
    Child,
    ChildLog,
    ChildSpec,
    Prober,
    build_command,
    build_env,
    compile_key,
    free_port,
    launch_max_num_seqs,
    renice_group,
    sandbox_for,
    sandbox_problem,
    unbound_omp_threads,
)
from engine.vllm_sandbox import Sandbox

log = logging.getLogger("llmops.serving")
S = EngineState
RELEASE_WAIT_S = 30.0  # after a stop, how long the GPU memory of its processes is waited for


def engine_secrets(config: AppConfig) -> list[Path]:
    """The engine's secrets outside its data dir, which vLLM may not open either (the data dir's own are
    engine/vllm/command.py DATA_DIR_SECRETS): the console's key, and a SQLite database elsewhere with its journals."""
    secrets = [config.console_key_path]
    url = database_url(config.database_url.get_secret_value()) if config.database_url else None
    if url is not None and url.get_backend_name() == "sqlite" and url.database:
        secrets += [Path(url.database + suffix) for suffix in ("", "-wal", "-shm", "-journal")]
    return secrets


class Launcher:
    def __init__(self, config: AppConfig, deployment: DeploymentRef, build: Build, gate: Gate,
                 instances: Instances, progress: Progress, recorder: Recorder, forecast: Forecast, clock: Clock,
                 log_: ChildLog, run_dir: Path, placement: Callable[[], Placement],
                 planner: Callable[[], Planner | None], others_running: Callable[[], int],
                 wake: Callable[[], None], prober: Prober) -> None:
        self.config = config
        self.prober = prober
        self.deployment = deployment
        self.build = build
        self.gate = gate
        self.instances = instances
        self.progress = progress
        self.recorder = recorder
        self.forecast = forecast
        self.clock = clock
        self.log = log_
        self.run_dir = run_dir
        self._placement = placement
        self._planner = planner
        self._others_running = others_running
        self.wake = wake
        self.starts = 0
        # the deployment's LoRA adapters (name, folder), each instance started with them (set by the fleet)
        self.lora_modules: Callable[[], list[tuple[str, str]]] = list
        self.last_start: dict[str, Any] | None = None  # the phases of the latest start, once it has ended
        self._tasks: set[asyncio.Task[Any]] = set()  # operations, exit handlers and watchers under way

    @property
    def placement(self) -> Placement:
        return self._placement()

    @property
    def planner(self) -> Planner | None:
        return self._planner()

    def pending(self) -> list[asyncio.Task[Any]]:
        """The tasks this room has under way (a test waits for them before it moves its clock)."""
        return [t for t in self._tasks if not t.done()]

    def _task(self, coro: Awaitable[Any], name: str) -> asyncio.Task[Any]:
        task: asyncio.Task[Any] = asyncio.ensure_future(coro)
        task.set_name(name)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return task

    # --- where an instance goes --------------------------------------------------------------------------------

    def node_for(self, index: int, settings: EngineSettings) -> str | None:
        """Where replica ``index`` goes: the placement's choice among nodes with room, beside this deployment's
        other instances (None: this host). Ray asks its GCS: call from a thread."""
        taken = [i.child.node for i in self.instances if i.serving or i.role == "starting"]
        return self.placement.place(index, taken, settings.tensor_parallel_size if self.build == "cuda" else 0)

    def other_nodes(self, chosen: str | None, settings: EngineSettings) -> list[str]:
        """The alive nodes besides ``chosen`` a replica could go to when ``chosen`` has no room, fewest of this
        deployment's instances first (none on this host alone). Ray asks its GCS: call from a thread."""
        if chosen is None:
            return []
        gpus = settings.tensor_parallel_size if self.build == "cuda" else 0
        taken = [i.child.node for i in self.instances if i.serving or i.role == "starting"]
        nodes = [n for n in self.placement.nodes() if n.id != chosen and n.alive and n.gpus >= gpus
                 and self.placement.alive(n.id)]
        return [n.id for n in sorted(nodes, key=lambda n: taken.count(n.id))]

    def device_for(self, index: int, settings: EngineSettings) -> str | None:
        """The GPUs of replica ``index``: its own tensor-parallel group when the deployment's GPUs (the host's,
        when it names none) are enough for every replica, else the deployment's shared (None: CUDA_VISIBLE_DEVICES
        left as it is)."""
        if self.build != "cuda":
            return None
        placed = self.deployment.gpus
        tp = settings.tensor_parallel_size
        planner = self.planner
        if settings.most_replicas < 2 or planner is None:
            return None if not placed else ",".join(map(str, placed))
        device = planner.device(tp)
        gpus = placed or (list(range(device.count)) if device is not None else [])
        if len(gpus) < settings.most_replicas * tp:
            return None if not placed else ",".join(map(str, placed))
        return ",".join(str(g) for g in gpus[index * tp:(index + 1) * tp])

    def company(self, device: str | None, bridge: bool) -> Company:
        """What a new instance starts beside: a bridge; an instance that serves requests on its device (the CPU
        build: on the host, another deployment's too: they share its cores; a GPU: the GPU and the host's cores
        its server needs), which slows a start by what it takes; else alone (an idle instance takes nothing)."""
        if bridge:
            return "bridge"
        if self.build == "cpu" and self._others_running() > 0:
            return "beside"
        if self.forecast.traffic.recent() == 0:
            return "alone"
        live = [i for i in self.instances if i.serving or i.role == "draining"]

        def gpus(d: str | None) -> set[str] | None:
            return None if d is None else set(d.split(","))

        mine = gpus(device)
        shared = [i for i in live if self.build == "cpu" or mine is None or gpus(i.device) is None
                  or mine & (gpus(i.device) or set())]
        return "beside" if shared else "alone"

    # --- launch ------------------------------------------------------------------------------------------------

    def sandbox(self, data_dir: Path, env: dict[str, str]) -> Sandbox | None:
        """What a new vLLM child may not open (engine/vllm_sandbox.py; ``env`` may get its TMPDIR), or None: the
        sandbox is off, or this host has no Landlock (the fleet said so once, at start)."""
        if not self.config.vllm_sandbox or sandbox_problem() is not None:
            return None
        return sandbox_for(data_dir, env, secrets=engine_secrets(self.config), model_roots=self.config.model_roots)

    async def launch(self, revision: Revision, settings: EngineSettings, *, device: str | None,
                     bridge: bool = False, node: str | None = None, index: int = 0,
                     abortable: bool = True) -> Instance:
        """Spawn an instance (role starting) on ``node`` (None, or a node no longer alive: where the placement puts
        replica ``index``); the health room gives its verdict."""
        if node is None or not await asyncio.to_thread(self.placement.alive, node):  # Ray asks its GCS: a thread
            node = await asyncio.to_thread(self.node_for, index, settings)
        assert revision.id is not None
        name = self.instances.free_name()
        data_dir = self.config.data_dir.resolve()
        sleep = self.build == "cuda" and self.config.sleep_mode
        # on the CPU build a start beside an instance that serves gets the cores serving leaves (see
        # start_beside_nice); a local child only (a Ray node's processes are not this host's to renice)
        lowered = (self.build == "cpu" and self.placement.kind == "local" and any(i.serving for i in self.instances)
                   and self.config.start_beside_nice > self.config.vllm_nice)
        args = build_command(settings, python=self.config.vllm_python, port=free_port(), data_dir=data_dir,
                             build=self.build, sleep_mode=sleep,
                             nice=self.config.start_beside_nice if lowered else self.config.vllm_nice,
                             lora_modules=self.lora_modules() if settings.enable_lora else ())
        key = secrets.token_urlsafe(32)  # vLLM answers /v1 to the gateway only, not to any local user of the port
        cluster = self.config.ray_address if settings.pipeline_parallel_size > 1 else None
        env = build_env(offline=resolve_local_model(settings.model, data_dir) is not None,
                        hf_token=self.config.hf_token.get_secret_value() if self.config.hf_token else None,
                        devices=device, dev_endpoints=sleep, api_key=key, runtime_lora=settings.enable_lora)
        if cluster:  # vLLM's Ray executor joins the engine's cluster for the stages' workers
            env["RAY_ADDRESS"] = cluster
        if self.build == "cpu" and (self.instances or self._others_running()) and \
                "VLLM_CPU_OMP_THREADS_BIND" not in env:
            # the CPU build pins its worker to cores on its own ("auto"); a second instance pinned to the same
            # cores hung at start (vLLM 0.32, two cores): one started beside another is left to the OS scheduler,
            # with the thread count pinning would have given it (unpinned, vLLM runs one per core)
            env["VLLM_CPU_OMP_THREADS_BIND"] = "nobind"
            env.setdefault("OMP_NUM_THREADS", str(unbound_omp_threads(settings.tensor_parallel_size)))
        port = int(args[args.index("--port") + 1])
        sandbox = await asyncio.to_thread(self.sandbox, data_dir, env)  # walks the filesystem
        child = self.placement.child(ChildSpec(
            args=args, env=env, port=port, revision_id=revision.id, log=self.log,
            pidfile=self.run_dir / self.deployment.pidfile_name(name), name=name, cwd=data_dir, api_key=key,
            node=node, gpus=settings.tensor_parallel_size if self.build == "cuda" and
            settings.pipeline_parallel_size == 1 else 0,  # in stages, vLLM's Ray executor places its workers
            sandbox=sandbox))
        inst = Instance(name, child, revision, settings, device=device, bridge=bridge, index=index,
                        since=self.clock.time(), launched_seqs=launch_max_num_seqs(settings), lowered=lowered,
                        abortable=abortable and not bridge)
        def exited(_: Child) -> None:
            self._task(self._exited(inst), f"exited-{name}")

        child.on_exit = exited
        planner = self.planner
        inst.predicted = await asyncio.to_thread(planner.predict_now, settings) if planner else None
        inst.compile_key = compile_key(settings.model_dump(), env)
        inst.eta = await asyncio.to_thread(self.forecast.eta_for, settings.model_dump(),
                                           self.company(device, bridge), env)
        self.instances.add(inst)
        self.starts += 1
        what = "a bridge of revision" if bridge else "revision"
        await self.recorder.event(
            "starting", f"starting vLLM instance {name} with {what} {revision.id} ({inst.eta.kind} start)"
            + (f" on node {node[:12]}" if node else "") + (f" on GPU {device}" if device else "")
            + f"; expected ready in {inst.eta.describe()}", revision_id=revision.id,
            data={"args": args[1:], "predicted": inst.predicted, "instance": name, "bridge": bridge,
                  "device": device, "node": node, "eta_s": inst.eta.total_s, "kind": inst.eta.kind,
                  "load_1m": inst.eta.load_1m})
        inst.in_flight_at_launch = self.gate.in_flight()
        inst.launched_at = self.clock.monotonic()
        await child.spawn()
        return inst

    async def _exited(self, inst: Instance) -> None:
        """An instance's server process exited without being asked to (seen the moment it happened, whatever the
        controller is doing: an apply takes minutes): the gateway sends it nothing more, at once, and the exit is
        on record; the controller then handles it (diagnosis, restart, rollback) at its next step."""
        child = inst.child
        if child.stop_requested or inst not in self.instances:
            return
        role = inst.role
        closed = await self.gate.close(inst) if inst.serving else []
        in_flight = sum(u.outstanding for u in closed)
        if inst.serving:
            inst.role = "failed"
        # when it was seen (the event is written after: its time waits for a database thread on a busy host)
        now = self.clock.time()
        seen = now - (self.clock.monotonic() - child.exited_at) if child.exited_at else now
        how = f"lost ({child.lost})" if child.lost else "exited"
        message = (f"vLLM instance {inst.name} (revision {inst.revision.id}) {how} while {role}: no new requests go "
                   "to it" + (f"; {in_flight} in flight on it fail" if in_flight else ""))
        await self.recorder.event("instance_exited", message, "error", inst.revision.id,
                                  data={"instance": inst.name, "role": role, "exit_code": child.returncode,
                                        "in_flight": in_flight, "pid": child.pid, "seen_at": round(seen, 3),
                                        "lost": child.lost})
        self.wake()

    # --- a start's end -----------------------------------------------------------------------------------------

    def start_ended(self, inst: Instance) -> None:
        """Book a start's verdict once given: its phases, the apply's timing, the latest start's record."""
        verdict = inst.verdict
        assert verdict is not None
        tracker = inst.child.tracker
        if verdict.ready:
            tracker.ready()
            self.progress.timed("start", inst.name, tracker.ready_s or verdict.seconds, inst.in_flight_at_launch,
                                inst.eta.kind if inst.eta else None)
        else:
            tracker.fail(verdict.reason)
        self.last_start = {"revision": inst.revision.id, **start_view(tracker, inst.eta)}

    async def promote(self, inst: Instance, *, woken: bool = False) -> Upstream:
        """A ready instance takes traffic; the ready event records its start (phases, ETA error, calibration).
        A ``woken`` instance (back from sleep mode) takes traffic again; its start was recorded when it began."""
        assert inst.revision.id is not None
        child = inst.child
        child.remember_descendants()
        if inst.lowered and child.pid is not None:  # it serves now: the priority of any instance that serves
            inst.lowered = False
            if problem := renice_group(child.pid, self.config.vllm_nice):
                await self.recorder.event("nice_refused", f"vLLM instance {inst.name} serves at nice "
                                          f"{self.config.start_beside_nice}, as it started: {problem}. Give the "
                                          "engine CAP_SYS_NICE, or set start_beside_nice to vllm_nice", "warning",
                                          inst.revision.id)
        inst.role = "bridge" if inst.bridge else "serving"
        inst.ready_at = self.clock.time()
        inst.since = self.clock.time()
        inst.last_health = self.clock.monotonic()
        if not inst.bridge:
            await self.recorder.mark_applied(inst.revision.id)
        upstream = await self.gate.open(inst)
        if woken:
            if self.progress.state != S.READY and self.progress.sm.can(S.READY):
                self.progress.enter(S.READY, f"revision {inst.revision.id} serves again after wake-up")
            return upstream
        seconds = child.tracker.ready_s or 0.0
        startup: dict[str, Any] = {"phases": child.tracker.durations(),
                                   "compile_key": inst.compile_key or compile_key(inst.settings.model_dump()),
                                   "model": inst.settings.model, "compile_cache": child.tracker.compile_cache}
        eta_text = ""
        if inst.eta is not None:  # the kind it was started as, the host's load then, and how far off its ETA was
            error = seconds - inst.eta.total_s
            startup.update(kind=inst.eta.kind, load_1m=inst.eta.load_1m, cores=inst.eta.cores,
                           eta_s=inst.eta.total_s, eta_basis=inst.eta.basis, error_s=round(error, 1),
                           error_pct=round(100 * error / inst.eta.total_s, 1) if inst.eta.total_s else None)
            eta_text = f" (expected {inst.eta.total_s:.0f} s, {error:+.0f} s)"
        self.last_start = {"revision": inst.revision.id, **start_view(child.tracker, inst.eta),
                           **{k: startup.get(k) for k in ("error_s", "error_pct")}}
        measured = await asyncio.to_thread(self._measure_start, inst)  # calibration writes SQLite
        if isinstance(kv := measured.get("kv_tokens"), int) and kv > 0:  # what its prefix cache can hold
            inst.kv_tokens = kv
            upstream.routed.index.resize(kv)
        if self.progress.state != S.READY:
            if self.progress.sm.can(S.READY):
                self.progress.enter(S.READY, f"revision {inst.revision.id} ready after {seconds:.1f} s")
        else:
            self.progress.say(f"revision {inst.revision.id} serving")
        what = "bridge of revision" if inst.bridge else "revision"
        await self.recorder.event("ready", f"vLLM instance {inst.name} ready with {what} {inst.revision.id} after "
                                  f"{seconds:.1f} s{eta_text}", revision_id=inst.revision.id,
                                  data={"startup_s": round(seconds, 2), "pid": child.pid, "instance": inst.name,
                                        "bridge": inst.bridge, "startup": startup, **measured})
        return upstream

    def _measure_start(self, inst: Instance) -> dict[str, Any]:
        """What vLLM logged about memory at this start; calibrates the capacity model on GPUs."""
        report = parse_start(list(inst.child.lines))
        out: dict[str, Any] = {"kv_tokens": report.kv_tokens, "kv_gib": report.kv_gib,
                               "weights_gib": report.weights_gib, "activation_gib": report.activation_gib,
                               "non_torch_gib": report.non_torch_gib}
        planner = self.planner
        if planner is not None:
            out["capacity"] = planner.compare(inst.settings, report, inst.predicted)
            if self.build == "cuda":
                try:
                    planner.calibrate(report, inst.settings, logged_batched_tokens(inst.child.lines),
                                      inst.revision.id)
                except SQLAlchemyError as exc:  # next start calibrates again
                    self.recorder.unrecorded += 1
                    log.error("serving: could not record the calibration of revision %s: %s", inst.revision.id,
                              exc)
        return out

    # --- stop, sleep, wake (operations) ------------------------------------------------------------------------

    def stop(self, inst: Instance, reason: str) -> None:
        """Stop an instance that takes no traffic (its requests drained or given up), as its operation: while
        others serve, its shutdown runs at the lowest CPU priority (it must not slow them). Once it is over the
        instance is gone from the registry."""
        if inst.gone or inst.stop_reason is not None:
            return
        was = inst.role
        inst.role = "stopping"
        inst.stop_reason = reason
        child = inst.child
        old_pids: set[int] = set()
        if child.local and child.pid is not None:
            if any(i.serving for i in self.instances if i is not inst):
                renice_group(child.pid, 19)  # raising a nice value is always allowed
            old_pids = {child.pid}
            with contextlib.suppress(psutil.Error):
                old_pids.update(p.pid for p in psutil.Process(child.pid).children(recursive=True))
        inst.op = self._task(self._stop(inst, was, reason, old_pids), f"stop-{inst.name}")

    async def _stop(self, inst: Instance, was: str, reason: str, old_pids: set[int]) -> None:
        try:
            seconds = await inst.child.stop(self.config.stop_timeout_s)
            if was in ("serving", "bridge", "draining"):  # a step of an apply (not a start given up)
                self.progress.timed("stop", inst.name, seconds, self.gate.in_flight())
            released = True
            planner = self.planner
            if planner is not None and old_pids:
                released = await asyncio.to_thread(planner.wait_released, old_pids, RELEASE_WAIT_S)
            try:  # told before the instance is gone: what waits for it (an apply's end) is told after it
                await self.recorder.event("stopped", f"vLLM instance {inst.name} stopped in {seconds:.1f} s: "
                                          f"{reason}" + ("" if released else "; its GPU memory was still held after "
                                                         "30 s"), "info" if released else "warning", inst.revision.id,
                                          data={"stop_s": round(seconds, 2), "exit_code": inst.child.returncode,
                                                "instance": inst.name})
            finally:
                self.forget(inst)
        except Exception as exc:  # kept for the controller: a stop that failed (processes survived SIGKILL)
            inst.op_error = exc
            raise
        finally:
            self.wake()

    def stopped(self, inst: Instance) -> bool:
        """Whether ``inst`` is gone (its stop is over). A stop that failed raises its error here."""
        if inst.op_error is not None:
            error, inst.op_error = inst.op_error, None
            raise error
        return inst.gone

    def forget(self, inst: Instance) -> None:
        inst.gone = True
        self.instances.remove(inst)

    def kill(self, inst: Instance) -> None:
        """Stop what is left of an instance at once, as its operation (no drain, no event: the failure's record
        says it); bounded by stop_timeout_s, then SIGKILL. Once it is over the instance is gone."""
        if inst.gone or inst.busy:
            return
        inst.stop_reason = inst.stop_reason or "failed"
        inst.op = self._task(self._kill(inst), f"kill-{inst.name}")

    async def _kill(self, inst: Instance) -> None:
        try:
            await inst.child.stop(self.config.stop_timeout_s)
            self.forget(inst)
        except Exception as exc:  # kept for the controller, as a stop's
            inst.op_error = exc
            raise
        finally:
            self.wake()

    def sleep(self, inst: Instance) -> None:
        """Put an instance to sleep (level 1: weights to host memory, KV cache dropped), as its operation; it is
        sleeping once it is over, else ``sleep_error`` says why not."""
        inst.sleep_error = None
        inst.op = self._task(self._sleep(inst), f"sleep-{inst.name}")

    async def _sleep(self, inst: Instance) -> None:
        t0 = self.clock.monotonic()
        try:
            error = await self.prober.sleep(inst.child.url, inst.child.headers)
            if error is not None:
                inst.sleep_error = error
                await self.recorder.event("sleep_failed", f"instance {inst.name} could not sleep ({error}): "
                                          "stopping it", "warning")
                return
            inst.role = "sleeping"
            seconds = self.clock.monotonic() - t0
            self.progress.timed("sleep", inst.name, seconds, 0)
            await self.recorder.event("sleeping", f"instance {inst.name} asleep after {seconds:.1f} s (revision "
                                      f"{inst.revision.id} can serve again in about a second)",
                                      revision_id=inst.revision.id,
                                      data={"sleep_s": round(seconds, 2), "instance": inst.name})
        finally:
            self.wake()

    def wake_up(self, inst: Instance) -> None:
        """Wake a sleeping instance and let it take traffic again, as its operation (``woken`` says how it ended);
        one that does not wake is stopped."""
        inst.woken = None
        inst.op = self._task(self._wake_up(inst), f"wake-{inst.name}")

    async def _wake_up(self, inst: Instance) -> None:
        t0 = self.clock.monotonic()
        try:
            ok = await self.prober.wake_up(inst.child.url, inst.child.headers, inst.settings.served_model_name)
            if not ok:
                inst.woken = False
                return
            seconds = self.clock.monotonic() - t0
            inst.role = "starting"
            await self.promote(inst, woken=True)
            await self.recorder.event("woken", f"instance {inst.name} serves revision {inst.revision.id} again "
                                      f"{seconds:.2f} s after wake-up", revision_id=inst.revision.id,
                                      data={"wake_s": round(seconds, 2), "instance": inst.name})
            inst.woken = True
        finally:
            self.wake()

    async def close_down(self) -> None:
        """The engine stops: watchers end, every instance is stopped (its operation under way, if any, first)."""
        ops = {inst.op for inst in self.instances if inst.op is not None}
        for task in list(self._tasks):
            if task not in ops:
                task.cancel()
        for inst in self.instances:
            if inst.busy and inst.op is not None:
                with contextlib.suppress(Exception, asyncio.CancelledError):
                    await inst.op
            if not inst.gone:
                inst.stop_reason = None  # (a stop that ended without forgetting it, or a sleeping one)
                self.stop(inst, "engine shutting down")
                if inst.op is not None:
                    with contextlib.suppress(Exception):
                        await inst.op
