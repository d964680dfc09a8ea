"""The instances of one deployment, each with an explicit state of its own, and the registry that holds them.

An instance is one vLLM run (its ``child``, engine/vllm) of one revision, in one role at a time:

    starting ──ready──▶ serving (bridge) ──close──▶ draining ──▶ stopping ──▶ (gone)
        │                   │                                       ▲
        └──exit/abort──▶ stopping          exit ──▶ failed ─────────┘
                            serving ──sleep──▶ sleeping ──wake──▶ serving

Only the launcher (engine/serving/launcher.py) moves an instance from one role to the next; the controller and the
plans read roles and ask the launcher. What a start turned out to be is its ``verdict``, given once by the health
room (engine/serving/health.py).
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

from engine.db import Revision
from engine.gateway import Upstream
from engine.revisions import EngineSettings
from engine.schemas import InstanceRole
from engine.serving.eta import Eta
from engine.vllm import Child

NAMES = "abcdefghijklmnopqrstuvwxyz"


@dataclass(frozen=True)
class Verdict:
    """How a start ended: ready, or not (why, after how long, vLLM's exit code); ``aborted`` when the engine gave
    it up (a newer revision, a stop) rather than vLLM failing; ``lost`` when its node or actor went away."""

    ready: bool
    reason: str
    seconds: float
    exit_code: int | None = None
    aborted: bool = False
    lost: bool = False


@dataclass
class Drain:
    """A drain under way: since when, until when at most, and how many requests it began with."""

    since: float
    deadline: float
    in_flight: int
    upstreams: list[Upstream]
    reason: str
    watcher: asyncio.Task[None] | None = field(default=None, repr=False)  # wakes the controller once it is over

    def over(self) -> None:
        if self.watcher is not None:
            self.watcher.cancel()


@dataclass(eq=False)
class Instance:
    """One vLLM instance: its process, the revision (and settings: a bridge's are the old revision's, smaller) it
    runs, its role, and the GPUs and node it is pinned to."""

    name: str
    child: Child
    revision: Revision
    settings: EngineSettings
    role: InstanceRole = "starting"
    device: str | None = None
    bridge: bool = False
    index: int = 0  # the replica it is (where the placement put it)
    since: float = 0.0  # wall-clock time it took its role
    eta: Eta | None = None  # what its start should take, by its kind (eta.kind)
    compile_key: str = ""  # its settings and environment as vLLM's compile cache sees them
    predicted: dict[str, Any] | None = None
    launched_seqs: int = 0  # the max_num_seqs vLLM was started with (its ceiling)
    kv_tokens: int | None = None  # its KV cache's size as vLLM logged it (routing's index is bounded by it)
    lowered: bool = False  # started at start_beside_nice (beside one that serves): raised to vllm_nice once it serves
    abortable: bool = True  # a newer revision or a stop gives its start up (not a revision brought back)
    launched_at: float = 0.0  # monotonic: when it was spawned (its start's deadline runs from here)
    in_flight_at_launch: int = 0
    ready_at: float | None = None  # wall-clock time it became ready
    verdict: Verdict | None = None
    upstream: Upstream | None = None  # its place in the gateway while it takes traffic
    drain: Drain | None = None
    handover: asyncio.Task[None] | None = field(default=None, repr=False)  # wakes the controller once it is over
    health_failures: int = 0
    last_health: float = 0.0  # monotonic: its latest /health probe (serving)
    last_probe: float | None = None  # monotonic: its latest readiness probe (starting)
    stop_reason: str | None = None
    gone: bool = False  # stopped and forgotten
    sleep_error: str | None = None  # why it would not sleep (set when a sleep ended without one)
    woken: bool | None = None  # how its wake-up ended (None: none asked, or under way)
    op: asyncio.Task[None] | None = field(default=None, repr=False)  # its slow operation under way (stop, sleep, wake)
    op_error: BaseException | None = None

    @property
    def serving(self) -> bool:
        """It takes traffic (a bridge does too)."""
        return self.role in ("serving", "bridge")

    @property
    def busy(self) -> bool:
        """An operation (a stop, a sleep, a wake-up) is under way on it."""
        return self.op is not None and not self.op.done()


class Instances:
    """The registry of one deployment's instances, in the order they were launched. Read from the API's threads
    (a copy of the list is taken), written on the event loop only."""

    def __init__(self) -> None:
        self._items: list[Instance] = []

    def __iter__(self) -> Iterator[Instance]:
        return iter(list(self._items))

    def __len__(self) -> int:
        return len(self._items)

    def __bool__(self) -> bool:
        return bool(self._items)

    def __contains__(self, inst: object) -> bool:
        return inst in self._items

    def all(self) -> list[Instance]:
        return list(self._items)

    def add(self, inst: Instance) -> None:
        self._items.append(inst)

    def remove(self, inst: Instance) -> None:
        if inst in self._items:
            self._items.remove(inst)

    def serving(self) -> list[Instance]:
        return [i for i in self._items if i.serving]

    def starting(self) -> list[Instance]:
        return [i for i in self._items if i.role == "starting"]

    def free_name(self) -> str:
        used = {i.name for i in self._items}
        return next(n for n in NAMES if n not in used)

    @property
    def primary(self) -> Instance | None:
        """The instance that stands for the deployment: a serving one of the revision (not a bridge), else a
        bridge, else any."""
        items = list(self._items)
        return (next((i for i in items if i.role == "serving"), None)
                or next((i for i in items if i.role == "bridge"), None)
                or (items[0] if items else None))

    def text(self) -> str:
        """What serves now, as the state's reason says it."""
        serving = self.serving()
        if not serving:
            return "nothing serves"
        revisions = sorted({i.revision.id or 0 for i in serving if not i.bridge}) or \
            sorted({i.revision.id or 0 for i in serving})
        return (f"revision {', '.join(map(str, revisions))} serving on instance"
                f"{'s' if len(serving) > 1 else ''} {', '.join(i.name for i in serving)}")
