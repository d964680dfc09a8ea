"""Wire models of the engine's HTTP API: what the routes take and return, and what the console's client parses.

Pydantic only: the console and the CLI import these without the engine's SQLite, NVML or vLLM code.
"""

from __future__ import annotations

from engine.schemas.access import (
    AuditOut,
    LoginRequest,
    MeOut,
    SessionOut,
    SsoRequest,
    TokenCreatedOut,
    TokenIn,
    TokenOut,
    UserIn,
    UserOut,
    UserPatch,
)
from engine.schemas.benchmarks import (
    BenchmarkLevel,
    BenchmarkProgress,
    BenchmarkRunOut,
    CompareCell,
    CompareLevel,
    CompareOut,
    Concurrency,
    Preset,
    PresetName,
    Proposal,
    SearchRequest,
    SweepRequest,
)
from engine.schemas.common import MAX_ID, ROLES, Build, EngineState, FitValue, OkOut, Role
from engine.schemas.engine import (
    ActionOut,
    EventOut,
    GatewayCounts,
    GatewayInfo,
    HealthOut,
    LogsOut,
    ModelCard,
    ReadyOut,
    StartupPhase,
    StartupView,
    StatusOut,
)
from engine.schemas.gpu import AlertOut, BalanceOut, GpuOut, GpuProcess, GpuView, HostReading, SamplerStats
from engine.schemas.prompts import PromptIn, PromptOut, PromptParams
from engine.schemas.serving import Band, GpuHistoryOut, KpiRow, KpisOut, Series, SeriesOut, ServingOut
from engine.schemas.settings import (
    CapacityOut,
    DeviceOut,
    Finding,
    ModelShapeOut,
    Prediction,
    RestartEta,
    RevisionOut,
    RollbackRequest,
    SettingsValues,
    SettingsWrite,
)

__all__ = [
    "MAX_ID", "ROLES", "ActionOut", "AlertOut", "AuditOut", "BalanceOut", "Band", "BenchmarkLevel", "BenchmarkProgress",
    "BenchmarkRunOut", "Build",
    "CapacityOut", "CompareCell", "CompareLevel", "CompareOut", "Concurrency", "DeviceOut", "EngineState",
    "EventOut", "Finding", "FitValue", "GatewayCounts", "GatewayInfo", "GpuHistoryOut", "GpuOut", "GpuProcess",
    "GpuView", "HealthOut", "HostReading", "KpiRow", "KpisOut", "LoginRequest", "LogsOut", "MeOut", "ModelCard",
    "ModelShapeOut", "OkOut", "Prediction", "Preset", "PresetName", "PromptIn", "PromptOut", "PromptParams",
    "Proposal", "ReadyOut", "RestartEta", "RevisionOut", "Role", "RollbackRequest", "SamplerStats",
    "SearchRequest", "Series", "SeriesOut", "ServingOut", "SessionOut", "SettingsValues", "SettingsWrite",
    "SsoRequest", "StartupPhase", "StartupView", "StatusOut", "SweepRequest", "TokenCreatedOut", "TokenIn",
    "TokenOut", "UserIn", "UserOut", "UserPatch",
]
