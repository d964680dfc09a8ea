"""The deployments the engine serves, live: one controller (with its own revisions, events, settings writer and
gateway admission) per deployment in the database, kept in step with the table.

The registry reconciles toward the table once a second, so a deployment created, disabled or deleted through the
API, the CLI or straight in the database is picked up the same way. It stops what a dead engine left behind once,
for every deployment, before any of them starts; it answers the gateway's question "where does a request for model
X go"; and it tells the capacity planner what each deployment's neighbours reserve on the GPUs (or the host) they
share.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import threading
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from sqlalchemy.exc import SQLAlchemyError

from engine.access import AuditLog
from engine.adapters import AdapterStore
from engine.aio import cancel_and_wait
from engine.benchmarks import Benchmarks
from engine.capacity import (
    NEIGHBOUR_MARGIN_BYTES,
    Cluster,
    Neighbour,
    Planner,
    cpu_need_bytes,
    find_model_config,
    load_shape,
)
from engine.clock import SYSTEM_CLOCK, Clock
from engine.config import AppConfig
from engine.db import DEFAULT_DEPLOYMENT, Database, Deployment
from engine.deployments.adapters import Adapters
from engine.deployments.store import DeploymentNotFoundError, DeploymentStore, is_id
from engine.events import EventLog
from engine.gateway import Admission
from engine.gpu import Snapshot
from engine.gpu.views import gpu_view
from engine.metrics import ServingMonitor
from engine.placement import Placement, make_placement
from engine.revisions import HUB_ID, DeploymentRef, EngineSettings, FlagSource, RevisionStore, SettingsWriter
from engine.schemas import Build, FleetInstance, FleetOut, HostReading, NodeOut
from engine.serving import Controller, Residency
from engine.vllm import reap_all, sandbox_problem

log = logging.getLogger("llmops.deployments")


@dataclass(eq=False)
class Runtime:
    """One deployment at work: what the API routes of ``/api/deployments/{name}/…`` (and today's ``/api/…`` for
    the default one) act on."""

    ref: DeploymentRef
    row: Deployment
    revisions: RevisionStore
    events: EventLog
    writer: SettingsWriter
    admission: Admission
    controller: Controller
    planner: Planner
    serving: ServingMonitor | None = None  # the scrape of its vLLM's /metrics (attached by the composition root)
    benchmarks: Benchmarks | None = None

    @property
    def name(self) -> str:
        return self.ref.name


class Fleet:
    def __init__(self, config: AppConfig, db: Database, store: DeploymentStore, revisions: RevisionStore,
                 events: EventLog, planner: Planner, audit: AuditLog | None, flags: FlagSource | None,
                 extras: Callable[[Runtime], None] = lambda _: None, *, placement: Placement | None = None,
                 clock: Clock = SYSTEM_CLOCK, build: tuple[Build, str | None] | None = None) -> None:
        """``placement``, ``clock``, ``build``: the configured placement, the system's clock and the installed vLLM
        unless given (the console and serving tests give a fake vLLM's placement)."""
        self.config = config
        self.clock = clock
        self.build = build
        self.extras = extras
        self.db = db
        self.store = store
        self.revisions = revisions
        self.events = events  # the engine's own log (unscoped)
        self.planner = planner
        self.audit = audit
        self.flags = flags
        self.runtimes: dict[int, Runtime] = {}
        self.placement: Placement = placement or make_placement(config.ray_address, config.gpu_sample_interval_s,
                                                                   config.ray_allow_unauthenticated)
        self._task: asyncio.Task[None] | None = None
        self._wake = asyncio.Event()
        self._sync_lock = asyncio.Lock()  # the loop and a route that waits for its change never add one twice
        self._started = False
        planner.neighbours = self.neighbours
        if self.placement.kind == "ray":
            planner.cluster = self.cluster
        self.on_change: list[Callable[[], None]] = []  # told when a deployment comes or goes (the gateway)
        # many models on one GPU: no more awake at once than fits (engine/serving/residency.py)
        self.residency = Residency(lambda: [r.controller for r in list(self.runtimes.values())], self._claims,
                                   self._capacity, clock.monotonic)
        self._shapes: dict[str, Any] = {}  # a model's shape, read once (the CPU build's claims)
        # the telemetry of the cluster's other nodes (Ray placement), sampled there: latest snapshot per node
        self.node_snapshots: dict[str, Snapshot] = {}
        self.node_ordinals: dict[str, int] = {}  # a node's number in history and alerts: its GPU i is n*100+i
        self.node_sinks: list[Callable[[Snapshot], None]] = []  # history, alerts (set by the composition root)
        self._telemetry: threading.Thread | None = None
        self._telemetry_stop = threading.Event()
        self.adapters = Adapters(AdapterStore(db), lambda: list(self.runtimes.values()), config.data_dir.resolve(),
                                 config.model_roots)
        self.adapters.on_change.append(self._tell)

    # --- building a deployment's runtime --------------------------------------------------------------------

    def _runtime(self, row: Deployment) -> Runtime:
        assert row.id is not None
        ref = DeploymentRef(id=row.id, name=row.name, gpus=list(row.gpus) if row.gpus else None)
        revisions = self.revisions.of(row.id)
        events = self.events.of(row.id)
        admission = Admission(self.config.queue_size, self.config.queue_timeout_s, deployment_id=row.id,
                              deployment=row.name)
        planner = self.planner.scoped(ref)
        controller = Controller(self.config, revisions, events, admission, planner=planner, audit=self.audit,
                                deployment=ref, placement=self.placement, clock=self.clock, build=self.build)
        controller.room = lambda node, settings, index: planner.room_for(settings, self._snapshot_of(node), index)
        controller.free_on = lambda node: planner.free_bytes(self._snapshot_of(node))
        controller.others_running = lambda: sum(len(r.controller.instances) for r in list(self.runtimes.values())
                                                if r.ref is not ref)
        controller.enabled = self.config.autostart and row.enabled
        deployment_id = row.id
        controller.launcher.lora_modules = lambda: self.adapters.modules(deployment_id)
        self.residency.attach(controller)
        writer = SettingsWriter(revisions, events, planner, self.config.data_dir.resolve(), self.config.model_roots,
                                wake=controller.wake, flags=self.flags)
        runtime = Runtime(ref, row, revisions, events, writer, admission, controller, planner)
        self.extras(runtime)
        return runtime

    # --- lifecycle ------------------------------------------------------------------------------------------

    async def start(self) -> None:
        """Stop what a dead engine left (every deployment's), then supervise every deployment of the table."""
        stray = await asyncio.to_thread(reap_all, self.config.data_dir / "run")
        if stray:
            await self.events.emit("stray_killed", f"stopped vLLM processes {stray} left by an engine that died",
                                   severity="warning")
        if (warning := getattr(self.placement, "warning", None)) is not None:  # Ray: open and allowed, or not told
            await self.events.emit("ray_unauthenticated", warning, severity="warning")
        if (unconfined := await asyncio.to_thread(self.unconfined)) is not None:
            log.warning("%s", unconfined)
            await self.events.emit("vllm_unconfined", unconfined, severity="warning")
        await self.adapters.start()  # before any instance starts: each starts with its deployment's adapters
        rows = await asyncio.to_thread(self.store.all)
        for row in rows:
            await self._add(row)
        self._started = True
        self._task = asyncio.create_task(self._run(), name="deployments")
        if self.placement.kind == "ray":
            self._telemetry = threading.Thread(target=self._poll_nodes, name="node-telemetry", daemon=True)
            self._telemetry.start()

    def unconfined(self) -> str | None:
        """Why the vLLM servers of this engine start without their sandbox (engine/vllm_sandbox.py), or None."""
        exposed = ("they can open whatever the engine's user can: the engine's database and admin token "
                   f"({self.config.data_dir / 'run' / 'cli.token'}) included")
        if not self.config.vllm_sandbox:
            return f"vllm_sandbox is off: vLLM servers start unconfined, and {exposed}"
        if (problem := sandbox_problem()) is not None:
            return (f"vLLM servers start unconfined, {problem}: {exposed}. Set vllm_sandbox to false to say "
                    "that this is meant")
        return None

    async def shutdown(self) -> None:
        self._telemetry_stop.set()
        await cancel_and_wait(self._task)
        await self.adapters.close()
        for runtime in list(self.runtimes.values()):
            await self._stop(runtime)

    async def _stop(self, runtime: Runtime) -> None:
        if runtime.benchmarks is not None:
            await runtime.benchmarks.close()
        if runtime.serving is not None:
            await runtime.serving.stop()
        await runtime.controller.shutdown()

    def wake(self) -> None:
        """Look at the table now (after the API changed it)."""
        self._wake.set()

    async def _run(self) -> None:
        while True:
            try:
                await self.sync()
            except SQLAlchemyError as exc:  # the database is away: the deployments serve on as they are
                log.error("deployments: could not read the table: %s", exc)
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._wake.wait(), 1.0)
            self._wake.clear()

    async def sync(self) -> None:
        """Bring the live deployments in step with the table: new ones start, deleted ones stop, renames and
        placements are taken over, an enabled flag that changed starts or stops the deployment."""
        async with self._sync_lock:
            await self._sync()

    async def _sync(self) -> None:
        rows = {r.id: r for r in await asyncio.to_thread(self.store.all) if r.id is not None}
        changed = False
        for deployment_id, runtime in list(self.runtimes.items()):
            row = rows.get(deployment_id)
            if row is None:
                await self._remove(runtime)
                changed = True
                continue
            if row.name != runtime.ref.name or (row.gpus or None) != runtime.ref.gpus:
                runtime.ref.name, runtime.ref.gpus = row.name, list(row.gpus) if row.gpus else None
                runtime.admission.deployment = row.name
                changed = True
            if row.enabled != runtime.row.enabled:
                if row.enabled:
                    runtime.controller.request_start()
                else:
                    runtime.controller.request_stop(f"deployment {row.name} is disabled; enable it with PATCH "
                                                    f"/api/deployments/{row.name}")
            runtime.row = row
        for deployment_id, row in rows.items():
            if deployment_id not in self.runtimes:
                await self._add(row)
                changed = True
        if changed:
            self._tell()

    def _tell(self) -> None:
        for hook in self.on_change:
            hook()

    async def _add(self, row: Deployment) -> None:
        runtime = self._runtime(row)
        assert row.id is not None
        self.runtimes[row.id] = runtime
        if not row.enabled:
            await runtime.admission.refuse(f"deployment {row.name} is disabled")
        await runtime.controller.start(reap=False)
        if runtime.serving is not None:
            runtime.serving.start()

    async def _remove(self, runtime: Runtime) -> None:
        await self._stop(runtime)
        self.runtimes.pop(runtime.ref.id, None)
        self.adapters.forget(runtime.ref.id)
        await asyncio.to_thread(self.adapters.store.delete_deployment, runtime.ref.id)
        await self.events.emit("deployment_removed", f"deployment {runtime.name} was deleted: its instances stopped",
                               data={"deployment": runtime.name})

    # --- what the API, the gateway and the planner ask --------------------------------------------------------

    @property
    def default(self) -> Runtime:
        runtime = self.runtimes.get(DEFAULT_DEPLOYMENT)
        if runtime is None:
            raise DeploymentNotFoundError("(the default deployment)")
        return runtime

    def get(self, name: str | None) -> Runtime:
        """The deployment named ``name``, or whose id it is (a name with a / cannot be one path segment: its id
        can); None: the default one. DeploymentNotFoundError otherwise."""
        if name is None:
            return self.default
        for runtime in list(self.runtimes.values()):
            if runtime.ref.name == name:
                return runtime
        if is_id(name) and (found := self.runtimes.get(int(name))) is not None:
            return found
        raise DeploymentNotFoundError(name)

    def by_model(self, model: str | None) -> Runtime | None:
        """Where a request for ``model`` goes: the deployment of that name, or whose serving instances answer to
        it (a revision that renamed a deployment serves the old name until it is applied). No model: the
        default deployment, as vLLM serves its only model to a request without one."""
        if model is None:
            return self.runtimes.get(DEFAULT_DEPLOYMENT)
        runtimes = list(self.runtimes.values())
        for runtime in runtimes:
            if runtime.ref.name == model:
                return runtime
        for runtime in runtimes:
            if model in runtime.controller.served_names():
                return runtime
        owner = self.adapters.owner(model)  # a LoRA adapter: its deployment serves it
        return self.runtimes.get(owner) if owner is not None else None

    def admission_for(self, model: str | None) -> Admission | None:
        """The gateway's question: whose admission takes a request for ``model`` (None: no such deployment)."""
        runtime = self.by_model(model)
        return runtime.admission if runtime is not None else None

    def models(self) -> list[dict[str, Any]]:
        """GET /v1/models: the deployments that serve now or are scaled to zero (a request wakes them), as OpenAI
        lists models (the model's folder on this host is nobody's business: ``root`` is the hub id, or the
        deployment's own name)."""
        out = []
        for runtime in sorted(self.runtimes.values(), key=lambda r: r.ref.id):
            settings = runtime.controller.listed_settings()
            if settings is None:
                continue
            root = settings.model if HUB_ID.fullmatch(settings.model) and not settings.model.startswith(
                ("/", ".")) else runtime.name
            out.append({"id": settings.served_model_name, "object": "model", "created": int(runtime.row.created_at),
                        "owned_by": "llmops", "root": root, "parent": None, "max_model_len": settings.max_model_len,
                        "permission": [], "deployment": runtime.name})
            served = self.adapters.of(runtime.ref.id)
            for name in sorted(served.listed):
                row = served.rows.get(name)
                out.append({"id": name, "object": "model", "created": int(row.created_at) if row else 0,
                            "owned_by": "llmops", "root": name, "parent": settings.served_model_name,
                            "max_model_len": settings.max_model_len, "permission": [], "deployment": runtime.name})
        return out

    def vllm_pids(self) -> dict[int, str | None]:
        """Every vLLM process of the engine with the deployment it serves (from the sampler's thread)."""
        out: dict[int, str | None] = {}
        for runtime in list(self.runtimes.values()):
            for pid in runtime.controller.vllm_pids():
                out[pid] = runtime.ref.name
        return out

    # --- the fleet: nodes, their telemetry, the instances on each ----------------------------------------------

    def _poll_nodes(self) -> None:
        """Every sample interval: each node's own sampler (NVML there, or its host), its vLLM processes
        attributed, into the fleet view and, labelled by node, the history and alerts (a thread: it waits on the
        cluster)."""
        interval = self.config.gpu_sample_interval_s
        own = getattr(self.placement, "own_node", None)
        while not self._telemetry_stop.wait(interval):
            attribution: dict[str, dict[int, str | None]] = {}
            for runtime in list(self.runtimes.values()):
                for inst in list(runtime.controller.instances):
                    if inst.child.node and inst.child.pid is not None:  # a Ray instance, on whichever node
                        attribution.setdefault(inst.child.node, {})[inst.child.pid] = runtime.name
            try:
                snaps = self.placement.snapshots(attribution)  # type: ignore[attr-defined]
            except Exception:  # a cluster that cannot be asked this round is asked again the next
                log.exception("node telemetry: the cluster did not answer")
                continue
            self.node_snapshots = snaps
            for node, snap in snaps.items():
                if node == own:  # the engine's own host: its local sampler writes it already
                    continue
                number = self.node_ordinals.setdefault(node, len(self.node_ordinals) + 1)
                labelled = dataclasses.replace(snap, gpus=[dataclasses.replace(g, index=number * 100 + g.index)
                                                           for g in snap.gpus])
                for sink in self.node_sinks:
                    try:
                        sink(labelled)
                    except Exception:  # a failing sink must not stop the others; it is logged
                        log.exception("node telemetry sink %r failed", sink)

    def _snapshot_of(self, node: str | None) -> Snapshot | None:
        """The latest sample of ``node`` (None, or the engine's own: its local sampler's)."""
        if node is None or node == getattr(self.placement, "own_node", None):
            return None
        return self.node_snapshots.get(node)

    def view(self, local: Snapshot) -> FleetOut:
        """Nodes → GPUs (or the host) → instances (``local``: the engine host's own latest sample)."""
        instances: dict[str | None, list[FleetInstance]] = {}
        for runtime in sorted(self.runtimes.values(), key=lambda r: r.ref.id):
            for inst in list(runtime.controller.instances):
                instances.setdefault(inst.child.node, []).append(FleetInstance(
                    deployment=runtime.name, name=inst.name, role=inst.role, revision=inst.revision.id,
                    address=inst.child.url if inst.child.started else None, serving=inst.serving))
        own = getattr(self.placement, "own_node", None)
        nodes = []
        for info in self.placement.nodes():
            local_node = self.placement.kind == "local" or info.id == own
            snap = local if local_node else self.node_snapshots.get(info.id)
            host = HostReading.model_validate(snap.host) if snap is not None and snap.host else None
            nodes.append(NodeOut(id=info.id, address=info.address, alive=info.alive, head=info.head, cpus=info.cpus,
                                 gpus=info.gpus, memory_bytes=info.memory_bytes, telemetry=snap is not None,
                                 suspect=self.placement.is_suspect(info.id),
                                 gpu_readings=[gpu_view(g) for g in snap.gpus] if snap is not None else [], host=host,
                                 instances=instances.get(None if self.placement.kind == "local" else info.id, [])))
        return FleetOut(placement=self.placement.kind, nodes=nodes)

    def cluster(self) -> Cluster | None:
        """The Ray cluster's GPUs now (its alive nodes'), for a model in stages across nodes."""
        alive = [n for n in self.placement.nodes() if n.alive]
        return Cluster(gpus=int(sum(n.gpus for n in alive)), gpus_per_node=int(max((n.gpus for n in alive),
                                                                                  default=0)), nodes=len(alive))

    def _claims(self, controller: Controller, settings: EngineSettings) -> dict[str, float]:
        """What a deployment takes while awake: on CUDA its gpu_memory_utilization (and the margin beside each
        instance) on each GPU it runs on, replicas sharing a GPU added up; on the CPU build the host memory its
        instances need."""
        floor = settings.min_replicas if settings.max_replicas is not None else settings.replicas
        replicas = max(1, controller.scaler.want or floor)
        if self.planner.build == "cuda":
            device = self.planner.device()
            if device is None:
                return {}
            tp = settings.tensor_parallel_size
            ref = controller.deployment
            gpus = tuple(ref.gpus) if ref.gpus else tuple(range(min(device.count, tp * replicas)))
            sharing = max(1, (tp * replicas) // max(1, len(gpus)))
            margin = NEIGHBOUR_MARGIN_BYTES / device.total_bytes if device.total_bytes else 0.0
            return {f"gpu{g}": (settings.gpu_memory_utilization + margin) * sharing for g in gpus}
        shape = self._shapes.get(settings.model)
        if shape is None:  # read once it is there (a hub model appears when downloaded); not remembered missing
            shape = _shape(find_model_config(settings.model, self.config.data_dir.resolve()))
            if shape is not None:
                self._shapes[settings.model] = shape
        return {"host": float(cpu_need_bytes(settings, shape) * replicas)}

    def _capacity(self) -> dict[str, float]:
        """What the awake deployments may take together: each GPU whole (and the first instance's margin); on the
        CPU build, the host's memory available now and what vLLM holds of it. On a Ray fleet, nothing: each node's
        GPUs are its own, and a GPU index names one per node (the room is not kept there yet)."""
        if self.placement.kind == "ray":
            return {}
        snap = self.planner.sampler.latest
        if self.planner.build == "cuda":
            return {f"gpu{g.index}": 1.0 + NEIGHBOUR_MARGIN_BYTES / float(g.values["mem_total"] or 1)
                    for g in snap.gpus if not g.lost and g.values.get("mem_total")}
        host = snap.host or {}
        if not host:
            return {}
        return {"host": float(host.get("mem_available") or 0) + float(host.get("vllm_rss") or 0)}

    def neighbours(self, of: DeploymentRef | None) -> list[Neighbour]:
        """What the other enabled deployments reserve (their desired revision's memory, on the GPUs they run on;
        on the CPU build, what their instances will still take of the host). Reads each one's desired revision:
        call off the event loop."""
        out: list[Neighbour] = []
        device = self.planner.device()
        data_dir = self.config.data_dir.resolve()
        for runtime in list(self.runtimes.values()):
            if (of is not None and runtime.ref.id == of.id) or not runtime.row.enabled:
                continue
            rev = runtime.controller.running or runtime.revisions.desired_revision()
            if rev is None:
                continue
            settings = EngineSettings.model_construct(**rev.values)
            tp, replicas = settings.tensor_parallel_size, settings.replicas
            if self.planner.build == "cuda":
                count = device.count if device is not None else 1
                gpus = tuple(runtime.ref.gpus) if runtime.ref.gpus else tuple(range(min(count, tp * replicas)))
                sharing = max(1, (tp * replicas) // max(1, len(gpus)))  # replicas that share a GPU add up
                out.append(Neighbour(runtime.name, gpus=gpus, utilization=settings.gpu_memory_utilization * sharing,
                                     instances=sharing, sleeps=settings.scale_to_zero_after_s is not None))
            else:
                folder = find_model_config(settings.model, data_dir)
                shape = _shape(folder)
                need = cpu_need_bytes(settings, shape) * replicas
                held = self.planner.scoped(runtime.ref).vllm_memory() or 0
                out.append(Neighbour(runtime.name, host_bytes=max(0, need - held), instances=replicas))
        return out


def _shape(folder: Path | None) -> Any:
    if folder is None:
        return None
    try:
        return load_shape(folder)
    except (KeyError, ValueError, TypeError, OSError):
        return None
