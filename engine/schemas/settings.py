"""Settings of a revision as they cross the API: each field documented once (the CLI's help and the console's help
text come from these descriptions). Validation that needs the engine's host (model folders, allowed roots, vLLM's
flags) is added by engine/revisions on top of these fields."""

from __future__ import annotations

from datetime import datetime
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, JsonValue

from engine.schemas.common import FitValue


class SettingsValues(BaseModel):
    """The values of one settings revision: what vLLM is started with."""

    model_config = ConfigDict(extra="ignore", protected_namespaces=())

    model: str = Field(
        description="Model to serve: a local folder with config.json (absolute, or relative to the data dir) "
        "or a Hugging Face hub id such as org/name.",
        min_length=1,
        max_length=512,
    )
    served_model_name: str = Field(
        "demo", description="Name that clients pass as `model` in /v1 requests."
    )
    gpu_memory_utilization: float = Field(
        0.85,
        gt=0,
        le=1,
        description="Fraction of each GPU's memory vLLM may use for weights, activations and KV cache. "
        "0.80-0.85 is the safe production range; above 0.90 leaves little headroom and risks OOM.",
    )
    max_model_len: int | None = Field(
        None,
        ge=16,
        le=10_000_000,
        description="Longest request (prompt + output) in tokens. Empty: the model's own maximum. "
        "Each running request may need this much KV cache.",
    )
    max_num_seqs: int = Field(
        16, ge=1, le=4096, description="Most requests vLLM runs at once in a batch (continuous batching). Held by "
        "the gateway for each instance: a change up to max_num_seqs_ceiling takes effect within a second, without a "
        "restart (vLLM's KV cache does not depend on it, only its scheduler's batch does)."
    )
    max_num_seqs_ceiling: int | None = Field(
        None, ge=1, le=4096, description="max_num_seqs vLLM itself is started with: the headroom within which "
        "max_num_seqs can change without a restart (the gateway holds each instance to max_num_seqs). Empty: "
        "max_num_seqs itself, so nothing changes unless you ask for headroom. vLLM captures CUDA graphs for batches "
        "up to twice the ceiling (at most 512 tokens) and the cap keeps them, where vLLM restarted with the cap "
        "has fewer (an 8B model on an H200, a cap of 128 under 256: 1.20 x the throughput of a restart with 128), "
        "for CUDA-graph memory outside the KV cache (0.59 GiB at 256, 0.41 at 128) and a second or two of start."
    )
    tensor_parallel_size: int = Field(
        1, ge=1, le=64, description="GPUs one model is split across; must divide the attention heads."
    )
    pipeline_parallel_size: int = Field(
        1, ge=1, le=64, description="Stages one model is split across in depth (pipeline parallel): "
        "tensor_parallel_size x pipeline_parallel_size GPUs per instance. A model larger than one node runs across "
        "several on a Ray cluster (LLMOPS_RAY_ADDRESS), through vLLM's own Ray executor; tensor-parallel groups stay "
        "inside a node.",
    )
    replicas: int = Field(
        1, ge=1, le=16, description="vLLM instances of this revision behind the gateway (as `routing` chooses among "
        "them). On a multi-GPU host each gets its own GPUs (tensor_parallel_size each); with 2 or more an apply "
        "replaces one at a time while the others serve.",
    )
    min_replicas: int = Field(
        1, ge=1, le=16, description="Autoscaling (with max_replicas): the fewest replicas while anyone calls "
        "(scale_to_zero_after_s takes an idle deployment below it). Changed without a restart.",
    )
    max_replicas: int | None = Field(
        None, ge=1, le=16, description="Autoscaling: the most replicas the engine starts when the requests in flight "
        "per replica stay above target_in_flight for scale_up_delay_s; it drains and stops one (never a request "
        "lost) when they stay below for scale_down_delay_s. `replicas` is then the count it starts with. A replica is "
        "added only where pre-flight says it fits beside its neighbours. Empty: `replicas` is fixed. Changed without "
        "a restart.",
    )
    target_in_flight: float | None = Field(
        None, gt=0, le=4096, description="Autoscaling's target: requests in flight per replica (running in vLLM "
        "and waiting in the gateway), averaged over the last 5 s. Empty: 0.75 x max_num_seqs.",
    )
    target_queue_wait_s: float | None = Field(
        None, gt=0, le=3600, description="Autoscaling on queue wait instead (an SLO): a replica more when a request "
        "waited longer than this in the gateway's queue for a free slot (or waits that long now) over the last 5 s, "
        "for scale_up_delay_s; one fewer only when none waited and one replica fewer would carry the requests in "
        "flight within target_in_flight. Empty: requests in flight per replica is the target.",
    )
    scale_up_delay_s: float = Field(
        10.0, ge=0, le=3600, description="How long the load must stay above the target before a replica is added.",
    )
    scale_down_delay_s: float = Field(
        60.0, ge=0, le=86_400, description="How long the load must stay below what one replica fewer would carry "
        "before one is drained and stopped.",
    )
    scale_to_zero_after_s: float | None = Field(
        None, ge=5, le=604_800, description="Scale to zero: after this many seconds with no request, every instance "
        "goes to sleep (CUDA with sleep mode: vLLM's sleep level 1, weights to host memory, back in about a second) "
        "or stops (the CPU build, or sleep mode off: the next request waits for a cold start). The first request "
        "then waits in the gateway's queue (queue_timeout_s) while it wakes, and is answered. Empty: never.",
    )
    routing: Literal["prefix", "least_outstanding"] = Field(
        "prefix", description="How the gateway chooses among the instances that serve (2 or more replicas, or the "
        "old and the new one during an apply). prefix: a request goes where the longest start of its prompt was "
        "sent before (that instance's prefix cache holds it), unless that instance has more than its share of the "
        "requests in flight (1.25 x) or a full KV cache; a prompt seen nowhere goes to its home by hashing, so "
        "prompts that begin alike go together. least_outstanding: the instance with the fewest requests in flight. "
        "Changed without a restart.",
    )
    dtype: Literal["auto", "bfloat16", "float16", "float32"] = Field(
        "auto", description="Data type of weights and activations. auto: the model's own."
    )
    max_num_batched_tokens: int | None = Field(
        None, ge=1, le=10_000_000, description="Most tokens processed in one scheduler step. Empty: vLLM's default."
    )
    enforce_eager: bool = Field(
        False, description="Skip CUDA graphs and torch.compile: starts faster and uses less memory, runs slower."
    )
    enable_prefix_caching: bool = Field(
        True, description="Reuse the KV cache of shared prompt prefixes across requests."
    )
    kv_cache_dtype: Literal["auto", "float16", "bfloat16", "fp8", "fp8_e4m3", "fp8_e5m2"] = Field(
        "auto", description="Data type of the KV cache. fp8 halves its size (more tokens fit) at some accuracy cost."
    )
    load_format: Literal[
        "auto", "safetensors", "pt", "dummy", "gguf", "bitsandbytes", "fastsafetensors", "sharded_state",
        "runai_streamer",
    ] = Field("auto", description="How weights are loaded. dummy: random weights of the right shape (testing).")
    trust_remote_code: bool = Field(
        False, description="Run model code shipped with the model repository. Only for models you trust."
    )
    cpu_kv_cache_gib: float = Field(
        1.0,
        gt=0,
        le=4096,
        description="CPU build of vLLM only: memory reserved for the KV cache, in GiB.",
    )
    enable_lora: bool = Field(
        False, description="Serve LoRA adapters (registered under the deployment's adapters): vLLM is started with "
        "room for them and loads or unloads one live, without a restart. Its buffers of max_loras x "
        "max_lora_rank take GPU memory from the KV cache (pre-flight counts them)."
    )
    max_loras: int = Field(
        4, ge=1, le=64, description="LoRA adapters in one batch at once (vLLM's --max-loras): each slot holds "
        "buffers of max_lora_rank for every layer, taken from the KV cache."
    )
    max_lora_rank: int = Field(
        16, ge=1, le=512, description="The highest rank of an adapter it can serve (vLLM's --max-lora-rank: one of "
        "1, 8, 16, 32, 64, 128, 256, 320, 512): an adapter of a higher rank is refused when it is registered."
    )
    max_cpu_loras: int | None = Field(
        None, ge=1, le=1024, description="Adapters kept in host memory, ready to swap in (vLLM's --max-cpu-loras). "
        "Empty: max_loras."
    )
    extra_args: list[str] = Field(
        default_factory=list,
        max_length=32,
        description="Further vLLM flags, each `--flag` or `--flag=value`, from an allow-list.",
    )


    @property
    def most_replicas(self) -> int:
        """The most instances this revision may run: max_replicas when autoscaled, else replicas (each gets its
        own GPUs when the deployment has enough for this many)."""
        return max(self.replicas, self.max_replicas or 0)


class Finding(BaseModel):
    """A pre-flight error or warning: which field, why, and the value that would fit."""

    code: str
    field: str
    message: str
    fit: dict[str, FitValue] = Field(default_factory=dict)
    severity: Literal["error", "warning"] | None = None  # as recorded with a revision
    forced: bool | None = None


class RevisionOut(BaseModel):
    revision: int
    values: SettingsValues
    status: str
    status_reason: str
    author: str
    note: str
    created_at: datetime
    parent_revision: int | None
    forced: bool
    warnings: list[Finding]
    oom_count: int = 0


class SettingsWrite(BaseModel):
    model_config = ConfigDict(strict=True)  # a JSON 0 is not false, nor "1" a number

    base_revision: int = Field(ge=1, le=2**53 - 1, description="The revision these changes were made on; "
                               "stale → 409.")
    values: dict[str, JsonValue] = Field(description="Fields to change; omitted fields keep the base revision's "
                                         "values.", max_length=64)
    note: str = Field("", max_length=2000, description="Why: shown in the history.")
    force: bool = Field(False, description="Write despite pre-flight errors (recorded as forced; the automatic "
                        "rollback still guards the apply).")


class RollbackRequest(BaseModel):
    model_config = ConfigDict(strict=True)  # a JSON 0 is not false, nor "1" a number

    revision: int = Field(ge=1, le=2**53 - 1, description="Revision whose values become a new desired revision.")
    note: str = Field("", max_length=2000)
    force: bool = False


class Prediction(BaseModel):
    """What the capacity model expects vLLM to do with memory (bytes unless named otherwise)."""

    device: str
    weight_bytes: int
    kv_bytes_per_token: int
    budget_bytes: int
    activation_bytes: int
    non_torch_bytes: int
    kv_bytes: int
    kv_tokens: int
    usable_tokens: int
    max_model_len: int
    tokens_per_request: int
    max_concurrency: float
    fits_one_request: bool
    calibrated: bool
    block_size: int
    notes: list[str] = Field(default_factory=list)
    kv_gib: float
    weight_gib: float


class ModelShapeOut(BaseModel):
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    max_position_embeddings: int
    dtype: str
    parameters: int


class DeviceOut(BaseModel):
    kind: str
    total_bytes: int
    free_bytes: int
    count: int = 1
    name: str = ""


StepAction = Literal["start", "handover", "drain", "stop", "sleep", "wake"]
StartKindName = Literal["cold", "warm", "beside", "beside_cold", "bridge", "wake"]


class RestartEta(BaseModel):
    """What the new revision's start should take, by the earlier starts of its kind."""

    seconds: float
    basis: str = Field(description="kind (earlier starts of this kind), prior (another kind's, scaled) or default")
    samples: int
    text: str
    kind: StartKindName | None = None
    note: str | None = Field(None, description="what may make it wrong now (a loaded host, a prior)")


PlanKind = Literal["start", "soft", "rolling", "blue_green", "bridge", "pause"]


class BridgeOut(BaseModel):
    """The small instance of the old revision that serves while the new one starts (a bridge plan)."""

    gpu_memory_utilization: float
    kv_tokens: int
    max_num_seqs: int
    max_concurrency: float
    max_model_len: int


class PlanStepOut(BaseModel):
    """One step of a plan with what it should take: a start by the earlier starts of its kind, a handover, drain or
    stop by the earlier ones of this engine (or a prior, which ``basis`` says)."""

    action: StepAction
    text: str
    start_kind: StartKindName | None = Field(None, description="a start's kind (cold, warm, beside, beside_cold, "
                                             "bridge, wake): what its ETA is taken from")
    eta_s: float | None = None
    basis: str | None = Field(None, description="what the ETA is taken from")


class ApplyPlanOut(BaseModel):
    """How an apply keeps serving: the kind, why, and what clients should expect."""

    kind: PlanKind
    reason: str
    steps: list[str] = Field(default_factory=list, description="the steps' texts (the same as step_etas')")
    step_etas: list[PlanStepOut] = Field(default_factory=list, description="the steps, each with its ETA")
    eta_note: str | None = Field(None, description="what may make the ETA wrong now (a loaded host, priors)")
    bridge: BridgeOut | None = None
    expected_s: float | None = Field(None, description="how long the apply should take, from earlier starts")
    pause_s: float | None = Field(None, description="how long nothing serves (pause plans; 0 otherwise)")
    capacity_dip_pct: float | None = Field(None, description="share of concurrent requests lost while it runs")
    dip_s: float | None = Field(None, description="how long the capacity dip lasts")
    warnings: list[str] = Field(default_factory=list)

    @property
    def title(self) -> str:
        return PLAN_TITLE[self.kind]

    def expectation(self) -> str:
        """What clients should expect while this plan runs: the one text the console's confirmations, its live
        view and the CLI all show."""
        if self.kind == "pause":
            return ((f"nothing serves for {about(self.pause_s)}" if self.pause_s is not None else
                     "nothing serves until the new instance is ready (no earlier start to estimate from)")
                    + ": requests in flight finish first, new ones wait in the gateway's queue and are served by "
                    "the new instance (past the queue's size or timeout they get 503 with Retry-After)")
        if self.kind == "start":
            return "nothing serves yet: requests wait in the gateway's queue until the new instance is ready"
        if self.kind == "soft":
            return "no restart and no pause: the instances that serve take the change on from the next request"
        expect = "no pause: something serves throughout, and requests in flight finish where they started"
        if self.capacity_dip_pct:
            expect += f"; capacity dips by about {self.capacity_dip_pct:.0f} %"
            if self.dip_s is not None:
                expect += f" for {about(self.dip_s)}"
        return expect

    def eta_text(self) -> str:
        return (f"It should take {about(self.expected_s)}" if self.expected_s is not None else
                "How long it takes is not known yet (no earlier start of this engine to estimate from)")

    def summary(self) -> str:
        """The plan in one paragraph: its kind, why, what clients should expect, how long it takes, the bridge."""
        bridge = ""
        if self.bridge is not None:
            b = self.bridge
            bridge = (f" The bridge runs the old revision at gpu_memory_utilization {b.gpu_memory_utilization:.2f}: "
                      f"{b.kv_tokens:,} KV tokens, max_num_seqs {b.max_num_seqs}.")
        return f"{self.title} — {self.reason}; {self.expectation()}. {self.eta_text()}.{bridge}"


PLAN_TITLE: dict[str, str] = {"start": "Start", "soft": "In effect now", "blue_green": "Blue/green",
                              "bridge": "Bridge", "rolling": "Rolling", "pause": "Pause"}


def about(seconds: float | None) -> str:
    """A duration as a person reads an estimate: 'about 76 s', 'about 3 min'."""
    if seconds is None:
        return "an unknown time"
    return f"about {seconds:.0f} s" if seconds < 120 else f"about {seconds / 60:.0f} min"


class CapacityOut(BaseModel):
    """Pre-flight of values not saved yet: the prediction (none when the values cannot start), errors, warnings."""

    base_revision: int | None
    values: SettingsValues
    ok: bool
    errors: list[Finding]
    warnings: list[Finding]
    prediction: Prediction | None
    model: ModelShapeOut | None
    device: DeviceOut | None
    restart_eta: RestartEta | None = None
    plan: ApplyPlanOut | None = None
    elapsed_ms: float
