"""The deployment's serving state machine: stopped → starting → ready → draining → stopping, and failed."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field

from engine.errors import EngineError
from engine.schemas import EngineState

S = EngineState
TRANSITIONS: dict[EngineState, frozenset[EngineState]] = {
    S.STOPPED: frozenset({S.STARTING, S.FAILED}),
    S.STARTING: frozenset({S.READY, S.STOPPING, S.FAILED}),
    S.READY: frozenset({S.DRAINING, S.STOPPING, S.FAILED}),
    S.DRAINING: frozenset({S.STOPPING, S.FAILED}),
    S.STOPPING: frozenset({S.STOPPED, S.FAILED}),
    S.FAILED: frozenset({S.STARTING, S.STOPPING, S.STOPPED}),
}


class InvalidTransitionError(EngineError):
    pass


@dataclass
class StateMachine:
    """Current state with the time it was entered and why; refuses transitions the diagram lacks."""

    state: EngineState = EngineState.STOPPED
    since: float = field(default_factory=lambda: time.time())
    reason: str = "not started yet"
    clock: Callable[[], float] = field(default=time.time, repr=False)  # wall-clock time (tests: a fake clock's)

    def to(self, new: EngineState, reason: str) -> None:
        if new not in TRANSITIONS[self.state]:
            raise InvalidTransitionError(f"{self.state} → {new} is not a transition of the engine ({reason})")
        self.state = new
        self.since = self.clock()
        self.reason = reason

    def can(self, new: EngineState) -> bool:
        return new in TRANSITIONS[self.state]
