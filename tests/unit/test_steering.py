"""Which gateway workers take new connections (engine/gateway/steering.py): as few as their load needs, more at
once when it grows, one fewer at a time when it stays low, the next one at once when one stops running, and a worker
clearly busier than one that accepts lets its connections go."""

from __future__ import annotations

from engine.edge import Shedding
from engine.gateway.steering import HOLD_S, IDLE, Steering
from engine.gateway.wire import Steer


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def accepting(says: list[Steer]) -> list[int]:
    return [i for i, say in enumerate(says) if say.accept]


def test_a_light_load_goes_to_the_first_worker_only() -> None:
    steering = Steering(0.5, clock=Clock())
    assert accepting(steering.decide([0.0, 0.0, 0.0, 0.0])) == [0]
    assert accepting(steering.decide([0.3, 0.01, 0.01, 0.01])) == [0]
    assert not any(say.shed for say in steering.decide([0.3, 0.01, 0.01, 0.01]))


def test_a_growing_load_opens_as_many_workers_as_it_needs_at_once() -> None:
    steering = Steering(0.5, clock=Clock())
    steering.decide([0.1, 0.0, 0.0, 0.0])
    assert accepting(steering.decide([0.9, 0.0, 0.0, 0.0]))[-1] == 1  # two cores' halves for 0.9 of a core
    says = steering.decide([0.95, 0.6, 0.0, 0.0])  # 1.55: four halves
    assert steering.n == 4 and says[2].accept and says[3].accept


def test_the_load_must_stay_low_before_a_worker_stops_taking_connections_and_then_only_one_does() -> None:
    clock = Clock()
    steering = Steering(0.5, clock=clock)
    steering.decide([0.5, 0.5, 0.5, 0.4])
    assert steering.n == 4
    steering.decide([0.1, 0.1, 0.0, 0.0])
    clock.now += HOLD_S - 0.1
    assert accepting(steering.decide([0.1, 0.1, 0.0, 0.0])) == [0, 1, 2, 3]  # not yet
    clock.now += 0.2
    assert accepting(steering.decide([0.1, 0.1, 0.0, 0.0])) == [0, 1, 2]  # one fewer
    clock.now += 0.2
    assert accepting(steering.decide([0.1, 0.1, 0.0, 0.0])) == [0, 1, 2]  # the next after another hold
    clock.now += HOLD_S
    assert accepting(steering.decide([0.1, 0.1, 0.0, 0.0])) == [0, 1]


def test_a_load_near_what_one_worker_fewer_could_take_keeps_them_all() -> None:
    clock = Clock()
    steering = Steering(0.5, clock=clock)
    steering.decide([0.5, 0.45, 0.0, 0.0])
    for _ in range(5):
        clock.now += HOLD_S
        assert accepting(steering.decide([0.38, 0.0, 0.0, 0.0])) == [0, 1]  # 0.38 > 0.7 x 0.5: not one fewer


def test_a_worker_that_stops_running_hands_new_connections_to_the_next_at_once() -> None:
    steering = Steering(0.5, clock=Clock())
    assert accepting(steering.decide([0.1, 0.0, 0.0])) == [0]
    assert accepting(steering.decide([None, 0.0, 0.0])) == [1]
    assert accepting(steering.decide([0.0, 0.0, 0.0])) == [0]  # back: the first again


def test_a_worker_clearly_busier_than_one_that_accepts_sheds_and_takes_nothing_new() -> None:
    steering = Steering(0.5, clock=Clock())
    says = steering.decide([0.95, 0.1, 0.0, 0.0])  # its keep-alive connections stayed on it as the load grew
    assert says[0] == Steer(accept=False, shed=0.5)  # half the gap to an idle one that accepts moves
    assert says[1].accept and not says[1].shed
    says = steering.decide([0.6, 0.5, 0.1, 0.0])  # 0.6 against 0.1 on one that accepts
    assert [say.shed for say in says] == [0.417, 0.0, 0.0, 0.0] and accepting(says) == [1, 2]  # (0.5 / 1.2)
    even = steering.decide([0.6, 0.55, 0.5, 0.45])  # busy, but none much busier than another: none sheds
    assert not any(say.shed for say in even) and accepting(even) == [0, 1, 2, 3]


def test_the_only_worker_running_never_sheds_and_always_accepts() -> None:
    steering = Steering(0.5, clock=Clock())
    assert steering.decide([None, 1.0, None]) == [Steer(False, 0.0), Steer(True, 0.0), Steer(False, 0.0)]


def test_share_zero_lets_every_running_worker_accept_as_before() -> None:
    steering = Steering(0.0, clock=Clock())
    assert steering.decide([0.9, 0.0, None]) == [Steer(True, 0.0), Steer(True, 0.0), Steer(False, 0.0)]


def test_a_worker_that_no_longer_accepts_lets_its_busy_connections_go_back_to_the_first() -> None:
    clock = Clock()
    steering = Steering(0.5, clock=clock)
    steering.decide([0.6, 0.0])  # a burst at the start: the second opens, and takes some clients
    steering.decide([0.1, 0.08])
    clock.now += HOLD_S + 0.1
    says = steering.decide([0.1, 0.08])  # the load fell back: the first alone takes new connections
    assert says == [Steer(True, 0.0), Steer(False, 1.0)]  # and all the second's clients go back to it
    assert steering.decide([0.18, IDLE / 2]) == [Steer(True, 0.0), Steer(False, 0.0)]  # idle: nothing to let go


def test_a_share_of_responses_let_go_is_exactly_that_share_and_none_once_it_is_zero() -> None:
    shedding = Shedding()
    assert not any(shedding.take() for _ in range(100))
    shedding.share = 0.25
    assert sum(shedding.take() for _ in range(100)) == 25
    shedding.share = 1.0
    assert all(shedding.take() for _ in range(10))
    shedding.share = 0.0
    assert not any(shedding.take() for _ in range(10))
