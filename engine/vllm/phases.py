"""A vLLM start you can watch: its phases as they happen, read from vLLM's own log, and the compile-cache key of
its settings.

vLLM logs each step of its start (weights loaded, torch.compile, memory profiling and the KV cache, CUDA graphs,
the API server up); the engine's own warm-up request ends it. A phase begins at its first marker line and ends
where the next one begins; phases a start skips (torch.compile with ``enforce_eager``, CUDA graphs on the CPU
build) are simply absent. Whether torch.compile's cache held the graphs is read from the log too
(``compile_cache``); ``compile_key`` names the settings that decide it (``gpu_memory_utilization`` is outside
vLLM's compile-cache hash, ``max_model_len`` and ``max_num_seqs`` inside it). What a start should take (its ETA,
by its kind) is engine/serving/forecast's.
"""

from __future__ import annotations

import hashlib
import json
import re
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

# (phase, title, the markers that begin it), in start-up order
PHASES: tuple[tuple[str, str, re.Pattern[str] | None], ...] = (
    ("process", "Process and imports", None),
    ("weights", "Loading weights", re.compile(r"Starting to load model|Loading model from scratch|Loading weights|"
                                              r"Initializing model took")),
    ("compile", "torch.compile", re.compile(r"Dynamo bytecode transform|Compiling a graph|torch\.compile took|"
                                            r"Warming up model for the compilation|Directly load the compiled|"
                                            r"Using cache directory: .*torch_compile")),
    ("kv_cache", "Memory profiling and KV cache", re.compile(r"Initial profiling/warmup run|Memory profiling|"
                                                             r"Available KV cache memory|for KV cache|"
                                                             r"KV cache size")),
    ("cuda_graphs", "CUDA graphs", re.compile(r"Capturing CUDA graph|Graph capturing|capturing CUDA graphs")),
    ("api", "API server up", re.compile(r"init engine \(profile|Supported tasks|Starting vLLM (?:API )?server")),
    ("warmup", "Warm-up request", re.compile(r"Application startup complete")),
)
TITLES = {name: title for name, title, _ in PHASES}
ORDER = {name: i for i, (name, _, _) in enumerate(PHASES)}
# Settings outside vLLM's compile cache: changing only these reuses the compiled graphs.
OUTSIDE_COMPILE = frozenset({"gpu_memory_utilization", "cpu_kv_cache_gib", "served_model_name", "routing",
                             # autoscaling's: the engine's, not vLLM's (a start's key stays what it was before them)
                             "min_replicas", "max_replicas", "target_in_flight", "scale_up_delay_s",
                             "scale_down_delay_s", "scale_to_zero_after_s",
                             "target_queue_wait_s"})

COMPILE_ENV = ("VLLM_CPU_OMP_THREADS_BIND",)
# vLLM's log says whether its compile cache held the graphs: loaded them (a GPU), or found them and compiled again
# (the CPU build 0.32: its cached graph fails to load, and the compile is quick on torch's own warm cache)
CACHE_WARM = re.compile(r"Directly load the compiled|Directly load AOT|Compiling model again due to a load failure")
CACHE_COLD = re.compile(r"Compiling a graph for|saved AOT compiled function")


def compile_key(values: Mapping[str, Any], env: Mapping[str, str] | None = None) -> str:
    """A short digest of the settings (and the instance's environment, COMPILE_ENV) that decide whether vLLM can
    reuse its compile cache."""
    inside: dict[str, Any] = {k: v for k, v in sorted(values.items()) if k not in OUTSIDE_COMPILE}
    ceiling, seqs = inside.get("max_num_seqs_ceiling"), inside.get("max_num_seqs")
    if isinstance(ceiling, int) and isinstance(seqs, int):
        # vLLM is started with the ceiling (serving/command.py, launch_max_num_seqs) and the gateway holds it to
        # max_num_seqs: the same vLLM as a revision whose max_num_seqs is the ceiling, with no ceiling
        inside.update(max_num_seqs=max(seqs, ceiling), max_num_seqs_ceiling=None)
    hashed = {k: env[k] for k in COMPILE_ENV if env is not None and k in env}
    if hashed:  # (a start with none of them keeps the key it had before the environment counted)
        inside["__env__"] = hashed
    return hashlib.sha256(json.dumps(inside, sort_keys=True, default=str).encode()).hexdigest()[:16]


@dataclass
class Phase:
    name: str
    started_s: float  # seconds after spawn
    ended_s: float | None = None

    @property
    def title(self) -> str:
        return TITLES[self.name]

    def seconds(self, now_s: float) -> float:
        return (self.ended_s if self.ended_s is not None else now_s) - self.started_s


@dataclass
class StartTracker:
    """The phases of one start, fed vLLM's log lines as they arrive."""

    t0: float = field(default_factory=time.monotonic)
    clock: Callable[[], float] = field(default=time.monotonic, repr=False)  # what "now" is (tests: a fake clock)
    phases: list[Phase] = field(default_factory=lambda: [Phase("process", 0.0)])
    ready_s: float | None = None
    failed: str | None = None
    compile_cache: str | None = None  # "warm" or "cold", as vLLM's log said (None: it said neither, e.g. eager)

    @property
    def current(self) -> Phase:
        return self.phases[-1]

    def elapsed(self, now: float | None = None) -> float:
        return (self.clock() if now is None else now) - self.t0

    def feed(self, line: str, now: float | None = None) -> str | None:
        """Read one log line; return the phase it began, if any."""
        if self.ready_s is not None or self.failed is not None:
            return None
        if self.compile_cache != "warm":
            if CACHE_WARM.search(line):
                self.compile_cache = "warm"
            elif self.compile_cache is None and CACHE_COLD.search(line):
                self.compile_cache = "cold"
        at = self.elapsed(now)
        position = ORDER[self.current.name]
        for name, _, marker in PHASES[position + 1:]:
            if marker is not None and marker.search(line):
                self._begin(name, at)
                return name
        return None

    def _begin(self, name: str, at: float) -> None:
        self.current.ended_s = at
        self.phases.append(Phase(name, at))

    def ready(self, now: float | None = None) -> float:
        at = self.elapsed(now)
        if self.current.name != "warmup":
            self._begin("warmup", at)
        self.current.ended_s = at
        self.ready_s = at
        return at

    def fail(self, reason: str, now: float | None = None) -> None:
        self.current.ended_s = self.elapsed(now)
        self.failed = reason

    def durations(self) -> dict[str, float]:
        now = self.elapsed()
        return {p.name: round(p.seconds(now), 2) for p in self.phases}


def compiled(phases: Mapping[str, float], threshold_s: float = 5.0) -> bool:
    """Whether a start's torch.compile phase did real work (a cache load takes a second or two)."""
    return phases.get("compile", 0.0) >= threshold_s
