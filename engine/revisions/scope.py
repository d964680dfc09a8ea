"""Which deployment a serving controller serves: its id and name, where its instances may run, and what its files are
called. The registry (engine/deployments) owns these and keeps them current; the serving controller and the capacity
planner only read them."""

from __future__ import annotations

from dataclasses import dataclass, field

from engine.db import DEFAULT_DEPLOYMENT


@dataclass
class DeploymentRef:
    id: int = DEFAULT_DEPLOYMENT
    name: str = "demo"
    gpus: list[int] | None = None  # GPU indices its instances run on (None: any, as CUDA_VISIBLE_DEVICES is)
    neighbours: list[str] = field(default_factory=list)  # other deployments serving on this host, by name

    @property
    def default(self) -> bool:
        return self.id == DEFAULT_DEPLOYMENT

    @property
    def log_name(self) -> str:
        """vLLM's log of this deployment under DATA_DIR/logs (the default one keeps today's vllm.log)."""
        return "vllm.log" if self.default else f"vllm-d{self.id}.log"

    def pidfile_name(self, instance: str) -> str:
        return f"vllm-{instance}.json" if self.default else f"vllm-d{self.id}-{instance}.json"
