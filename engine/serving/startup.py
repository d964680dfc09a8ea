"""A vLLM start you can watch: its phases as they happen, read from vLLM's own log, and an ETA from this engine's
earlier starts with the same kind of change.

vLLM logs each step of its start (weights loaded, torch.compile, memory profiling and the KV cache, CUDA graphs,
the API server up); the engine's own warm-up request ends it. A phase begins at its first marker line and ends
where the next one begins; phases a start skips (torch.compile with ``enforce_eager``, CUDA graphs on the CPU
build) are simply absent.

How long a start takes depends above all on torch.compile's cache: ``gpu_memory_utilization`` is outside vLLM's
compile-cache hash, ``max_model_len`` is inside it (a change recompiles). ``compile_key`` names the settings that
decide it; the ETA takes the median of recent starts with the same key, else of recent starts that compiled.
"""

from __future__ import annotations

import hashlib
import json
import re
import statistics
import time
from collections.abc import Mapping, Sequence
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
OUTSIDE_COMPILE = frozenset({"gpu_memory_utilization", "cpu_kv_cache_gib", "served_model_name"})


def compile_key(values: Mapping[str, Any]) -> str:
    """A short digest of the settings that decide whether vLLM can reuse its compile cache."""
    inside = {k: v for k, v in sorted(values.items()) if k not in OUTSIDE_COMPILE}
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
class Eta:
    """What this engine expects a start to take, and on what it bases that."""

    total_s: float
    basis: str  # "warm" (same compile key), "recompile" (a compiling start), "any" (other starts)
    samples: int
    phases: dict[str, float] = field(default_factory=dict)  # median seconds per phase

    def describe(self) -> str:
        why = {"warm": "earlier starts with these compile settings (compile cache warm)",
               "recompile": "earlier starts that compiled (these settings change the compile cache)",
               "any": "earlier starts of this engine"}[self.basis]
        return f"about {self.total_s:.0f} s, the median of {self.samples} {why}"


@dataclass
class StartTracker:
    """The phases of one start, fed vLLM's log lines as they arrive."""

    t0: float = field(default_factory=time.monotonic)
    phases: list[Phase] = field(default_factory=lambda: [Phase("process", 0.0)])
    ready_s: float | None = None
    failed: str | None = None

    @property
    def current(self) -> Phase:
        return self.phases[-1]

    def elapsed(self, now: float | None = None) -> float:
        return (time.monotonic() if now is None else now) - self.t0

    def feed(self, line: str, now: float | None = None) -> str | None:
        """Read one log line; return the phase it began, if any."""
        if self.ready_s is not None or self.failed is not None:
            return None
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

    def view(self, eta: Eta | None, now: float | None = None) -> dict[str, Any]:
        """What the API shows of a start in progress (or just ended)."""
        at = self.elapsed(now)
        remaining = overrun = None
        if eta is not None and self.ready_s is None:
            done = {p.name for p in self.phases[:-1]}
            ahead = [s for n, s in eta.phases.items() if n not in done and n != self.current.name]
            expected_here = eta.phases.get(self.current.name, 0.0)
            current_left = max(0.0, expected_here - self.current.seconds(at))
            remaining = round(current_left + sum(ahead), 1) if eta.phases else round(max(0.0, eta.total_s - at), 1)
            # past the ETA, or the phase under way past its usual length: how far over, a figure that grows (the
            # time left would stand still at the phases ahead)
            over = max(at - eta.total_s, self.current.seconds(at) - expected_here if eta.phases else 0.0)
            if over > 0 and self.failed is None:
                overrun, remaining = round(over, 1), None
        return {
            "elapsed_s": round(self.ready_s if self.ready_s is not None else at, 1),
            "phase": self.current.name, "phase_title": self.current.title,
            "phases": [{"name": p.name, "title": p.title, "started_s": round(p.started_s, 1),
                        "seconds": round(p.seconds(at), 1), "done": p.ended_s is not None} for p in self.phases],
            "eta_s": None if eta is None else round(eta.total_s, 1),
            "eta_basis": None if eta is None else eta.describe(),
            "remaining_s": remaining, "overrun_s": overrun,
            "ready_s": None if self.ready_s is None else round(self.ready_s, 1),
            "failed": self.failed,
        }


@dataclass(frozen=True)
class PastStart:
    """One earlier successful start, as its ready event recorded it."""

    compile_key: str | None
    model: str | None
    total_s: float
    compiled: bool  # the start spent time in torch.compile beyond a cache load
    phases: Mapping[str, float]


def estimate(key: str, model: str, history: Sequence[PastStart], recent: int = 5) -> Eta | None:
    """The ETA of a start with compile key ``key``, from earlier successful starts (oldest first).

    A key this engine has started before finds vLLM's compile cache warm: the median of recent starts that did not
    compile (of this key if there are any). A new key compiles: the median of recent starts of the model that did.
    Without either, the median of recent starts of the model (or of any model)."""
    of_model = [s for s in history if s.model == model] or list(history)
    if any(s.compile_key == key for s in history):
        basis = "warm"
        warm = [s for s in of_model if not s.compiled]
        pool = [s for s in warm if s.compile_key == key] or warm or [s for s in history if s.compile_key == key]
    else:
        basis, pool = "recompile", [s for s in of_model if s.compiled]
    if not pool:
        basis, pool = "any", of_model
    if not pool:
        return None
    pool = pool[-recent:]
    names = {n for s in pool for n in s.phases}
    phases = {n: round(statistics.median([s.phases.get(n, 0.0) for s in pool]), 2) for n in names}
    return Eta(round(statistics.median([s.total_s for s in pool]), 1), basis, len(pool),
               dict(sorted(phases.items(), key=lambda kv: ORDER.get(kv[0], 99))))


def compiled(phases: Mapping[str, float], threshold_s: float = 5.0) -> bool:
    """Whether a start's torch.compile phase did real work (a cache load takes a second or two)."""
    return phases.get("compile", 0.0) >= threshold_s


def past_start(data: Mapping[str, Any]) -> PastStart | None:
    """A ready event's data as a PastStart (None for events written before phases were recorded)."""
    startup = data.get("startup")
    if not isinstance(startup, Mapping) or not isinstance(data.get("startup_s"), int | float):
        return None
    phases = startup.get("phases")
    if not isinstance(phases, Mapping):
        return None
    clean = {str(k): float(v) for k, v in phases.items() if isinstance(v, int | float)}
    key = startup.get("compile_key")
    return PastStart(str(key) if key else None, str(startup.get("model") or "") or None,
                     float(data["startup_s"]), compiled(clean), clean)
