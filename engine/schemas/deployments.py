"""Deployments: several models served by one engine, each under its own name (the ``model`` clients send)."""

from __future__ import annotations

import re
from datetime import datetime
from typing import Annotated

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, JsonValue

from engine.schemas.common import EngineState
from engine.schemas.gpu import GpuView, HostReading

# A deployment's name is the model clients send, part of the console's and the API's addresses and shown as text:
# the user-name rules (ASCII letters, digits, '_', '.', '-'), no '..' (a name was accepted as '..', '/', a URL or a
# ':shortcode:' that the console rendered as an emoji). Look-alikes of an existing name are refused on creation.
NAME_RULE = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,63}")


def check_deployment_name(name: str) -> str:
    if not NAME_RULE.fullmatch(name) or ".." in name:
        raise ValueError("a deployment's name is 1 to 64 ASCII letters, digits, '_', '.' and '-', starting with a "
                         "letter or digit, without '..' (it is the model name clients send and part of addresses)")
    return name


DeploymentName = Annotated[str, AfterValidator(check_deployment_name)]


class DeploymentIn(BaseModel):
    """A new deployment: its name and the settings of its first revision (omitted fields take the defaults)."""

    model_config = ConfigDict(strict=True)

    name: DeploymentName = Field(description="The model name clients send (and vLLM's --served-model-name).")
    values: dict[str, JsonValue] = Field(max_length=64, description="Settings of its first revision; `model` is "
                                         "required (a folder under the model roots, or a hub id in the cache).")
    gpus: list[int] | None = Field(None, max_length=64, description="GPU indices it runs on (None: placed by the "
                                   "capacity model on the GPU with the most room).")
    enabled: bool = True
    note: str = Field("", max_length=500)
    force: bool = Field(False, description="Create it past pre-flight errors (recorded).")


class DeploymentPatch(BaseModel):
    model_config = ConfigDict(strict=True)

    enabled: bool | None = None
    gpus: list[int] | None = Field(None, max_length=64)
    any_gpu: bool = Field(False, description="Clear the placement: run on any GPU (gpus must be null).")
    price_input_per_1k: float | None = Field(None, ge=0, le=1e6, allow_inf_nan=False, description="What 1,000 "
                                             "prompt tokens cost on it (GET /api/usage prices usage by it; null "
                                             "clears it; absent: unchanged).")
    price_output_per_1k: float | None = Field(None, ge=0, le=1e6, allow_inf_nan=False, description="What 1,000 "
                                              "completion tokens cost on it.")


class DeploymentMemory(BaseModel):
    """What the deployment's instances hold now, per GPU (or on the host for the CPU build)."""

    device: str = Field(description="GPU index, or 'host'")
    bytes: int


class DeploymentOut(BaseModel):
    id: int
    name: str
    default: bool = Field(description="today's /api routes act on this one")
    enabled: bool
    gpus: list[int] | None
    created_at: datetime
    created_by: str
    note: str
    state: EngineState
    reason: str
    model: str | None = Field(description="the desired revision's model (folder or hub id)")
    running_revision: int | None
    desired_revision: int | None
    instances: int
    serving: int = Field(description="instances the gateway sends to")
    price_input_per_1k: float | None = None
    price_output_per_1k: float | None = None
    memory: list[DeploymentMemory] = Field(default_factory=list)


class DeletionOut(BaseModel):
    """What deleting a deployment removes (the audit trail keeps every record of it)."""

    name: str
    revisions: int
    events: int
    benchmarks: int
    requests: int


class AvailableModel(BaseModel):
    """A model a deployment can be created from: a folder under a model root, or a hub model in the cache."""

    value: str = Field(description="what to put in `model`")
    source: str = Field(description="'local' or 'hf-cache'")
    architecture: str | None = None
    parameters: int | None = None
    max_position_embeddings: int | None = None
    used_by: list[str] = Field(default_factory=list, description="deployments serving it now")


class ModelsListOut(BaseModel):
    models: list[AvailableModel]
    roots: list[str]


class CreatedDeploymentOut(DeploymentOut):
    revision: int
    warnings: list[dict[str, JsonValue]] = Field(default_factory=list)


class FleetInstance(BaseModel):
    deployment: str
    name: str
    role: str
    revision: int | None
    address: str | None
    serving: bool


class NodeOut(BaseModel):
    """A machine of the fleet: the engine's host (local placement) or a node of the Ray cluster, its GPUs (or its
    host reading where it has none), and the instances on it."""

    id: str
    address: str
    alive: bool
    head: bool
    cpus: float
    gpus: float
    memory_bytes: int
    telemetry: bool = Field(description="its sampler answered this round")
    suspect: bool = Field(False, description="an instance on it was lost lately: nothing new is placed there for "
                          "a while, though Ray may still list it alive")
    gpu_readings: list[GpuView] = Field(default_factory=list)
    host: HostReading | None = None
    instances: list[FleetInstance] = Field(default_factory=list)


class FleetOut(BaseModel):
    placement: str = Field(description="'local' (child processes of the engine) or 'ray'")
    nodes: list[NodeOut]


class AdapterIn(BaseModel):
    """A LoRA adapter to register under a deployment: a folder in PEFT's layout (adapter_config.json and
    adapter_model.safetensors) inside the folders models may come from."""

    model_config = ConfigDict(strict=True, extra="forbid")

    name: str = Field(min_length=1, max_length=128, description="The model name clients call it by on /v1.")
    path: str = Field(min_length=1, max_length=4096, description="The adapter's folder (absolute, or under the "
                      "data dir).")


class AdapterOut(BaseModel):
    name: str
    deployment: str
    base: str | None = Field(description="The model it adapts: the deployment's served model name.")
    path: str
    rank: int
    alpha: float
    target_modules: list[str]
    base_model: str = Field(description="The base its adapter_config.json names (as trained).")
    size_bytes: int
    created_at: datetime
    created_by: str
    listed: bool = Field(description="Called by its name on /v1 now (every instance that serves has it).")
    loaded_on: list[str] = Field(description="The instances that said they have it, at the last look.")
    failure: str | None = Field(None, description="Why its last load on an instance failed (tried again).")
    requests_24h: int = 0
    input_tokens_24h: int = 0
    output_tokens_24h: int = 0
    errors_24h: int = 0
