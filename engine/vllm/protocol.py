"""The protocol of one vLLM run, whatever runs it: what to start (``ChildSpec``) and how it is driven (``Child``:
spawn, its log lines and start phases, its exit, stop). Placements (engine/placement) make children; the serving
controller (engine/serving) drives them and never looks past this protocol."""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

from engine.vllm.logs import ChildLog
from engine.vllm.phases import StartTracker
from engine.vllm_sandbox import Sandbox


@dataclass(frozen=True)
class ChildSpec:
    """What to start: vLLM's argument list and environment (from engine/vllm/command.py), its log, the
    instance's name, its API key, where it may write (its working directory), on which node, and in which
    sandbox."""

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
    sandbox: Sandbox | None = None  # what it may not open (engine/vllm_sandbox.py); None: unconfined


class Child(Protocol):
    """One run of vLLM, wherever it is: a local process (VllmChild), an actor's on a Ray node (engine/placement),
    or, in tests/serving only, the fake vLLM of tests/testkit."""

    name: str
    port: int
    revision_id: int
    api_key: str | None
    lines: deque[str]
    tracker: StartTracker
    stop_requested: bool
    on_exit: Callable[[Child], None] | None
    exited_at: float | None
    lost: str | None  # why it is gone without an exit code (its Ray actor or node died); None for a local one

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
