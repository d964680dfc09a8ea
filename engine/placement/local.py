"""Local placement: every instance a child process of the engine, on its own host (today's default)."""

from __future__ import annotations

import os
import socket

import psutil

from engine.placement.base import NodeInfo
from engine.vllm import Child, ChildSpec, VllmChild


class LocalPlacement:
    kind = "local"

    def nodes(self) -> list[NodeInfo]:
        return [NodeInfo(id="local", address=socket.gethostname(), head=True, cpus=float(os.cpu_count() or 0),
                         memory_bytes=int(psutil.virtual_memory().total))]

    def child(self, spec: ChildSpec) -> Child:
        return VllmChild(spec.args, spec.env, spec.port, spec.revision_id, spec.log, spec.pidfile, name=spec.name,
                         cwd=spec.cwd, api_key=spec.api_key, sandbox=spec.sandbox)

    def place(self, index: int, taken: list[str | None], gpus: int = 0) -> str | None:
        return None

    def alive(self, node: str | None) -> bool:
        return True

    def is_suspect(self, node: str) -> bool:
        return False

    async def close(self) -> None:
        return None
