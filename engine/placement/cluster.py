"""Ray placement: the engine is a Ray driver (``LLMOPS_RAY_ADDRESS``); each vLLM instance is started on a node by
an actor pinned there (engine/placement/actor.py), which streams its log lines back and reports its address. The
actor's death, or its node's, is the instance's crash: seen at once (the actor's ``wait`` fails), the gateway
stops sending to it, and the controller starts it again on a node with room.

Imported only when a Ray address is configured: the local path (``make run``) never imports Ray.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections import deque
from collections.abc import Callable
from pathlib import Path
from typing import Any

import ray
from ray.exceptions import GetTimeoutError, RayActorError, RayError
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from engine.placement.actor import NodeAgentImpl, VllmProcessImpl
from engine.placement.base import NodeInfo, PlacementError
from engine.placement.ray_auth import OPEN_MESSAGE, require_token
from engine.vllm import ChildLog, ChildSpec, StartTracker

log = logging.getLogger("llmops.placement")
NAMESPACE = "llmops"
PROBE_EVERY_S = 0.25  # how often an instance's port is tried (a TCP connect: no request, nothing in vLLM's log)
EXIT_GRACE_S = 0.3  # after a refused connect, how long the actor has to report vLLM's exit (and its code) first
PROBE_TIMEOUT_S = 1.0  # a connect unanswered this long counts as one failure; two in a row are a loss
SUSPECT_S = 120.0  # a node whose instance was lost gets nothing new for this long (or until Ray says it is back)
VllmProcess = ray.remote(num_cpus=0, max_concurrency=8)(VllmProcessImpl)
NodeAgent = ray.remote(num_cpus=0, max_concurrency=4)(NodeAgentImpl)


class RayPlacement:
    kind = "ray"

    def __init__(self, address: str, sample_interval_s: float = 1.0, allow_unauthenticated: bool = False) -> None:
        # an open cluster runs code for anyone on its network: refused before the engine joins it, unless allowed
        self.auth = require_token(address, allow_unauthenticated)
        self.warning: str | None = None  # said in the log and as an event: an open cluster allowed, or one not told
        if self.auth.verdict == "open":
            self.warning = "accepted anyway (ray_allow_unauthenticated): " + OPEN_MESSAGE.format(address=address)
        elif self.auth.verdict == "unknown":
            self.warning = (f"could not tell whether the Ray cluster at {address} asks for a token "
                            f"({self.auth.detail[:300] or 'no answer'}): make sure every node runs with "
                            "RAY_AUTH_MODE=token (docs/fleet.md)")
        if self.warning:
            log.warning("%s", self.warning)
        if not ray.is_initialized():
            ray.init(address=address, namespace=NAMESPACE, log_to_driver=False, configure_logging=False)
        self.address = address
        self.sample_interval_s = sample_interval_s
        self.own_node = str(ray.get_runtime_context().get_node_id())  # the engine's own host, when in the cluster
        # nodes whose instance stopped answering: Ray may list them alive for a while yet; nothing goes there
        self._suspect: dict[str, float] = {}
        self._agents: dict[str, Any] = {}

    def nodes(self) -> list[NodeInfo]:
        """The cluster's nodes as Ray sees them (dead ones included, marked)."""
        out = []
        for n in ray.nodes():
            res = n.get("Resources") or {}
            out.append(NodeInfo(id=str(n["NodeID"]), address=str(n.get("NodeManagerAddress") or ""),
                                alive=bool(n.get("Alive")), head="node:__internal_head__" in res,
                                cpus=float(res.get("CPU", 0)), gpus=float(res.get("GPU", 0)),
                                memory_bytes=int(res.get("memory", 0)),
                                labels={k: str(v) for k, v in (n.get("Labels") or {}).items()}))
        return sorted(out, key=lambda node: (not node.head, node.id))

    def child(self, spec: ChildSpec) -> RayChild:
        if spec.node is None:
            raise PlacementError("a Ray instance needs a node: the planner found none with room")
        return RayChild(spec, on_lost=self.suspect, own_node=self.own_node)

    def suspect(self, node: str) -> None:
        """An instance on ``node`` stopped answering: place nothing there for a while (Ray's view may lag)."""
        self._suspect[node] = time.monotonic() + SUSPECT_S

    def is_suspect(self, node: str) -> bool:
        """Whether an instance on ``node`` was lost lately, so nothing new is placed there yet."""
        until = self._suspect.get(node)
        return until is not None and until >= time.monotonic()

    def _usable(self, node: NodeInfo) -> bool:
        until = self._suspect.get(node.id)
        return node.alive and (until is None or until < time.monotonic())

    def place(self, index: int, taken: list[str | None], gpus: int = 0) -> str | None:
        """Replica ``index``'s node: an alive one (with ``gpus`` GPUs, if it needs them) running the fewest of
        this deployment's instances, the head first among equals."""
        alive = [n for n in self.nodes() if self._usable(n) and n.gpus >= gpus]
        if not alive:
            raise PlacementError("no alive node of the Ray cluster" + (f" has {gpus} GPU(s)" if gpus else ""))
        return min(alive, key=lambda n: (taken.count(n.id), 0 if alive.index(n) == index % len(alive) else 1,
                                         alive.index(n))).id

    def alive(self, node: str | None) -> bool:
        return node is not None and any(n.id == node and self._usable(n) for n in self.nodes())

    def agent(self, node: str) -> Any:
        """The node's telemetry agent (started on first use, one per node, found again by name)."""
        found = self._agents.get(node)
        if found is None:
            found = NodeAgent.options(name=f"llmops-agent-{node}", get_if_exists=True, lifetime="detached",
                                      scheduling_strategy=NodeAffinitySchedulingStrategy(node, soft=False)
                                      ).remote(self.sample_interval_s)
            self._agents[node] = found
        return found

    def snapshots(self, attribute: dict[str, dict[int, str | None]], timeout: float = 2.0) -> dict[str, Any]:
        """Each alive node's telemetry now, its vLLM processes attributed (from a thread: it waits on the
        cluster). A node that does not answer in time is left out of this round, not waited for."""
        refs: dict[str, Any] = {}
        for info in [n for n in self.nodes() if n.alive]:
            agent = self.agent(info.id)
            agent.attribute.remote(attribute.get(info.id, {}))
            refs[info.id] = agent.snapshot.remote()
        out: dict[str, Any] = {}
        for node_id, ref in refs.items():
            try:
                out[node_id] = ray.get(ref, timeout=timeout)
            except (GetTimeoutError, RayError) as exc:
                log.warning("node %s gave no telemetry: %s", node_id, exc)
                self._agents.pop(node_id, None)
        return out

    async def close(self) -> None:
        return None


class RayChild:
    """One vLLM instance on a Ray node, driven like a local child (engine/placement/base.py Child)."""

    def __init__(self, spec: ChildSpec, on_lost: Callable[[str], None] = lambda _: None,
                 own_node: str | None = None) -> None:
        self.spec = spec
        self.own_node = own_node  # the engine's node: an instance placed there is a process of this host
        self.on_lost = on_lost  # told the node of an instance lost without an exit
        self.name = spec.name
        self.port = 0
        self.revision_id = spec.revision_id
        self.api_key = spec.api_key
        self.log: ChildLog = spec.log
        self.lines: deque[str] = deque(maxlen=5000)
        self.tracker = StartTracker()
        self.stop_requested = False
        self.on_exit: Callable[[Any], None] | None = None
        self.exited_at: float | None = None
        self.lost: str | None = None  # why the instance is gone without an exit code (its actor or node died)
        self._actor: Any = None
        self._address = ""
        self._pid: int | None = None
        self._code: int | None = None
        self._tasks: list[asyncio.Task[None]] = []
        self._node = spec.node

    @property
    def url(self) -> str:
        return f"http://{self._address}:{self.port}"

    @property
    def headers(self) -> dict[str, str]:
        return {"authorization": f"Bearer {self.api_key}"} if self.api_key else {}

    @property
    def pid(self) -> int | None:
        return self._pid

    @property
    def returncode(self) -> int | None:
        return self._code

    @property
    def exited(self) -> bool:
        return self.exited_at is not None

    @property
    def started(self) -> bool:
        return self._actor is not None

    @property
    def local(self) -> bool:
        """On the engine's own node its processes are this host's: the host's sampler attributes their GPU memory
        to the deployment (else pre-flight counted an instance's own memory as another process's, measured on the
        H200), and a stop waits for that memory to be released."""
        return self._node is not None and self._node == self.own_node

    @property
    def node(self) -> str | None:
        return self._node

    def remember_descendants(self) -> None:
        """Its processes are its node's: the actor and its guard stop them."""

    async def spawn(self) -> None:
        spec = self.spec
        assert spec.node is not None
        options: dict[str, Any] = {"scheduling_strategy": NodeAffinitySchedulingStrategy(spec.node, soft=False),
                                   "name": None}
        if spec.gpus:
            options["num_gpus"] = spec.gpus
        self.log.new_run(f"instance {self.name}, revision {self.revision_id} on node {spec.node[:12]}: "
                         f"{' '.join(spec.args)}")
        self._actor = VllmProcess.options(**options).remote(self.name)
        try:
            info = await self._actor.start.remote(spec.args, spec.env, None, sandbox=spec.sandbox)
        except RayError as exc:  # its node went away meanwhile, or cannot start it: a failed start, not a crash
            self.lost = f"could not start on node {spec.node[:12]}: {type(exc).__name__}"
            self.on_lost(spec.node)
            self._gone()
            return
        self._pid, self._address, self.port = int(info["pid"]), str(info["address"]), int(info["port"])
        self.tracker = StartTracker(time.monotonic())
        loop = asyncio.get_running_loop()
        self._tasks = [loop.create_task(self._pump(), name=f"ray-log-{self.name}"),
                       loop.create_task(self._watch(), name=f"ray-exit-{self.name}"),
                       loop.create_task(self._probe(), name=f"ray-probe-{self.name}")]

    async def _pump(self) -> None:
        index = 0
        while True:
            try:
                index, lines, _ = await self._actor.read.remote(index)
            except RayError:
                return  # the actor is gone: _watch says so
            for line in lines:
                self.lines.append(line)
                self.log.write(f"[{self.name}] {line}")
                self.tracker.feed(line)
            if self.exited and not lines:
                return
            await asyncio.sleep(0.2)

    async def _watch(self) -> None:
        """The exit of vLLM, or the death of its actor or node, the moment it is known."""
        try:
            self._code = await self._actor.wait.remote()
        except RayActorError as exc:  # the actor died: killed, or its node lost
            self.lost = f"its Ray actor died ({type(exc).__name__}): the node may be lost"
            self.on_lost(self.spec.node or "")
        except RayError as exc:
            self.lost = f"the cluster could not say ({type(exc).__name__}: {exc})"
        self._gone()

    async def _probe(self) -> None:
        """Its port, watched from here: a lost node's actor is declared dead only once Ray's health checks give up
        on the node (seconds to a minute), while its vLLM stops answering at once. Once the port has answered, a
        refused connection is its loss (nothing listens there any more: its process is gone, as when the node's
        guard killed it), as are two unanswered connects in a row (a host gone from the network; one alone may be a
        busy host)."""
        answered, unanswered = False, 0
        while not self.exited:
            why = ""
            try:
                async with asyncio.timeout(PROBE_TIMEOUT_S):
                    _, writer = await asyncio.open_connection(self._address, self.port)
                writer.close()
                with contextlib.suppress(OSError):
                    await writer.wait_closed()
                answered, unanswered = True, 0
            except ConnectionRefusedError:
                if answered:  # the process may have exited on its own: its exit code, when the actor says, is better
                    await asyncio.sleep(EXIT_GRACE_S)
                    why = "refused a connection"
            except (OSError, TimeoutError):
                unanswered += 1 if answered else 0
                why = f"did not answer {unanswered} connects in a row" if unanswered >= 2 else ""
            if why and not self.stop_requested and not self.exited:
                self.lost = f"its port {self._address}:{self.port} {why}: its process or node is gone"
                self.on_lost(self.spec.node or "")
                self._gone()
                return
            await asyncio.sleep(PROBE_EVERY_S)

    def _gone(self) -> None:
        if self.exited_at is None:
            self.exited_at = time.monotonic()
            if self.on_exit is not None:
                self.on_exit(self)

    async def stop(self, timeout: float) -> float:
        t0 = time.monotonic()
        self.stop_requested = True
        if self._actor is None:
            return 0.0
        if self.lost is None:  # a lost actor has nothing left to stop
            with contextlib.suppress(RayError, TimeoutError):
                await asyncio.wait_for(self._actor.stop.remote(timeout), timeout + 10)
        with contextlib.suppress(RayError):
            ray.kill(self._actor, no_restart=True)
        for task in self._tasks:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(asyncio.shield(task), 5)
        Path(self.spec.pidfile).unlink(missing_ok=True)
        return time.monotonic() - t0
