"""The serving tier's harness: one deployment's controller over fake vLLM children (tests/testkit/fake_vllm.py) and
a clock the test moves, with its real parts around it — the revision store and event log on a real SQLite file,
the gateway's admission and data path, streaming clients that go through them. A scenario ticks the controller
and moves the clock until what it waits for holds; a start of a minute takes a few milliseconds.

    async with Scenario(tmp_path, plan="bridge") as sc:
        await sc.until(sc.serving_revision(1))
        async with sc.clients(8):
            rev = sc.write({"max_num_seqs": 5})
            await sc.until(sc.applied(rev))
        assert sc.failed == [] and sc.longest_gap == 0
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import shutil
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, cast

from sqlalchemy.exc import OperationalError

from engine.access import AuditLog
from engine.capacity import Planner, StepTimes
from engine.config import AppConfig
from engine.db import Database, Event, Revision, open_database
from engine.deployments import DeploymentStore
from engine.events import EventLog
from engine.gateway import Admission, BodyLimits, DataPath, Gateway
from engine.revisions import DeploymentRef, EngineSettings, RevisionStore, initial_settings
from engine.schemas import ApplyPlanOut, BridgeOut, PlanKind, PlanStepOut, StatusOut
from engine.serving import Controller, Residency
from tests.testkit.clock import FakeClock
from tests.testkit.data import make_data_dir
from tests.testkit.fake_vllm import FakePlacement, FakeVllm, Script

SETTLE_S = 0.5  # longest real wait for serving's own tasks (probes, operations, watchers) after a tick
_TEMPLATE: dict[str, Path] = {}


def migrated_sqlite(folder: Path) -> Path:
    """A SQLite file at the schema's head, copied from one migrated once per process."""
    template = _TEMPLATE.get("sqlite")
    if template is None or not template.exists():
        import tempfile

        template = Path(tempfile.mkdtemp(prefix="llmops-template-")) / "template.db"
        open_database(template).close()
        _TEMPLATE["sqlite"] = template
    target = folder / "llmops.db"
    shutil.copy(template, target)
    return target


class ScriptedCapacity:
    """The capacity planner as serving sees it, with the plan kind the test chose (engine/capacity/planner.py
    chooses it from the device's memory: tests/unit/test_plans.py proves that choice). Each plan's steps carry
    ETAs from the engine's own step table, as a real plan's do."""

    def __init__(self, kind: PlanKind = "blue_green") -> None:
        self.kind: PlanKind = kind
        self.room: str | None = None  # why one more replica does not fit now (None: it does)
        self.plans: list[ApplyPlanOut] = []

    def plan(self, new: EngineSettings, old: EngineSettings | None, *, replicas: int, memory_bytes: int | None,
             eta_new_s: float | None, eta_bridge_s: float | None, times: StepTimes | None = None,
             sleep: bool = False) -> ApplyPlanOut:
        kind: PlanKind = "start" if old is None else self.kind
        kinds: dict[str, list[tuple[Any, str, Any]]] = {
            "start": [("start", "start the new revision", "alone")],
            "blue_green": [("start", "start beside", "beside"), ("handover", "hand over", None),
                           ("drain", "drain the old", None), ("stop", "stop the old", None)],
            "bridge": [("start", "start a bridge", "bridge"), ("handover", "hand over", None),
                       ("drain", "drain the old", None), ("stop", "stop the old", None),
                       ("start", "start beside the bridge", "beside"), ("handover", "hand over", None),
                       ("drain", "drain the bridge", None), ("stop", "stop the bridge", None)],
            "rolling": [a for _ in range(max(1, replicas)) for a in (("drain", "drain", None), ("stop", "stop", None),
                                                                     ("start", "start", "alone"))],
            "pause": [("drain", "drain", None), ("sleep" if sleep else "stop", "stop", None),
                      ("start", "start", "alone")],
        }
        actions = kinds.get(kind, [])
        steps = []
        for action, text, company in actions:
            eta = None
            if times is not None:
                eta = times.start(new, company) if action == "start" else times.step(action)
            steps.append(PlanStepOut(action=action, text=text, eta_s=eta.seconds if eta else None,
                                     start_kind=eta.start_kind if eta else None))
        bridge = BridgeOut(gpu_memory_utilization=0.13, kv_tokens=17_312, max_num_seqs=8, max_concurrency=4.2,
                           max_model_len=new.max_model_len) if kind == "bridge" else None
        plan = ApplyPlanOut(kind=kind, reason=f"scripted {kind}", steps=[s.text for s in steps], step_etas=steps,
                            bridge=bridge, pause_s=None if kind == "pause" else 0.0)
        self.plans.append(plan)
        return plan

    def vllm_memory(self) -> int | None:
        return None

    def device(self, tensor_parallel_size: int = 1) -> None:
        return None

    def predict_now(self, settings: EngineSettings) -> dict[str, Any] | None:
        return None

    def compare(self, settings: EngineSettings, report: Any, predicted: dict[str, Any] | None) -> None:
        return None

    def calibrate(self, *args: Any) -> None:
        return None

    def wait_released(self, pids: set[int], timeout: float) -> bool:
        return True

    def room_for(self, settings: EngineSettings, snap: Any = None) -> str | None:
        return self.room


@dataclass(frozen=True)
class Seen:
    """What one tick left: the clock's time, the instances open in the gateway, and every instance as
    (name, role, revision, bridge)."""

    at: float
    open: int
    instances: tuple[tuple[str, str, int | None, bool], ...]
    awake: int = 0  # fake vLLMs of every deployment alive and not asleep (their GPU memory taken)

    def of_role(self, *roles: str) -> list[str]:
        return [name for name, role, _, _ in self.instances if role in roles]


def by_revision(scripts: dict[int, Script], default: Script | None = None) -> Callable[[Any], Script]:
    """A placement's script per start: ``scripts`` by revision id, else ``default``."""
    return lambda spec: scripts.get(spec.revision_id, default or Script())


@dataclass
class Result:
    status: int
    ok: bool  # a whole answer: 200 and, for a stream, its [DONE] with no error event
    at: float  # the clock's time it ended
    body: bytes = b""


@dataclass
class Clients:
    """Clients that each send one streamed completion after another through the gateway's data path."""

    datapath: DataPath
    clock: FakeClock
    n: int
    stream: bool = True
    model: str | None = "demo"
    prompt: Callable[[], str] = lambda: "tell me"  # each request's prompt
    results: list[Result] = field(default_factory=list)
    _stop: bool = False
    _tasks: list[asyncio.Task[None]] = field(default_factory=list)

    async def _one(self) -> Result:
        request: dict[str, Any] = {"prompt": self.prompt(), "max_tokens": 16, "stream": self.stream}
        if self.model:
            request["model"] = self.model
        body = json.dumps(request).encode()
        scope = {"type": "http", "method": "POST", "path": "/v1/completions", "raw_path": b"/v1/completions",
                 "query_string": b"", "http_version": "1.1", "scheme": "http", "server": ("testserver", 80),
                 "client": ("127.0.0.1", 40000), "headers": [(b"content-type", b"application/json"),
                                                            (b"content-length", str(len(body)).encode())]}
        answered = asyncio.Event()
        sent = False
        status = 0
        chunks: list[bytes] = []

        async def receive() -> dict[str, Any]:
            nonlocal sent
            if not sent:
                sent = True
                return {"type": "http.request", "body": body, "more_body": False}
            await answered.wait()
            return {"type": "http.disconnect"}

        async def send(message: dict[str, Any]) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            elif message["type"] == "http.response.body":
                chunks.append(message.get("body", b""))
                if not message.get("more_body"):
                    answered.set()

        await self.datapath(scope, receive, send)  # type: ignore[arg-type]
        answered.set()
        whole = b"".join(chunks)
        ok = status == 200 and (not self.stream or (b"[DONE]" in whole and b'"error"' not in whole))
        return Result(status, ok, self.clock.monotonic(), whole)

    async def _loop(self) -> None:
        while not self._stop:
            result = await self._one()
            self.results.append(result)
            # a refusal comes back at once: a client waits a moment before it asks again, as Retry-After says
            await asyncio.sleep(0 if result.ok else 0.005)

    def start(self) -> None:
        self._tasks = [asyncio.ensure_future(self._loop()) for _ in range(self.n)]

    async def stop(self, timeout: float = 5.0) -> None:
        """Let each client end the request it has under way (within ``timeout``, real seconds), then stop."""
        self._stop = True
        _, pending = await asyncio.wait(self._tasks, timeout=timeout)
        for task in pending:
            task.cancel()
        for task in self._tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await task

    @property
    def failed(self) -> list[Result]:
        return [r for r in self.results if not r.ok]


class FlakySessions:
    """The database's ways in (its sessions, its reads), failing as a database that is down fails while ``down``."""

    def __init__(self, db: Database) -> None:
        self.down = False
        for name in ("session", "read", "read_connection"):
            setattr(db, name, self._flaky(getattr(db, name)))

    def _flaky(self, real: Callable[..., Any]) -> Callable[..., Any]:
        def opened(*args: Any, **kwargs: Any) -> Any:  # (session(wait_s) takes one)
            if self.down:
                raise OperationalError("SELECT 1", None, Exception("the database is down (a test's fault)"))
            return real(*args, **kwargs)
        return opened


class Scenario:
    def __init__(self, tmp_path: Path, *, plan: PlanKind = "blue_green",
                 script: Script | Callable[[Any], Script] | None = None, nodes: list[str] | None = None,
                 values: dict[str, Any] | None = None, build: str = "cpu",
                 neighbours: dict[str, dict[str, Any]] | None = None, **config: Any) -> None:
        """``neighbours``: further deployments on the same GPU (name: their values), each with its controller,
        admission and served name (its name), sharing the room by gpu_memory_utilization (engine/serving/residency.py);
        the scenario ticks them all."""
        self.tmp_path = tmp_path
        self.neighbour_values = neighbours or {}
        self.neighbours: dict[str, Controller] = {}
        self.admissions: dict[str, Admission] = {}
        self.capacity = ScriptedCapacity(plan)
        self.clock = FakeClock()
        self.placement = FakePlacement(self.clock, script, nodes)
        self.values = values or {}
        self.build = build
        settings = {"startup_timeout_s": 300.0, "drain_timeout_s": 30.0, "stop_timeout_s": 5.0, "handover_s": 10.0,
                    "health_interval_s": 5.0, "backoff_initial_s": 2.0, "backoff_max_s": 60.0,
                    "queue_timeout_s": 30.0, "reconcile_interval_s": 0.5, **config}
        self.config = AppConfig(data_dir=make_data_dir(tmp_path / "data"), **settings)
        self.seen: list[Seen] = []  # what each tick left

    async def __aenter__(self) -> Scenario:
        self.db = open_database(migrated_sqlite(self.tmp_path))
        self.sessions = FlakySessions(self.db)
        DeploymentStore(self.db).ensure_default("demo")
        self.revisions = RevisionStore(self.db)
        self.events = EventLog(self.db)
        initial = EngineSettings.model_construct(**initial_settings(self.config.data_dir.resolve())).model_dump()
        self.revisions.ensure_initial({**initial, **self.values})
        self.admission = Admission(self.config.queue_size, self.config.queue_timeout_s, deployment_id=1,
                                   deployment="demo")
        self.controller = Controller(self.config, self.revisions, self.events, self.admission,
                                     planner=cast(Planner, self.capacity), audit=AuditLog(self.db),
                                     deployment=DeploymentRef(), placement=self.placement, clock=self.clock,
                                     build=(self.build, "0.0-fake"))  # type: ignore[arg-type]
        self.controller.room = lambda _node, settings, _index: self.capacity.room_for(settings)
        self.controller.attach()
        self.admissions["demo"] = self.admission
        for name, values in self.neighbour_values.items():
            row, _ = DeploymentStore(self.db).create(name, {**initial, **values}, author="test")
            assert row.id is not None
            admission = Admission(self.config.queue_size, self.config.queue_timeout_s, deployment_id=row.id,
                                  deployment=name)
            other = Controller(self.config, self.revisions.of(row.id), self.events.of(row.id), admission,
                               planner=cast(Planner, self.capacity), audit=AuditLog(self.db),
                               deployment=DeploymentRef(id=row.id, name=name), placement=self.placement,
                               clock=self.clock, build=(self.build, "0.0-fake"))  # type: ignore[arg-type]
            other.attach()
            self.neighbours[name] = other
            self.admissions[name] = admission
        if self.neighbours:
            self.residency = Residency(lambda: self.controllers, lambda _c, settings: {
                "gpu0": settings.gpu_memory_utilization}, lambda: {"gpu0": 1.0}, self.clock.monotonic)
            for controller in self.controllers:
                self.residency.attach(controller)
        self.gateway = Gateway(lambda model: self.admissions.get(model or "demo", self.admission),
                               self.config.upstream_timeout_s)
        keys = cast(Any, _NoKeys())
        self.datapath = DataPath(self.gateway, keys, BodyLimits(self.config.body_limit_v1_bytes,
                                                                self.config.body_timeout_s, self.config.json_max_depth))
        self._clients: list[Clients] = []
        return self

    async def __aexit__(self, *exc: object) -> None:
        for clients in self._clients:
            await clients.stop(1.0)
        for other in self.neighbours.values():
            await other.shutdown()
        await self.controller.shutdown()
        await self.gateway.aclose()
        await self.placement.close()
        self.sessions.down = False
        self.db.close()

    # --- moving time -------------------------------------------------------------------------------------------

    async def settle(self) -> None:
        """Let serving's own tasks (probes, operations, watchers) end, as they would between two real ticks."""
        for _ in range(3):
            pending = [task for c in self.controllers for task in c.pending()]
            if pending:
                await asyncio.wait(pending, timeout=SETTLE_S)
            await asyncio.sleep(0.001)

    @property
    def controllers(self) -> list[Controller]:
        return [self.controller, *self.neighbours.values()]

    def _look(self) -> None:
        awake = sum(1 for c in self.controllers for i in c.instances if i.role != "sleeping" and not i.child.exited)
        self.seen.append(Seen(self.clock.monotonic(), len(self.admission.upstreams), tuple(
            (i.name, i.role, i.revision.id, i.bridge) for i in self.controller.instances), awake))

    async def _tick_all(self) -> None:
        for controller in self.controllers:
            await controller.tick()

    async def tick(self, step_s: float = 1.0) -> None:
        """One tick of the controller, then the clock moves on by ``step_s``."""
        await self._tick_all()
        await self.settle()
        self._look()
        self.clock.advance(step_s)
        await asyncio.sleep(0)

    async def until(self, condition: Callable[[], bool], within_s: float = 900.0, step_s: float = 1.0) -> float:
        """Tick until ``condition`` holds (within ``within_s`` of the clock's seconds); the clock's time then."""
        end = self.clock.monotonic() + within_s
        while True:
            await self._tick_all()
            await self.settle()
            self._look()
            if condition():
                return self.clock.monotonic()
            if self.clock.monotonic() >= end:
                raise AssertionError(f"not within {within_s:.0f} s of the clock: {self.describe()}")
            self.clock.advance(step_s)
            await asyncio.sleep(0)

    async def ticks(self, n: int, step_s: float = 1.0) -> None:
        for _ in range(n):
            await self.tick(step_s)

    def describe(self) -> str:
        s = self.snapshot()
        return (f"state {s.state} ({s.reason}); instances {[(i.name, i.role, i.revision) for i in s.instances]}; "
                f"operation {self.controller.work_name}; apply {s.apply.outcome if s.apply else None}; "
                f"events {[e.kind for e in self.event_list()][-12:]}")

    # --- what the test does --------------------------------------------------------------------------------------

    def write(self, changes: dict[str, Any], note: str = "test") -> Revision:
        """A new desired revision: the current one's values with ``changes`` (as the settings writer would)."""
        head = self.revisions.desired_revision() or self.revisions.get_revision(self.revisions.head_revision_id() or 1)
        return self.revisions.create_revision({**head.values, **changes}, base_revision=None, author="test",
                                              note=note)

    @contextlib.asynccontextmanager
    async def clients(self, n: int = 8, stream: bool = True, prompt: Callable[[], str] | None = None,
                      model: str = "demo") -> AsyncIterator[Clients]:
        clients = Clients(self.datapath, self.clock, n, stream, model)
        if prompt is not None:
            clients.prompt = prompt
        self._clients.append(clients)
        clients.start()
        try:
            yield clients
        finally:
            await clients.stop()

    # --- what the test looks at ----------------------------------------------------------------------------------

    def snapshot(self) -> StatusOut:
        return self.controller.view.snapshot(None)

    def event_list(self, *kinds: str) -> list[Event]:
        down, self.sessions.down = self.sessions.down, False
        try:
            return list(self.events.events(limit=1000, kinds=list(kinds) or None))
        finally:
            self.sessions.down = down

    def kinds(self) -> list[str]:
        return [e.kind for e in self.event_list()]

    def serving_revision(self, revision: int | None, instances: int = 1) -> Callable[[], bool]:
        def check() -> bool:
            serving = self.controller.instances.serving()
            return len(serving) == instances and all(i.revision.id == revision and not i.bridge for i in serving) \
                and self.controller.work_name is None and len(self.controller.instances) == instances
        return check

    def apply_ended(self, revision: int | None = None) -> Callable[[], bool]:
        def check() -> bool:
            apply = self.controller.apply
            return apply is not None and apply.outcome != "running" and self.controller.work_name is None \
                and (revision is None or apply.revision == revision)
        return check

    def since(self, at: float) -> list[Seen]:
        return [s for s in self.seen if s.at >= at]

    @property
    def longest_gap(self) -> float:
        """The longest stretch of the clock with no instance open in the gateway, after the first one opened."""
        longest, since, opened = 0.0, None, False
        for seen in self.seen:
            at, up = seen.at, seen.open > 0
            if up:
                opened = True
                if since is not None:
                    longest = max(longest, at - since)
                since = None
            elif opened and since is None:
                since = at
        return longest

    @property
    def fakes(self) -> list[FakeVllm]:
        return self.placement.children

    def fake(self, name: str) -> FakeVllm:
        """The live fake instance named ``name``."""
        return next(c for c in reversed(self.placement.children) if c.name == name and not c.exited)


class _NoKeys:
    """The gateway's key check with keys off: every request passes."""

    required = False

    async def check(self, headers: list[tuple[bytes, bytes]]) -> None:
        return None
