"""The autoscaler's decisions (engine/serving/autoscale.py), on their own: delays, bounds, scale to zero and back.
The serving tier proves what the controller does with them."""

from __future__ import annotations

import asyncio
import time
from typing import Any

import pytest
from pydantic import ValidationError

from engine.gateway import Admission
from engine.revisions import EngineSettings
from engine.serving.autoscale import Autoscaler, Policy


def policy(**values: Any) -> Policy:
    return Policy.of(EngineSettings.model_construct(**{"max_num_seqs": 16, **values}))


def run(scaler: Autoscaler, p: Policy, load: int, seconds: int, start: float) -> list[tuple[float, str, int]]:
    """Feed ``load`` requests in flight for ``seconds`` (a sample and a decision a second)."""
    out: list[tuple[float, str, int]] = []
    for t in range(seconds):
        now = start + t
        scaler.sample(now, load, 0)
        d = scaler.decide(p, now, 0, scaler.want or 0)
        if d is not None:
            out.append((now, d.action, d.after))
    return out


def test_up_after_the_delay_down_after_its_own_and_within_the_bounds() -> None:
    p = policy(max_replicas=4, min_replicas=2, target_in_flight=4, scale_up_delay_s=10, scale_down_delay_s=60)
    s = Autoscaler()
    assert run(s, p, 0, 1, 0) == [] and s.want == 2  # replicas 1 is below min_replicas: it starts at 2
    ups = run(s, p, 30, 30, 100)  # asks for 8: 4 at most
    assert ups and ups[0][1:] == ("up", 4) and ups[0][0] - 100 >= 10
    assert s.held is not None and "max_replicas is 4" in s.held
    downs = run(s, p, 5, 120, 200)  # asks for 2
    assert downs[0][1:] == ("down", 2) and downs[0][0] - 200 >= 60
    assert run(s, p, 0, 60, 400) == [] and s.want == 2  # never below min_replicas


def test_a_load_that_comes_and_goes_within_the_delay_moves_nothing() -> None:
    p = policy(max_replicas=4, target_in_flight=4, scale_up_delay_s=10)
    s = Autoscaler()
    for cycle in range(10):  # 3 s busy, 9 s idle: the smoothed load falls under the target in between
        assert run(s, p, 40, 3, cycle * 12) == []
        assert run(s, p, 0, 9, cycle * 12 + 3) == []
    assert s.want == 1


def test_default_target_is_three_quarters_of_max_num_seqs() -> None:
    assert policy(max_replicas=2).target == 12.0 and policy(max_replicas=2, max_num_seqs=1).target == 1.0


def test_scale_to_zero_after_the_idle_time_and_back_at_once_on_a_request() -> None:
    p = policy(replicas=2, scale_to_zero_after_s=300)
    s = Autoscaler()
    run(s, p, 3, 10, 0)
    assert run(s, p, 0, 299, 10) == [] and s.want == 2  # 300 s after the last request, not before
    assert run(s, p, 0, 5, 309)[0][1:] == ("to_zero", 0) and s.asleep
    assert run(s, p, 0, 100, 400) == []
    s.sample(600, 0, 1)  # one request waits in the gateway's queue
    d = s.decide(p, 600, 1, 0)
    assert d is not None and d.action == "wake" and d.after == 2 and "after 2" in d.reason  # no delay
    assert not s.asleep


def test_max_replicas_below_min_replicas_is_refused_naming_the_field() -> None:
    with pytest.raises(ValidationError) as info:
        EngineSettings.model_validate({"model": "demo", "min_replicas": 3, "max_replicas": 2},
                                      context={"data_dir": None})
    errors = info.value.errors()
    assert [e["loc"] for e in errors if "min_replicas" in e["msg"]] == [("max_replicas",)]


def test_never_to_zero_while_nothing_serves_and_idle_time_counts_from_when_it_serves_again() -> None:
    """A deployment stopped (or failed, or starting) for longer than scale_to_zero_after_s is down, not idle:
    once it serves again, its idle time starts then (it went to zero at once on a start, and stayed stopped)."""
    p = policy(scale_to_zero_after_s=60)
    s = Autoscaler()
    for t in range(300):  # nothing serves for 300 s
        s.sample(t, 0, 0)
        assert s.decide(p, t, 0, 0) is None
    for t in range(300, 359):
        s.sample(t, 0, 0)
        assert s.decide(p, t, 0, 1) is None
    s.sample(361, 0, 0)
    d = s.decide(p, 361, 0, 1)
    assert d is not None and d.action == "to_zero"


def test_a_request_between_two_looks_is_activity() -> None:
    p = policy(scale_to_zero_after_s=60)
    s = Autoscaler()
    for t in range(0, 300, 5):  # a 100 ms request every 5 s, never in flight when sampled
        s.sample(t, 0, 0, admitted=t // 5)
        assert s.decide(p, t, 0, 1) is None


def test_scale_to_zero_turned_off_while_asleep_wakes_it_and_new_bounds_take_effect_at_once() -> None:
    s = Autoscaler()
    run(s, policy(scale_to_zero_after_s=10), 0, 20, 0)
    assert s.asleep
    d = s.decide(policy(), 30, 0, 0)
    assert d is not None and d.action == "wake" and s.want == 1 and "off" in d.reason
    d = s.decide(policy(max_replicas=4, min_replicas=3, scale_up_delay_s=60), 31, 0, 1)
    assert d is not None and d.after == 3 and "min_replicas 3" in d.reason  # not after scale_up_delay_s
    d = s.decide(policy(max_replicas=2, min_replicas=1, scale_down_delay_s=600), 32, 0, 3)
    assert d is not None and d.after == 2 and "max_replicas 2" in d.reason


def test_the_load_is_weighted_by_time_not_by_how_often_it_was_looked_at() -> None:
    s = Autoscaler()
    s.sample(0.0, 0, 0)
    s.sample(4.0, 0, 0)  # 4 s with nothing in flight
    for i in range(40):  # then a burst of looks within 0.4 s, each seeing 10 in flight
        s.sample(4.01 + i * 0.01, 10, 0)
    assert s.load < 2.0  # a plain mean of the samples would say 9.5


def test_on_a_queue_wait_target_it_scales_up_on_waits_not_on_in_flight_and_down_only_when_none_waited() -> None:
    p = policy(max_replicas=3, min_replicas=1, target_in_flight=4, target_queue_wait_s=0.5, scale_up_delay_s=5,
               scale_down_delay_s=10)
    s = Autoscaler()

    def feed(load: int, wait: float, seconds: int, start: float) -> list[tuple[float, str, int, str]]:
        out: list[tuple[float, str, int, str]] = []
        for t in range(seconds):
            s.sample(start + t, load, 0, queue_wait=wait)
            d = s.decide(p, start + t, 0, s.want or 0)
            if d is not None:
                out.append((start + t, d.action, d.after, d.reason))
        return out

    assert feed(12, 0.0, 30, 0) == [] and s.want == 1  # 12 in flight, far above 4 a replica: no wait, no change
    ups = feed(12, 2.0, 20, 100)  # requests wait 2 s for a slot: one more each time the delay has held
    assert [u[1:3] for u in ups] == [("up", 2), ("up", 3)] and ups[0][0] - 100 >= 5
    assert "waited up to 2.0 s in the gateway's queue, above target_queue_wait_s 0.5" in ups[0][3]
    assert feed(2, 0.3, 30, 200) == []  # a wait within the target: no fewer
    downs = feed(2, 0.0, 30, 300)  # none waits and 2 in flight fit one replica's target: down, after its delay
    assert downs and downs[0][1:3] == ("down", 1) and downs[0][0] - 300 >= 10


def test_the_admission_s_queue_wait_counts_waits_for_a_slot_not_for_an_instance() -> None:
    asyncio.run(slot_waits())


async def slot_waits() -> None:
    admission = Admission(8, 30.0)
    waiter = asyncio.ensure_future(admission.acquire(time.monotonic() + 5))  # nothing open: waits for an instance
    await asyncio.sleep(0.05)
    assert admission.queue_wait(time.monotonic()) == 0.0
    await admission.open("http://127.0.0.1:1", 1, "a", limit=1)
    first = await waiter
    second = asyncio.ensure_future(admission.acquire(time.monotonic() + 5))  # the one slot is taken: waits for it
    await asyncio.sleep(0.1)
    assert admission.queue_wait(time.monotonic()) >= 0.1  # the oldest still waiting
    await admission.release(first)
    await second
    assert 0.1 <= admission.queue_wait(time.monotonic()) < 1.0  # it ended its wait within the window
    assert admission.queue_wait(time.monotonic() + 10) == 0.0  # and is forgotten after it
