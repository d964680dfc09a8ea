"""Where a vLLM instance runs: one interface, two backends.

- ``local`` (engine/placement/local.py): a child process of the engine (engine/vllm/child.py). The default; its
  path never imports Ray.
- ``ray`` (engine/placement/cluster.py, engine/placement/actor.py): an actor pinned to a node of a Ray cluster
  starts vLLM there in its own process group, streams its log lines back and reports its address; the death of
  the actor or of its node is the instance's crash.

The serving controller asks a placement for a ``Child`` (engine/vllm/protocol.py; not started) on a node, and
drives it the same way whatever the backend: spawn, its lines, its exit, stop.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

from engine.errors import EngineError
from engine.vllm import Child, ChildSpec


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
