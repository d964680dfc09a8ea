from __future__ import annotations

import pytest

from engine.schemas import EngineState
from engine.serving import InvalidTransitionError, StateMachine

S = EngineState


def test_normal_life_of_an_engine() -> None:
    sm = StateMachine()
    for state in (S.STARTING, S.READY, S.DRAINING, S.STOPPING, S.STOPPED, S.STARTING, S.FAILED, S.STARTING):
        sm.to(state, f"to {state}")
        assert sm.state == state and sm.reason == f"to {state}"


@pytest.mark.parametrize(("start", "target"), [(S.STOPPED, S.READY), (S.STARTING, S.DRAINING),
                                               (S.DRAINING, S.READY), (S.STOPPED, S.STOPPING)])
def test_impossible_transitions_are_refused(start: EngineState, target: EngineState) -> None:
    sm = StateMachine(state=start)
    with pytest.raises(InvalidTransitionError):
        sm.to(target, "nope")
    assert sm.state == start


def test_since_is_the_time_of_the_latest_transition() -> None:
    clock = iter([250.0, 400.0])
    sm = StateMachine(since=100.0, clock=lambda: next(clock))
    assert sm.since == 100.0
    sm.to(S.STARTING, "go")
    assert sm.since == 250.0
    with pytest.raises(InvalidTransitionError):
        sm.to(S.DRAINING, "starting -> draining is not a transition")
    assert sm.since == 250.0  # a refused transition does not move it
    sm.to(S.READY, "up")
    assert sm.since == 400.0
