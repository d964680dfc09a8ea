"""Serving: the supervisor's reconcile loop, the vLLM child process, its command, state, start-up phases,
diagnosis and recovery."""

from __future__ import annotations

from engine.serving.child import (
    VllmChild,
    ensure_port_free,
    free_port,
    group_members,
    kill_group,
    reap_all,
    reap_orphans,
)
from engine.serving.command import at_nice, build_command, build_env, child_env, session_nice, vllm_distribution
from engine.serving.diagnosis import OOM_KINDS, Diagnosis, diagnose
from engine.serving.flags import FlagProbeError, VllmFlags
from engine.serving.logs import ChildLog, PrivateRotatingFileHandler, filter_log, redact_secrets
from engine.serving.recovery import Decision, RecoveryPolicy
from engine.serving.scope import DeploymentRef
from engine.serving.startup import Eta, PastStart, StartTracker, compile_key, estimate, past_start
from engine.serving.state import InvalidTransitionError, StateMachine
from engine.serving.supervisor import Supervisor

__all__ = [
    "OOM_KINDS",
    "ChildLog",
    "Decision",
    "DeploymentRef",
    "Diagnosis",
    "Eta",
    "FlagProbeError",
    "InvalidTransitionError",
    "PastStart",
    "PrivateRotatingFileHandler",
    "RecoveryPolicy",
    "StartTracker",
    "StateMachine",
    "Supervisor",
    "VllmChild",
    "VllmFlags",
    "at_nice",
    "build_command",
    "build_env",
    "child_env",
    "compile_key",
    "diagnose",
    "ensure_port_free",
    "estimate",
    "filter_log",
    "free_port",
    "group_members",
    "kill_group",
    "past_start",
    "reap_all",
    "reap_orphans",
    "redact_secrets",
    "session_nice",
    "vllm_distribution",
]
