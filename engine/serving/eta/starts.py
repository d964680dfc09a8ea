"""What a vLLM start should take: an ETA from this engine's earlier starts with the same kind of change.

How long a start takes depends on its *kind*: torch.compile's cache cold or warm for its compile settings
(engine/vllm/phases.py ``compile_key``), and what runs beside it (alone, beside an instance that serves, a bridge
beside the old instance, a wake-up from sleep). Each start is recorded with its kind (its ready event); the ETA of
a start is the median of recent starts of the same kind (the cache part as it turned out), else a prior (another
kind's median times the ratio between the two kinds, or a default), and it says which, and says so when the host
is loaded now. ``start_view`` shows a start in progress against its ETA.
"""

from __future__ import annotations

import os
import statistics
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

from engine.vllm import ORDER, StartTracker, compiled

# The kinds of start, which take different times: the compile cache empty (cold) or warm for the start's compile
# settings; alone, or beside an instance that serves (on the CPU build they share its cores, on a GPU the GPU);
# a bridge (the old revision, small, beside the old instance); a wake-up from sleep mode (CUDA).
StartKind = Literal["cold", "warm", "beside", "beside_cold", "bridge", "wake"]
Company = Literal["alone", "beside", "bridge", "wake"]
KINDS: tuple[StartKind, ...] = ("cold", "warm", "beside", "beside_cold", "bridge", "wake")
KIND_TEXT: dict[StartKind, str] = {
    "cold": "cold starts (compile cache empty for their compile settings)",
    "warm": "starts with the compile cache warm, alone",
    "beside": "starts beside an instance that serves (compile cache warm)",
    "beside_cold": "cold starts beside an instance that serves",
    "bridge": "bridge starts beside the old instance",
    "wake": "wake-ups from sleep",
}
# What a start of each kind takes against a warm one alone, for a kind this engine has not started yet (then the
# estimate is a prior and says so), per build. CPU: the demo model on this project's 2-core host, 12 real starts
# through the engine with the scheduler's sessions weighted (python -m bench start-kinds, 2026-12-03,
# tests/fixtures/starts/cpu-2026-12-03.json): warm alone 48-63 s (median 56), cold 61-81 s (107 s for the first
# after boot, torch's own cache empty too), beside an instance serving 16 streaming clients 121-145 s (its imports
# 92-100 s against 34-44 s alone), a cold one there 160 s. Before the sessions were weighted (2026-12-01) a start
# beside took 3.7 times a warm one. The CPU build makes no bridge and has no sleep mode: theirs are guesses.
# CUDA: an H200 with an 8B model (tests/fixtures/starts/h200-2026-12-01.json: cold 117.5 s, warm 61.8 s, bridges
# 88.4 and 64.1 s, a cold start beside the bridge under load 103.3 s, a wake-up 0.74 s; h200-2026-12-04.json: a
# bridge 58.3 s, a cold start 55.8 s, a cold one beside 64.8 s). The first start on a fresh machine, the one a
# default estimates, took 117.5, 102.5 and 97.5 s on three days (median 102.5 s: 1.65 x a warm start; a second
# engine's first start on the same machine, its files in the page cache, 73.9 s).
PRIOR_RATIO: dict[str, dict[StartKind, float]] = {
    "cpu": {"warm": 1.0, "cold": 1.4, "beside": 2.3, "beside_cold": 2.85, "bridge": 2.3, "wake": 0.05},
    "cuda": {"warm": 1.0, "cold": 1.65, "beside": 1.2, "beside_cold": 1.45, "bridge": 1.1, "wake": 0.012},
}
PRIOR_WARM_S = {"cpu": 56.0, "cuda": 62.0}  # a warm start alone, with no start at all to go by
# The kinds whose process phase (the interpreter, imports, the executor's processes) runs under the same conditions:
# it does not depend on the compile cache, only on the page cache and on what shares the cores, and it drifts over
# a host's life (this 2-core host: 62 s for the first start after boot, 43-50 s next, 34-37 s an hour later, so a
# median of the last five ran 20-34 % over). An estimate from starts of its kind takes that phase from the latest
# start of its peers, the other phases from the kind's median. CPU: a start beside a serving instance shares its
# cores; CUDA: they all run on the host's CPUs alike.
PROCESS_PEERS: dict[str, tuple[frozenset[StartKind], ...]] = {
    "cpu": (frozenset({"cold", "warm"}), frozenset({"beside", "beside_cold"}), frozenset({"bridge"})),
    "cuda": (frozenset({"cold", "warm", "beside", "beside_cold", "bridge"}),),
}
# The host is loaded for an estimate when its load average now is above both LOADED_PER_CORE runnable threads a
# core and LOADED_RATIO times the median load of the starts the estimate is taken from (a start beside a busy
# instance is always taken at a high load: that is its kind, not a surprise).
LOADED_PER_CORE = 1.5
LOADED_RATIO = 1.5


def host_load() -> tuple[float | None, int]:
    """The host's 1-minute load average (as engine/gpu/sampler reads it) and the cores this process may use."""
    try:
        load: float | None = os.getloadavg()[0]
    except OSError:
        load = None
    return load, len(os.sched_getaffinity(0))


def start_kind(company: Company, cold: bool) -> StartKind:
    """The kind of a start from what runs beside it and whether its compile cache is cold. A bridge runs the old
    revision, whose compile cache its own start warmed; a wake-up compiles nothing."""
    if company in ("bridge", "wake"):
        return company
    if company == "beside":
        return "beside_cold" if cold else "beside"
    return "cold" if cold else "warm"


def with_cache(kind: StartKind, cold: bool) -> StartKind:
    """``kind`` with its compile cache as it turned out (a start expected warm may have compiled: the cache was
    wiped, or its compile settings differ in a way the key does not see)."""
    if kind in ("cold", "warm"):
        return "cold" if cold else "warm"
    if kind in ("beside", "beside_cold"):
        return "beside_cold" if cold else "beside"
    return kind


# vLLM's environment variables that the engine sets per instance and vLLM hashes into its compile cache (all its
# VLLM_* are, but these are the ones that differ between two starts of one engine): on the CPU build an instance
# started beside another is not pinned to cores, and its compiled graphs are cached apart from a pinned one's.
@dataclass
class Eta:
    """What this engine expects a start of one kind to take, and on what it bases that."""

    total_s: float
    basis: str  # "kind": earlier starts of this kind; "prior": another kind's, by the prior ratio; "default": none
    samples: int
    phases: dict[str, float] = field(default_factory=dict)  # median seconds per phase
    kind: StartKind = "warm"
    source: StartKind | None = None  # the kind a prior was taken from
    scale: float = 1.0  # a prior's ratio to its source kind
    load_1m: float | None = None  # the host's load average when it was made
    cores: int | None = None
    pool_load: float | None = None  # the median load average at the launch of the starts it is taken from
    process_from: StartKind | None = None  # the kind of the latest start its process phase was taken from
    cache_missed: bool = False  # expected cold though its compile key was started before (cache_missed)

    @property
    def loaded(self) -> bool:
        """The host is more loaded now than the estimate assumes (LOADED_PER_CORE, LOADED_RATIO)."""
        if self.load_1m is None or not self.cores:
            return False
        return self.load_1m > max(LOADED_PER_CORE * self.cores, LOADED_RATIO * (self.pool_load or 0.0))

    def _load_text(self) -> str:
        than = f", against {self.pool_load:.1f} for the starts this is taken from" if self.pool_load else ""
        return f"the host is loaded now (load average {self.load_1m:.1f} on {self.cores} cores{than})"

    def note(self) -> str | None:
        """What may make this estimate wrong now: a loaded host, or no start of this kind to go by."""
        notes = []
        if self.basis != "kind":
            notes.append("a prior, not a measurement: it becomes one after the first start of this kind")
        if self.loaded:
            notes.append(f"{self._load_text()}: starts take longer then")
        return "; ".join(notes) or None

    def why(self) -> str:
        """What the estimate is taken from (and, when the host is loaded now, that it is)."""
        what = KIND_TEXT[self.kind]
        if self.basis == "kind":
            text = f"the median of {self.samples} earlier {what}"
            if self.process_from is not None and "process" in self.phases:
                text += (f", process and imports {self.phases['process']:.0f} s as in the latest "
                         f"{self.process_from} start")
        elif self.basis == "prior" and self.source is not None:
            text = (f"a prior: no earlier {what} here, so {self.scale:.2g} x the median of {self.samples} "
                    f"{KIND_TEXT[self.source]}")
        else:
            text = f"a prior for {what}: no earlier start of this engine to go by"
        if self.cache_missed:
            text += ("; expected to compile again though these settings were started before: the latest such "
                     "start here found vLLM's compile cache cold")
        if self.loaded:
            text += f"; {self._load_text()}: expect longer"
        return text

    def describe(self) -> str:
        return f"about {self.total_s:.0f} s, {self.why()}"


@dataclass(frozen=True)
class PastStart:
    """One earlier successful start, as its ready event recorded it."""

    compile_key: str | None
    model: str | None
    total_s: float
    compiled: bool  # its compile cache was cold (vLLM's log said so; older records: its compile phase was long)
    phases: Mapping[str, float]
    kind: StartKind | None = None  # as recorded at its launch (None: recorded before kinds were)
    load_1m: float | None = None  # the host's load average at its launch
    cores: int | None = None
    cache: str | None = None  # its compile cache as vLLM's log said: "warm", "cold" (None: not recorded)

    @property
    def effective_kind(self) -> StartKind:
        """The kind it turned out to be: its recorded kind with the compile cache as measured (a start recorded
        before kinds were counts as alone)."""
        return with_cache(self.kind or "warm", self.compiled)


def cache_missed(history: Sequence[PastStart]) -> PastStart | None:
    """The latest start whose compile key an earlier start had and whose compile cache vLLM's log reported, when
    vLLM found it cold all the same: on this host vLLM does not keep (or does not find) a key's graphs — its
    cache was wiped between the starts, or vLLM hashes something the key does not see. On the H200 on 2026-12-04
    both repeats of a key compiled again, each over a new gpu_memory_utilization (tests/fixtures/starts/
    h200-2026-12-04b.json: the rule is fitted to them). It looks at every key and model of this engine's starts
    (one miss says the cache does not hold here; with instances on Ray nodes, on any node); a repeat found warm
    later makes the cache count again. None: no such miss."""
    seen: set[str] = set()
    latest: PastStart | None = None
    for s in history:
        if s.compile_key is not None:
            if s.compile_key in seen and s.cache in ("warm", "cold"):
                latest = s
            seen.add(s.compile_key)
    return latest if latest is not None and latest.cache == "cold" else None


def cache_cold(key: str, history: Sequence[PastStart]) -> bool:
    """Whether a start with compile key ``key`` is expected to find vLLM's compile cache cold: no earlier start of
    this engine with that key (each one leaves its compiled graphs in the cache), or the latest repeat of a key
    found it cold all the same (cache_missed)."""
    return not any(s.compile_key == key for s in history) or cache_missed(history) is not None


def _pool_load(pool: Sequence[PastStart]) -> float | None:
    loads = [s.load_1m for s in pool if s.load_1m is not None]
    return round(statistics.median(loads), 2) if loads else None


def _median_eta(pool: Sequence[PastStart], scale: float = 1.0) -> tuple[float, dict[str, float]]:
    names = {n for s in pool for n in s.phases}
    phases = {n: round(scale * statistics.median([s.phases.get(n, 0.0) for s in pool]), 2) for n in names}
    total = round(scale * statistics.median([s.total_s for s in pool]), 1)
    return total, dict(sorted(phases.items(), key=lambda kv: ORDER.get(kv[0], 99)))


def _latest_process(history: Sequence[PastStart], kind: StartKind, build: str) -> PastStart | None:
    """The latest start whose process phase ran as ``kind``'s will (PROCESS_PEERS), if any."""
    peers = next((g for g in PROCESS_PEERS.get(build, PROCESS_PEERS["cpu"]) if kind in g), None)
    if peers is None:
        return None
    return next((s for s in reversed(history) if s.effective_kind in peers and "process" in s.phases), None)


def estimate(key: str, model: str, history: Sequence[PastStart], recent: int = 5, *,
             company: Company = "alone", kind: StartKind | None = None, build: str = "cpu",
             load_1m: float | None = None, cores: int | None = None) -> Eta:
    """The ETA of a start with compile key ``key`` of ``model`` (its kind: ``kind``, else from ``company`` and
    whether its compile cache is cold), from earlier successful starts (oldest first).

    The median of the ``recent`` latest starts of the same kind (as they turned out) of the model (of any model
    when the model has none), its process phase as the latest of its peers took it (PROCESS_PEERS). Without one
    of that kind: a prior, the median of the kind the model has most starts of, times the ratio of the two kinds
    (PRIOR_RATIO of the build); without any start, the build's default."""
    chosen_here = kind is None
    kind = kind or start_kind(company, cache_cold(key, history))
    missed = (chosen_here and kind in ("cold", "beside_cold") and any(s.compile_key == key for s in history))
    # a wake-up takes the same whatever the model's settings; a start, its model's
    of_model = list(history) if kind == "wake" else [s for s in history if s.model == model] or list(history)
    pool = [s for s in of_model if s.effective_kind == kind][-recent:]
    if pool:
        total, phases = _median_eta(pool)
        latest = _latest_process(of_model, kind, build)
        if latest is not None and not all("process" in s.phases for s in pool):
            latest = None  # records without phases: their totals' median as it is
        if latest is not None:
            total = round(total + latest.phases["process"] - phases["process"], 1)
            phases["process"] = round(latest.phases["process"], 2)
        return Eta(total, "kind", len(pool), phases, kind, None, 1.0, load_1m, cores, _pool_load(pool),
                   latest.effective_kind if latest is not None else None, missed)
    by_kind: dict[StartKind, list[PastStart]] = {}
    for s in of_model:
        by_kind.setdefault(s.effective_kind, []).append(s)
    usable = {k: v for k, v in by_kind.items() if k != "wake"}
    if usable and kind != "wake":
        source = max(usable, key=lambda k: (len(usable[k]), k == "warm", k == "beside"))
        chosen = usable[source][-recent:]
        ratios = PRIOR_RATIO.get(build, PRIOR_RATIO["cpu"])
        scale = ratios[kind] / ratios[source]
        total, phases = _median_eta(chosen, scale)
        return Eta(total, "prior", len(chosen), phases, kind, source, round(scale, 3), load_1m, cores,
                   _pool_load(chosen), None, missed)
    warm = PRIOR_WARM_S.get(build, PRIOR_WARM_S["cpu"])
    scale = PRIOR_RATIO.get(build, PRIOR_RATIO["cpu"])[kind]
    return Eta(round(warm * scale, 1), "default", 0, {}, kind, None, scale, load_1m, cores)


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
    cache = startup.get("compile_cache") if startup.get("compile_cache") in ("warm", "cold") else None
    recorded = startup.get("kind")
    kind: StartKind | None = next((k for k in KINDS if k == recorded), None)
    if kind is None and data.get("bridge") is True:  # recorded before kinds were: a bridge said so
        kind = "bridge"
    load, cores = startup.get("load_1m"), startup.get("cores")
    return PastStart(str(key) if key else None, str(startup.get("model") or "") or None,
                     float(data["startup_s"]), cache == "cold" if cache else compiled(clean), clean, kind,
                     float(load) if isinstance(load, int | float) else None,
                     int(cores) if isinstance(cores, int) else None, cache)


def past_wake(data: Mapping[str, Any], model: str | None) -> PastStart | None:
    """A woken event's data as a start of kind wake (its time is the wake-up call and the probe)."""
    seconds = data.get("wake_s")
    if not isinstance(seconds, int | float):
        return None
    return PastStart(None, model, float(seconds), False, {}, "wake")


def start_view(tracker: StartTracker, eta: Eta | None, now: float | None = None) -> dict[str, Any]:
    """What the API shows of a start in progress (or just ended), against its ETA."""
    at = tracker.elapsed(now)
    remaining = overrun = None
    if eta is not None and tracker.ready_s is None:
        done = {p.name for p in tracker.phases[:-1]}
        ahead = [s for n, s in eta.phases.items() if n not in done and n != tracker.current.name]
        expected_here = eta.phases.get(tracker.current.name, 0.0)
        current_left = max(0.0, expected_here - tracker.current.seconds(at))
        remaining = round(current_left + sum(ahead), 1) if eta.phases else round(max(0.0, eta.total_s - at), 1)
        # past the ETA, or the phase under way past its usual length: how far over, a figure that grows (the
        # time left would stand still at the phases ahead)
        over = max(at - eta.total_s, tracker.current.seconds(at) - expected_here if eta.phases else 0.0)
        if over > 0 and tracker.failed is None:
            overrun, remaining = round(over, 1), None
    return {
        "elapsed_s": round(tracker.ready_s if tracker.ready_s is not None else at, 1),
        "phase": tracker.current.name, "phase_title": tracker.current.title,
        "phases": [{"name": p.name, "title": p.title, "started_s": round(p.started_s, 1),
                    "seconds": round(p.seconds(at), 1), "done": p.ended_s is not None} for p in tracker.phases],
        "eta_s": None if eta is None else round(eta.total_s, 1),
        "eta_basis": None if eta is None else eta.describe(),
        "start_kind": None if eta is None else eta.kind,
        "remaining_s": remaining, "overrun_s": overrun,
        "ready_s": None if tracker.ready_s is None else round(tracker.ready_s, 1),
        "failed": tracker.failed,
    }
