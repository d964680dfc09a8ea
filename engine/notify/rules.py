"""What an alert rule watches, and when an alert fires and resolves (pure: no clock, no store, no network).

A rule of a **level** kind compares a figure with its threshold (GPU memory is the GPU's own alert, which has its
hysteresis; serving figures are over the last ``WINDOW_S``; budgets are their share used): it fires once the figure
has been past the threshold for ``for_s``, and resolves once it has been back (below 90 % of the threshold, so a
figure that hovers at it does not flap) for ``for_s``. A rule of an **event** kind fires on the event (a crash loop,
an OOM, a start rolled back, an instance or its node lost) and resolves when its deployment serves again (a
``ready``), or after ``for_s`` with no new such event where nothing marks the end (a GPU's XID). Each alert is sent
once when it fires and once when it resolves: a flapping signal sends nothing until it has held."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

WINDOW_S = 300.0  # serving figures (latency, TTFT, errors) are over this long
CLEAR_RATIO = 0.9  # a level resolves below this share of its threshold

Kind = Literal["gpu_memory", "gpu_temperature", "gpu_errors", "gpu_throttled", "gpu_lost", "ttft_p95",
               "latency_p95", "error_rate", "queue_wait", "oom", "crash_loop", "rolled_back", "instance_lost",
               "budget"]


@dataclass(frozen=True)
class KindInfo:
    title: str
    level: bool  # a figure against a threshold (else: events)
    unit: str = ""
    default_threshold: float | None = None
    default_for_s: float = 60.0
    events: tuple[str, ...] = ()  # the event kinds that fire it
    gpu_alerts: tuple[str, ...] = ()  # the GPU alerts (engine/gpu/alerts.py) it follows


KINDS: dict[str, KindInfo] = {
    "gpu_memory": KindInfo("GPU memory high", False, gpu_alerts=("memory_high",), default_for_s=0),
    "gpu_temperature": KindInfo("GPU temperature high", False, gpu_alerts=("temperature_high",), default_for_s=0),
    "gpu_errors": KindInfo("GPU memory errors (ECC, XID)", False, gpu_alerts=("ecc_error", "xid_error"),
                           default_for_s=0),
    "gpu_throttled": KindInfo("GPU held at its power limit", False, gpu_alerts=("power_at_limit",),
                              default_for_s=0),
    "gpu_lost": KindInfo("GPU lost", False, gpu_alerts=("gpu_lost",), default_for_s=0),
    "ttft_p95": KindInfo("Time to first token P95 above target", True, "s", 2.0, 120.0),
    "latency_p95": KindInfo("Latency P95 above target", True, "s", 30.0, 120.0),
    "error_rate": KindInfo("Error rate above target", True, "share of requests", 0.05, 120.0),
    "queue_wait": KindInfo("Requests wait for a free slot", True, "s", 5.0, 60.0),
    "oom": KindInfo("vLLM ran out of memory", False, events=("oom",), default_for_s=600.0),
    "crash_loop": KindInfo("Crash loop: restarts halted", False, events=("crash_loop",), default_for_s=600.0),
    "rolled_back": KindInfo("A start failed and was rolled back", False, events=("rollback",), default_for_s=600.0),
    "instance_lost": KindInfo("An instance (or its node) was lost", False,
                              events=("instance_failed", "instance_exited", "start_lost"), default_for_s=600.0),
    "budget": KindInfo("Token budget used", True, "share of the budget", 0.8, 0.0),
}


@dataclass
class _State:
    since: float | None = None  # when the condition began to hold (pending), or to be gone (while firing)
    firing: bool = False
    value: float | None = None
    message: str = ""


@dataclass(frozen=True)
class Change:
    """An alert that fired or resolved: what to send and record."""

    rule_id: int
    subject: str
    firing: bool
    value: float | None
    message: str


@dataclass
class Tracker:
    """Each (rule, subject)'s state: pending, firing, resolving; ``observe`` says what changed."""

    states: dict[tuple[int, str], _State] = field(default_factory=dict)

    def level(self, rule_id: int, subject: str, value: float | None, threshold: float, for_s: float, now: float,
              message: str) -> Change | None:
        """A figure against its threshold (None: not known now, which changes nothing)."""
        if value is None:
            return None
        state = self.states.setdefault((rule_id, subject), _State())
        if not state.firing:
            if value < threshold:
                state.since = None
                return None
            state.since = now if state.since is None else state.since
            if now - state.since >= for_s:
                state.firing, state.since, state.value, state.message = True, None, value, message
                return Change(rule_id, subject, True, value, message)
            return None
        state.value = max(state.value or value, value)
        if value >= threshold * CLEAR_RATIO:
            state.since = None
            return None
        state.since = now if state.since is None else state.since
        if now - state.since >= for_s:
            del self.states[(rule_id, subject)]
            return Change(rule_id, subject, False, value, message)
        return None

    def fire(self, rule_id: int, subject: str, now: float, message: str, value: float | None = None
             ) -> Change | None:
        """An event that fires (again: it only keeps the alert from resolving by quiet)."""
        state = self.states.setdefault((rule_id, subject), _State())
        state.since = now  # the quiet starts again
        if state.firing:
            return None
        state.firing, state.value, state.message = True, value, message
        return Change(rule_id, subject, True, value, message)

    def resolve(self, rule_id: int, subject: str, message: str) -> Change | None:
        """What ends an event's alert happened (its deployment serves again; the GPU's own alert cleared)."""
        state = self.states.pop((rule_id, subject), None)
        if state is None or not state.firing:
            return None
        return Change(rule_id, subject, False, state.value, message)

    def quiet(self, rule_id: int, quiet_s: float, now: float) -> list[Change]:
        """Event alerts of a rule with no new event for ``quiet_s``: resolved."""
        out = []
        for (rid, subject), state in list(self.states.items()):
            if rid == rule_id and state.firing and state.since is not None and now - state.since > quiet_s:
                del self.states[(rid, subject)]
                out.append(Change(rid, subject, False, state.value, f"no new event for {quiet_s:.0f} s"))
        return out

    def resume(self, rule_id: int, subject: str, value: float | None, message: str, now: float) -> None:
        """An alert that was firing when the engine stopped: firing again, sent nothing (its resolve will be)."""
        self.states[(rule_id, subject)] = _State(now, True, value, message)

    def forget(self, keep: set[int]) -> None:
        """Rules deleted or disabled: their state goes (an alert firing resolves nowhere)."""
        self.states = {k: v for k, v in self.states.items() if k[0] in keep}

    def firing(self) -> list[tuple[int, str]]:
        return [k for k, v in self.states.items() if v.firing]
