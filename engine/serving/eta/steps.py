"""The ETAs of an apply's steps, from what this engine measured before: each start by the earlier starts of its
kind (engine/serving/eta/starts.py ``estimate``), each handover, drain, stop and sleep by the earlier ones (the
``timings`` of earlier applies, recorded in their ``apply_done`` events).

A handover and a drain last as long as the requests in flight need: with none in flight now they take no time
(a drain closes at once); with traffic, the median of earlier ones that had traffic. A step this engine has not
measured yet gets a prior, and says so.
"""

from __future__ import annotations

import statistics
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from engine.capacity import Company, StepEta
from engine.revisions import EngineSettings
from engine.schemas import StepAction
from engine.serving.eta.starts import Eta, PastStart, estimate
from engine.vllm import compile_key

# What a step takes, for one this engine has not measured yet (seconds, with traffic in flight): CPU build, the
# demo model under 16 streaming clients on 2 cores (python -m bench start-kinds: handovers 0.4-1.8 s, drains 0.0-1.9 s,
# stops 0.6-3.3 s); CUDA, an H200 with an 8B model (bench/results/2026-12-01-h200/: stops 0.5-0.7 s, a sleep 17.2 s).
PRIOR_STEP_S: dict[str, dict[str, float]] = {
    "cpu": {"handover": 1.0, "drain": 1.0, "stop": 2.0, "sleep": 5.0},
    "cuda": {"handover": 1.0, "drain": 1.0, "stop": 0.7, "sleep": 17.0},
}
STEP_TEXT = {"handover": "handovers", "drain": "drains", "stop": "stops", "sleep": "sleeps"}
RECENT = 5


@dataclass(frozen=True)
class PastStep:
    """One step of an earlier apply as it ran."""

    action: str
    seconds: float
    in_flight: int


def past_steps(data: Mapping[str, Any]) -> list[PastStep]:
    """The steps of an apply_done event's apply (none for applies recorded before steps were timed)."""
    out = []
    for t in data.get("timings") or []:
        if isinstance(t, Mapping) and isinstance(t.get("seconds"), int | float) and isinstance(t.get("action"), str):
            out.append(PastStep(t["action"], float(t["seconds"]), int(t.get("in_flight") or 0)))
    return out


@dataclass
class EtaTable:
    """The StepTimes of one plan (engine/capacity/plans.py): this engine's earlier starts and steps, the host's
    load now, and whether requests are in flight now."""

    starts: Sequence[PastStart]
    steps: Sequence[PastStep]
    build: str = "cpu"
    in_flight: int = 0
    load_1m: float | None = None
    cores: int | None = None
    # a start that would be alone still shares the device with another deployment's instance (the CPU build)
    neighbours: bool = False
    # a rolling start on its own GPUs is alone there, not beside the replicas that serve (CUDA)
    own_device: Callable[[EngineSettings], bool] = lambda _settings: False
    # the part of a start's environment vLLM's compile cache sees, for a start beside another instance or not
    env_for: Callable[[bool], Mapping[str, str]] = lambda _beside: {}
    _etas: list[Eta] | None = None

    def start_eta(self, settings: EngineSettings, company: Company) -> Eta:
        """A start beside instances that serve no request now (or on its own GPUs) is a start alone; one alone
        beside another deployment's instance on the CPU build shares its cores. Its compile key is of the
        environment it gets: beside any instance, even an idle one, on the CPU build it is not pinned."""
        env = self.env_for(company != "alone")
        if company == "beside" and (self.in_flight == 0 or self.own_device(settings)):
            company = "alone"
        if company == "alone" and self.neighbours:
            company = "beside"
        values = settings.model_dump()
        eta = estimate(compile_key(values, env), str(values.get("model")), self.starts, company=company,
                       build=self.build, load_1m=self.load_1m, cores=self.cores)
        if self._etas is None:
            self._etas = []
        self._etas.append(eta)
        return eta

    def start(self, settings: EngineSettings, company: Company) -> StepEta:
        eta = self.start_eta(settings, company)
        return StepEta(eta.total_s, eta.why(), eta.kind)

    def step(self, action: StepAction) -> StepEta:
        if action in ("handover", "drain") and self.in_flight == 0:
            return StepEta(0.0, "no request in flight now: nothing to wait for")
        pool = [s.seconds for s in self.steps if s.action == action and (s.in_flight > 0 or action == "stop"
                                                                           or action == "sleep")][-RECENT:]
        what = STEP_TEXT.get(action, action)
        if pool:
            return StepEta(round(statistics.median(pool), 1), f"the median of {len(pool)} earlier {what}"
                           + (" with requests in flight" if action in ("handover", "drain") else ""))
        prior = PRIOR_STEP_S.get(self.build, PRIOR_STEP_S["cpu"]).get(action)
        return StepEta(prior, f"a prior: no earlier {what[:-1]} measured by this engine")

    def note(self) -> str | None:
        """The starts' notes (priors, a loaded host), once each."""
        notes: list[str] = []
        for eta in self._etas or []:
            text = eta.note()
            for part in (text.split("; ") if text else []):
                if part not in notes:
                    notes.append(part)
        return "; ".join(notes) or None
