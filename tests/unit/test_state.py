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


def test_since_moves_with_each_transition() -> None:
    sm = StateMachine()
    before = sm.since
    sm.to(S.STARTING, "go")
    assert sm.since >= before
