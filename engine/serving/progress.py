"""Where serving stands: the deployment's state machine (stopped, starting, ready, draining, stopping, failed) with
its reason, and the apply under way (or the latest one): its plan, the step it is at, each step as it ran beside
what the plan expected, and the longest stretch with nothing serving."""

from __future__ import annotations

import logging
from datetime import UTC, datetime
from typing import Any, Literal

from engine.clock import Clock
from engine.schemas import ApplyPlanOut, ApplyProgress, EngineState, StepAction, StepTiming
from engine.serving.state import StateMachine

log = logging.getLogger("llmops.serving")
Outcome = Literal["applied", "rejected", "aborted"]


class Progress:
    def __init__(self, clock: Clock) -> None:
        self.clock = clock
        self.sm = StateMachine(since=clock.time(), clock=clock.time)
        self.apply: ApplyProgress | None = None  # the apply under way, or the latest one
        self._gap_since: float | None = None  # since when nothing serves (monotonic)
        self._what = "apply"  # what the apply under way is called in the reason it ends with ("restart", ...)

    # --- the state machine ---------------------------------------------------------------------------------

    @property
    def state(self) -> EngineState:
        return self.sm.state

    def enter(self, state: EngineState, reason: str) -> None:
        if self.sm.state == state:
            self.sm.reason = reason
            return
        self.sm.to(state, reason)
        log.info("engine %s: %s", state, reason)

    def enter_if(self, state: EngineState, reason: str) -> None:
        """Enter ``state`` where the diagram allows it; else only say ``reason``."""
        if self.sm.state == state or self.sm.can(state):
            self.enter(state, reason)
        else:
            self.sm.reason = reason

    def say(self, reason: str) -> None:
        self.sm.reason = reason

    # --- the apply under way -------------------------------------------------------------------------------

    @property
    def applying(self) -> bool:
        return self.apply is not None and self.apply.outcome == "running"

    def begin(self, revision: int, from_revision: int | None, plan: ApplyPlanOut, what: str = "apply") -> None:
        self._what = what
        self.apply = ApplyProgress(revision=revision, from_revision=from_revision, plan=plan, step="starting",
                                   started=datetime.fromtimestamp(self.clock.time(), UTC))

    def step(self, text: str) -> None:
        if self.apply is not None:
            self.apply.step = text
        self.sm.reason = text

    def done(self, outcome: Outcome, serving: str | None = None) -> None:
        """The apply's outcome; ``serving`` (what serves now) becomes the reason of a ready state, written before
        the outcome: a reader off the event loop that sees the outcome (it reads the apply first) sees the reason
        too, never the last step's ("draining instance a") beside "applied"."""
        if self.applying:
            assert self.apply is not None
            self._conclude(serving, outcome)
            if outcome == "applied":  # nothing follows: the last step is over too (the outcome is written last)
                self.apply.step = "done"
            self.apply.outcome = outcome

    def finish(self, serving: str | None = None) -> ApplyProgress | None:
        """The apply has ended (its outcome, if none was said: aborted); ``serving`` as in ``done``."""
        if self.apply is None:
            return None
        running = self.apply.outcome == "running"
        self._conclude(serving, "aborted" if running else self.apply.outcome)
        self.apply.finished = datetime.fromtimestamp(self.clock.time(), UTC)
        self.apply.step = "done"
        if running:
            self.apply.outcome = "aborted"
        return self.apply

    def _conclude(self, serving: str | None, outcome: str) -> None:
        if serving is not None and self.sm.state == EngineState.READY:  # the last step is over: what serves now
            self.sm.reason = f"{serving} ({self._what}: {outcome})"

    def timed(self, action: StepAction, instance: str, seconds: float, in_flight: int,
              start_kind: Any = None) -> None:
        """A step of the apply under way as it ran (its time, beside what the plan expected of such a step)."""
        if not self.applying:
            return
        assert self.apply is not None
        # the plan's n-th step of this action for the n-th one taken: a start's kind is worked out again at its
        # launch, and a start that ended meanwhile may change it (a repeat that missed vLLM's compile cache)
        planned = [s for s in self.apply.plan.step_etas if s.action == action]
        taken = sum(1 for t in self.apply.timings if t.action == action)
        expected = planned[taken].eta_s if taken < len(planned) else None
        self.apply.timings.append(StepTiming(action=action, instance=instance, seconds=round(seconds, 2),
                                             start_kind=start_kind, in_flight=in_flight, eta_s=expected))

    # --- stretches with nothing serving ----------------------------------------------------------------------

    def gap_opened(self) -> None:
        if self._gap_since is None:
            self._gap_since = self.clock.monotonic()

    def gap_closed(self) -> None:
        if self._gap_since is not None:
            gap = self.clock.monotonic() - self._gap_since
            self._gap_since = None
            if self.applying:
                assert self.apply is not None
                self.apply.longest_gap_s = round(max(self.apply.longest_gap_s or 0.0, gap), 2)
