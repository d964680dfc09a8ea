"""Failure diagnosis: classify a failed start or a crash from vLLM's log into a kind, a one-line explanation and
a suggested fix.

vLLM's wording drifts between releases: every pattern lives in ``RULES`` below, first match wins, and
``tests/fixtures/diagnosis`` holds sample lines (from real logs where we have them) for each.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from typing import Any

OOM_KINDS = frozenset({"kv_cache_too_small", "no_cache_memory", "insufficient_free_memory", "cuda_oom"})


@dataclass(frozen=True)
class Diagnosis:
    kind: str
    explanation: str
    fix: str
    evidence: list[str]
    phase: str | None = None

    @property
    def is_oom(self) -> bool:
        return self.kind in OOM_KINDS

    def as_dict(self) -> dict[str, Any]:
        return {**asdict(self), "is_oom": self.is_oom}


@dataclass(frozen=True)
class Rule:
    kind: str
    pattern: re.Pattern[str]
    explain: Callable[[re.Match[str]], tuple[str, str]]  # → (explanation, fix)


def _kv_too_small(m: re.Match[str]) -> tuple[str, str]:
    est = f" vLLM estimates that {m['est']} tokens would fit." if m["est"] else ""
    return (f"One request of max_model_len {m['len']} needs {m['need']} GiB of KV cache, but only {m['avail']} GiB "
            f"is left after weights and activations.{est}",
            (f"Lower max_model_len (to {m['est']} or less)" if m["est"] else "Lower max_model_len")
            + ", raise gpu_memory_utilization (or cpu_kv_cache_gib on the CPU build), or use kv_cache_dtype fp8.")


RULES: tuple[Rule, ...] = (
    Rule("kv_cache_too_small", re.compile(
        r"To serve at least one request with the model's max seq len \((?P<len>\d+)\), \((?P<need>[\d.]+) GiB KV "
        r"cache is needed, which is larger than the available KV cache memory \((?P<avail>-?[\d.]+) GiB\)\."
        r"(?: Based on the available memory, the estimated maximum model length is (?P<est>\d+)\.)?"), _kv_too_small),
    Rule("no_cache_memory", re.compile(r"No available memory for the cache blocks"),
         lambda m: ("Weights, activations and runtime memory use the whole gpu_memory_utilization budget: nothing "
                    "is left for the KV cache.",
                    "Raise gpu_memory_utilization, lower max_num_batched_tokens, or split the model with "
                    "tensor_parallel_size.")),
    Rule("insufficient_free_memory", re.compile(
        r"Free memory on device.*?\((?P<free>[\d.]+)/(?P<total>[\d.]+) GiB\) on startup is less than desired "
        r"(?:GPU|CPU) memory utilization \((?P<util>[\d.]+), (?P<want>[\d.]+) GiB\)"),
         lambda m: (f"Only {m['free']} of {m['total']} GiB is free at start-up, less than the {m['want']} GiB that "
                    f"gpu_memory_utilization {m['util']} asks for: another process holds GPU memory.",
                    "Stop the other process (see GPU health), or lower gpu_memory_utilization below "
                    f"{float(m['free']) / float(m['total']):.2f}.")),
    Rule("insufficient_free_memory", re.compile(
        r"Available memory on node \d+ \((?P<free>[\d.]+)/(?P<total>[\d.]+) GiB\) on (?:startup|kv cache "
        r"allocation) is less than (?:desired CPU memory utilization|requested memory for kv)"),
         lambda m: (f"Only {m['free']} of {m['total']} GiB of host memory is available for vLLM.",
                    "Lower cpu_kv_cache_gib or free host memory.")),
    Rule("cuda_oom", re.compile(r"OutOfMemoryError|CUDA out of memory|CUDA error: out of memory"),
         lambda m: ("The GPU ran out of memory.",
                    "Lower gpu_memory_utilization to leave headroom, lower max_num_seqs or max_num_batched_tokens, "
                    "or set enforce_eager to skip CUDA graphs.")),
    Rule("max_len_above_model", re.compile(
        r"User-specified max_model_len \((?P<len>\d+)\) is greater than the derived max_model_len "
        r"\((?P<key>\w+)=(?P<derived>\d+)"),
         lambda m: (f"max_model_len {m['len']} is above the model's own limit of {m['derived']} ({m['key']}).",
                    f"Set max_model_len to {m['derived']} or less.")),
    Rule("tp_mismatch", re.compile(
        r"Total number of attention heads \((?P<heads>\d+)\) must be divisible by tensor parallel size "
        r"\((?P<tp>\d+)\)|tensor_parallel_size.*(?:greater than|exceeds).*(?:GPUs|devices)|"
        r"World size \(\d+\) is larger than the number of available GPUs"),
         lambda m: ("tensor_parallel_size does not fit the model's attention heads or the GPUs present.",
                    "Use a tensor_parallel_size that divides the attention heads and is at most the GPU count.")),
    Rule("ipc_path_too_long", re.compile(r"ipc path \"(?P<path>[^\"]*)\" is longer than (?P<max>\d+) characters"),
         lambda m: (f"vLLM's socket path {m['path']} is longer than the {m['max']} bytes a socket's path may hold.",
                    "Set VLLM_RPC_BASE_PATH (or TMPDIR) in the engine's environment to a short folder, or use a "
                    "data dir with a shorter path.")),
    Rule("engine_dead", re.compile(r"EngineCore encountered a fatal error|EngineDeadError|"
                                   r"Worker proc \S+ died unexpectedly|WorkerProc hit an exception|"
                                   r"A worker process died"),
         lambda m: ("vLLM's engine core died while serving.",
                    "See the log lines below; if it repeats, roll back to the last good revision.")),
    Rule("invalid_config", re.compile(r"(?:pydantic_core\._pydantic_core\.)?ValidationError|"
                                      r"api_server\.py: error:|error: argument --|ValueError: .*(?:invalid|"
                                      r"not supported|must be)|NotImplementedError"),
         lambda m: ("vLLM refused the configuration.", "Read the quoted error and change the named setting.")),
)

_ERROR_LINE = re.compile(r"(?:Error|ERROR|Exception|Traceback|error:|CRITICAL)")
_PHASES = (  # (phase entered, marker), in start-up order
    ("loading", re.compile(r"Starting to load model|Loading model|Loading weights|load_model")),
    ("profiling", re.compile(r"Model loading took|Loading weights took")),
    ("graph_capture", re.compile(r"Capturing CUDA graph|Graph capturing")),
    ("serving", re.compile(r"Application startup complete|Starting vLLM (?:API )?server")),
)


def _phase(lines: Sequence[str], upto: int) -> str | None:
    phase = None
    for line in lines[: upto + 1]:
        for name, marker in _PHASES:
            if marker.search(line):
                phase = name
    return phase


def diagnose(lines: Sequence[str], *, running: bool = False) -> Diagnosis:
    """Classify vLLM's output of one run. ``running``: the child had been ready (a crash, not a failed start)."""
    for rule in RULES:
        for i, line in enumerate(lines):
            m = rule.pattern.search(line)
            if m is None:
                continue
            explanation, fix = rule.explain(m)
            phase = "serving" if running else _phase(lines, i)
            if rule.kind == "cuda_oom" and phase:
                explanation = f"The GPU ran out of memory while {phase.replace('_', ' ')}."
            return Diagnosis(rule.kind, explanation, fix, _evidence(lines, i), phase)
    tail = [ln for ln in lines if _ERROR_LINE.search(ln)][-5:] or list(lines[-5:])
    return Diagnosis("unknown", "vLLM stopped; its log names no known cause.",
                     "Read the last error lines; restart, or roll back to the last good revision.", tail,
                     "serving" if running else _phase(lines, len(lines) - 1))


def _evidence(lines: Sequence[str], i: int) -> list[str]:
    return [ln[-500:] for ln in lines[max(0, i - 1): i + 2]]
