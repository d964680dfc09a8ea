"""Alert channels, rules and what fired, as they cross the API."""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import AfterValidator, BaseModel, ConfigDict, Field

from engine.schemas.common import MAX_ID, check_name

AlertKind = Literal["gpu_memory", "gpu_temperature", "gpu_errors", "gpu_throttled", "gpu_lost", "ttft_p95",
                    "latency_p95", "error_rate", "queue_wait", "oom", "crash_loop", "rolled_back", "instance_lost",
                    "budget"]
ChannelKind = Literal["slack", "webhook"]
AlertName = Annotated[str, AfterValidator(check_name)]
_URL = "an http(s) webhook address (Slack's incoming webhook, or any that takes a JSON POST); never shown again whole"


class ChannelIn(BaseModel):
    model_config = ConfigDict(strict=True)

    name: AlertName = Field(min_length=1, max_length=100)
    kind: ChannelKind = Field("slack", description='slack: {"text": …} (Slack, Mattermost, Rocket.Chat); webhook: '
                              "the alert as a JSON object")
    url: str = Field(min_length=8, max_length=2048, description=_URL)
    enabled: bool = True


class ChannelPatch(BaseModel):
    model_config = ConfigDict(strict=True)

    kind: ChannelKind | None = None
    url: str | None = Field(None, min_length=8, max_length=2048, description=_URL)
    enabled: bool | None = None


class ChannelOut(BaseModel):
    id: int
    name: str
    kind: ChannelKind
    url: str = Field(description="its scheme and host only (a webhook's path holds its secret)")
    enabled: bool
    created_at: float
    created_by: str


class TestOut(BaseModel):
    ok: bool
    status: int | None = Field(None, description="what the webhook answered (None: no answer)")
    detail: str | None = None


class RuleIn(BaseModel):
    model_config = ConfigDict(strict=True)

    name: AlertName = Field(min_length=1, max_length=100)
    kind: AlertKind
    threshold: float | None = Field(None, ge=0, le=1e9, allow_inf_nan=False, description="level kinds: the figure "
                                    "it fires at (default: the kind's); budget: a share, 0.8 = 80 %")
    for_s: float | None = Field(None, ge=0, le=86400, allow_inf_nan=False, description="how long the condition "
                                "holds before it fires, and is gone before it resolves (events: the quiet that "
                                "resolves one nothing else resolves); default: the kind's")
    deployment: str | None = Field(None, min_length=1, max_length=128, description="one deployment (None: every)")
    channels: list[Annotated[int, Field(ge=1, le=MAX_ID)]] | None = Field(None, max_length=100, description=(
        "channel ids it is sent to (None: every enabled channel)"))
    enabled: bool = True


class RulePatch(BaseModel):
    model_config = ConfigDict(strict=True)

    threshold: float | None = Field(None, ge=0, le=1e9, allow_inf_nan=False)
    for_s: float | None = Field(None, ge=0, le=86400, allow_inf_nan=False)
    deployment: str | None = Field(None, min_length=1, max_length=128)
    channels: list[Annotated[int, Field(ge=1, le=MAX_ID)]] | None = Field(None, max_length=100)
    enabled: bool | None = None


class RuleOut(BaseModel):
    id: int
    name: str
    kind: AlertKind
    title: str
    level: bool = Field(description="a figure against a threshold (else: events)")
    unit: str
    threshold: float | None
    for_s: float
    deployment: str | None
    channels: list[int] | None
    enabled: bool
    firing: int = Field(0, description="alerts of it firing now")


class DeliveryOut(BaseModel):
    channel: str
    status_sent: str = Field(description="firing or resolved")
    ok: bool
    status: int | None = None
    detail: str | None = None
    tries: int = 1
    at: float


class FiredOut(BaseModel):
    id: int
    rule: str
    kind: str
    subject: str
    state: Literal["firing", "resolved"]
    fired_at: float
    resolved_at: float | None
    value: float | None
    message: str
    deliveries: list[DeliveryOut]
