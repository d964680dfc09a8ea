"""Where a vLLM instance runs: one interface, two backends.

- ``local`` (engine/placement/local.py): a child process of the engine (engine/serving/child.py). The default; its
  path never imports Ray.
- ``ray`` (engine/placement/ray.py): an actor pinned to a node of a Ray cluster starts vLLM there in its own
  process group, streams its log lines back and reports its address; the death of the actor or of its node is the
  instance's crash.

The supervisor asks a placement for a ``Child`` (not started) on a node, and drives it the same way whatever the
backend: spawn, its lines, its exit, stop.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Protocol

from engine.errors import EngineError

if TYPE_CHECKING:  # serving drives placements: it is imported by them only for types
    from engine.serving.logs import ChildLog
    from engine.serving.startup import StartTracker


class PlacementError(EngineError):
    """An instance could not be placed (no node, or no room on any): the message says which and why."""


@dataclass(frozen=True)
class NodeInfo:
    """A machine instances can run on: the engine's own host (local placement), or a node of the Ray cluster."""

    id: str
    address: str
    alive: bool = True
    head: bool = False
    cpus: float = 0.0
    gpus: float = 0.0
    memory_bytes: int = 0
    labels: dict[str, str] = field(default_factory=dict)


@dataclass(frozen=True)
class ChildSpec:
    """What to start: vLLM's argument list and environment (from engine/serving/command.py), its log, the
    instance's name, its API key, where it may write (its working directory) and on which node."""

    args: list[str]
    env: dict[str, str]
    port: int
    revision_id: int
    log: ChildLog
    pidfile: Path
    name: str
    cwd: Path | None
    api_key: str | None
    node: str | None = None
    gpus: int = 0  # GPUs the instance takes on its node (Ray reserves them)


class Child(Protocol):
    """One run of vLLM, wherever it is (engine/serving/child.py VllmChild is the local one)."""

    name: str
    port: int
    revision_id: int
    api_key: str | None
    lines: deque[str]
    tracker: StartTracker
    stop_requested: bool
    on_exit: Callable[[Child], None] | None
    exited_at: float | None

    @property
    def url(self) -> str: ...

    @property
    def headers(self) -> dict[str, str]: ...

    @property
    def pid(self) -> int | None: ...

    @property
    def returncode(self) -> int | None: ...

    @property
    def exited(self) -> bool: ...

    @property
    def started(self) -> bool: ...

    @property
    def local(self) -> bool: ...

    @property
    def node(self) -> str | None: ...

    async def spawn(self) -> None: ...

    async def stop(self, timeout: float) -> float: ...

    def remember_descendants(self) -> None: ...


class Placement(Protocol):
    kind: str

    def nodes(self) -> list[NodeInfo]: ...

    def child(self, spec: ChildSpec) -> Child: ...

    def place(self, index: int, taken: list[str | None], gpus: int = 0) -> str | None:
        """The node for replica ``index`` of a deployment whose other instances run on ``taken`` (None: the
        engine's host); ``gpus``: how many it needs there."""
        ...

    def alive(self, node: str | None) -> bool:
        """Whether instances can run on ``node`` now."""
        ...

    def is_suspect(self, node: str) -> bool:
        """Whether an instance on ``node`` was lost lately, so nothing new is placed there yet."""
        ...

    async def close(self) -> None: ...
