"""One vLLM process, the floor the engine stands on: its argument list and environment, the child (a process in its
own group, stopped whole), its log, its start phases, the HTTP probes the engine makes of it, and the diagnosis of
its failures. Nothing here knows of deployments, plans or the gateway; placement and serving build on it."""

from __future__ import annotations

from engine.vllm.child import (
    VllmChild,
    ensure_port_free,
    free_port,
    group_members,
    kill_group,
    reap_all,
    reap_orphans,
)
from engine.vllm.command import (
    CHILD_ENV_NAMES,
    at_nice,
    build_command,
    build_env,
    child_env,
    launch_max_num_seqs,
    remove_ipc_folder,
    renice_group,
    sandbox_for,
    sandbox_problem,
    session_nice,
    unbound_omp_threads,
    vllm_distribution,
)
from engine.vllm.diagnosis import OOM_KINDS, Diagnosis, diagnose
from engine.vllm.flags import FlagProbeError, VllmFlags
from engine.vllm.logs import ChildLog, PrivateRotatingFileHandler, filter_log, redact_secrets
from engine.vllm.phases import COMPILE_ENV, ORDER, PHASES, Phase, StartTracker, compile_key, compiled
from engine.vllm.probe import Prober
from engine.vllm.protocol import Child, ChildSpec

__all__ = [
    "CHILD_ENV_NAMES",
    "COMPILE_ENV",
    "OOM_KINDS",
    "ORDER",
    "PHASES",
    "Child",
    "ChildLog",
    "ChildSpec",
    "Diagnosis",
    "FlagProbeError",
    "Phase",
    "PrivateRotatingFileHandler",
    "Prober",
    "StartTracker",
    "VllmChild",
    "VllmFlags",
    "at_nice",
    "build_command",
    "build_env",
    "child_env",
    "compile_key",
    "compiled",
    "diagnose",
    "ensure_port_free",
    "filter_log",
    "free_port",
    "group_members",
    "kill_group",
    "launch_max_num_seqs",
    "reap_all",
    "reap_orphans",
    "redact_secrets",
    "remove_ipc_folder",
    "renice_group",
    "sandbox_for",
    "sandbox_problem",
    "session_nice",
    "unbound_omp_threads",
    "vllm_distribution",
]
