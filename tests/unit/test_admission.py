"""The gateway's admission gate: bounded waiting room, longest wait, drain."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Coroutine
from typing import Any

import pytest

from engine.errors import QueueFullError, QueueTimeoutError, UpstreamUnavailableError
from engine.gateway import Admission
from tests.testkit.wait import eventually


def run(coro: Coroutine[Any, Any, None]) -> None:
    asyncio.run(coro)


def test_open_gate_admits_at_once() -> None:
    async def go() -> None:
        gate = Admission(queue_size=2, queue_timeout_s=1)
        await gate.open("http://x")
        up = await gate.acquire(time.monotonic() + 1)
        assert up.url == "http://x"
        assert gate.in_flight == 1 and up.outstanding == 1
        await gate.release(up)
        assert gate.in_flight == 0 and up.outstanding == 0

    run(go())


def test_waiters_go_to_the_new_upstream_when_it_opens() -> None:
    async def go() -> None:
        gate = Admission(queue_size=4, queue_timeout_s=5)
        waiters = [asyncio.create_task(gate.acquire(time.monotonic() + 5)) for _ in range(3)]
        await eventually(lambda: gate.waiting == 3, 5, what="three waiters")
        await gate.open("http://new", revision=7)
        assert [(u.url, u.revision) for u in await asyncio.gather(*waiters)] == [("http://new", 7)] * 3
        assert gate.waiting == 0 and gate.in_flight == 3

    run(go())


def test_queue_is_bounded() -> None:
    async def go() -> None:
        gate = Admission(queue_size=1, queue_timeout_s=5)
        first = asyncio.create_task(gate.acquire(time.monotonic() + 5))
        await eventually(lambda: gate.waiting == 1, 5, what="the first waiter")
        with pytest.raises(QueueFullError):
            await gate.acquire(time.monotonic() + 5)
        assert gate.rejected == 1
        first.cancel()

    run(go())


def test_longest_wait_is_bounded() -> None:
    async def go() -> None:
        gate = Admission(queue_size=5, queue_timeout_s=0.2)
        with pytest.raises(QueueTimeoutError):
            await gate.acquire(time.monotonic() + 0.2)
        assert gate.waiting == 0

    run(go())


def test_drain_waits_for_in_flight_requests() -> None:
    async def go() -> None:
        gate = Admission(queue_size=5, queue_timeout_s=1)
        await gate.open("http://x")
        up = await gate.acquire(time.monotonic() + 1)
        await gate.close()

        draining = asyncio.create_task(gate.drain(timeout=5))
        await asyncio.sleep(0)  # the drain is under way ...
        assert not draining.done()
        await gate.release(up)  # ... and ends when the last request does
        assert await draining == 0

    run(go())


def test_drain_gives_up_after_its_timeout() -> None:
    async def go() -> None:
        gate = Admission(queue_size=5, queue_timeout_s=1)
        await gate.open("http://x")
        await gate.acquire(time.monotonic() + 1)
        assert await gate.drain(timeout=0.1) == 1

    run(go())


def test_refusal_turns_waiting_into_an_immediate_503() -> None:
    async def go() -> None:
        gate = Admission(queue_size=5, queue_timeout_s=10)
        waiter = asyncio.create_task(gate.acquire(time.monotonic() + 10))
        await eventually(lambda: gate.waiting == 1, 5, what="the waiter")
        await gate.refuse("stopped by an operator")
        with pytest.raises(UpstreamUnavailableError, match="operator"):
            await waiter
        with pytest.raises(UpstreamUnavailableError):
            await gate.acquire(time.monotonic() + 10)
        await gate.open("http://x")
        assert gate.refusal is None
        assert (await gate.acquire(time.monotonic() + 1)).url == "http://x"

    run(go())


def test_requests_go_to_the_upstream_with_the_fewest_outstanding() -> None:
    async def go() -> None:
        gate = Admission(queue_size=5, queue_timeout_s=1)
        await gate.open("http://a", 1, instance="a")
        await gate.open("http://b", 2, instance="b")
        taken = [await gate.acquire(time.monotonic() + 1) for _ in range(4)]
        assert sorted(u.instance for u in taken) == ["a", "a", "b", "b"]
        a_slots = [u for u in taken if u.instance == "a"]
        await gate.release(a_slots[0])
        await gate.release(a_slots[1])  # a is idle, b has two
        assert (await gate.acquire(time.monotonic() + 1)).instance == "a"

    run(go())


def test_closing_one_upstream_drains_it_while_the_other_serves() -> None:
    async def go() -> None:
        gate = Admission(queue_size=5, queue_timeout_s=1)
        await gate.open("http://a", 1, instance="a")
        old = await gate.acquire(time.monotonic() + 1)
        await gate.open("http://b", 2, instance="b")
        closed = await gate.close("a")
        assert [u.instance for u in closed] == ["a"]
        assert (await gate.acquire(time.monotonic() + 1)).instance == "b"  # new requests: b only
        draining = asyncio.create_task(gate.drain(5, closed))
        await asyncio.sleep(0)
        assert not draining.done()  # a's request is still in flight; b's does not count
        await gate.release(old)
        assert await draining == 0
        assert gate.in_flight == 1

    run(go())


def test_a_new_upstream_takes_its_first_requests_while_the_old_one_still_serves() -> None:
    """An apply's handover: the old upstream stays open until the new one has ended its first requests."""
    async def go() -> None:
        gate = Admission(queue_size=5, queue_timeout_s=1)
        await gate.open("http://a", 1, instance="a")
        busy = [await gate.acquire(time.monotonic() + 1) for _ in range(3)]
        new = await gate.open("http://b", 2, instance="b")
        handover = asyncio.create_task(gate.finished(new, 2, 5))
        first, second = [await gate.acquire(time.monotonic() + 1) for _ in range(2)]
        assert first.instance == second.instance == "b"  # the fewest in flight
        await gate.release(first)
        await asyncio.sleep(0)
        assert not handover.done()  # one of two
        await gate.release(busy[0])  # the old one's requests do not count
        await asyncio.sleep(0)
        assert not handover.done()
        await gate.release(second)
        assert await handover is True
        assert await gate.finished(new, 3, 0.05) is False  # bounded: it says it gave up
        closing = asyncio.create_task(gate.finished(new, 3, 5))
        await asyncio.sleep(0)
        await gate.close("b")
        assert await closing is False  # a closed upstream ends the wait at once

    run(go())


def test_an_instance_is_held_to_its_limit_and_a_new_one_takes_effect_at_once() -> None:
    """max_num_seqs under a higher ceiling: the gateway runs at most ``limit`` requests on the instance, the
    rest wait in order; raising the limit lets the next one in at once (no restart)."""
    async def go() -> None:
        gate = Admission(queue_size=2, queue_timeout_s=5)
        await gate.open("http://x", revision=1, instance="a", limit=2)
        first = [await gate.acquire(time.monotonic() + 5) for _ in range(2)]
        third = asyncio.create_task(gate.acquire(time.monotonic() + 5))
        fourth = asyncio.create_task(gate.acquire(time.monotonic() + 5))
        await eventually(lambda: gate.waiting == 2, 5, what="two waiting for a slot")
        assert not third.done() and gate.in_flight == 2
        await gate.release(first[0])  # a slot frees: the first waiter takes it, in order
        await eventually(lambda: third.done(), 5, what="the first waiter admitted")
        assert not fourth.done()
        late = asyncio.create_task(gate.acquire(time.monotonic() + 5))  # no jumping the queue on the fast path
        await asyncio.sleep(0)
        assert not late.done() and gate.waiting == 2
        await gate.relabel("a", 2, 4)  # max_num_seqs 2 → 4, within the ceiling: in effect for the next request
        await eventually(lambda: fourth.done() and late.done(), 5, what="the waiters, under the new limit")
        assert gate.in_flight == 4 and gate.upstreams[0].revision == 2
        # past queue_size nothing is refused: waiting for a slot is load, not an outage
        more = [asyncio.create_task(gate.acquire(time.monotonic() + 5)) for _ in range(5)]
        await eventually(lambda: gate.waiting == 5, 5, what="five waiting for a slot")
        await gate.relabel("a", 2, None)
        await asyncio.gather(*more)

    run(go())


def test_only_what_a_running_instance_can_take_on_is_a_soft_change() -> None:
    from engine.db import Revision
    from engine.revisions import EngineSettings
    from engine.serving import Instance, gateway_limit, soft_change

    base: dict[str, Any] = {"model": "/m", "served_model_name": "demo", "max_num_seqs": 16, "max_num_seqs_ceiling": 64,
            "replicas": 1, "gpu_memory_utilization": 0.85}
    inst = Instance("a", child=None, revision=Revision(id=1, values=base),  # type: ignore[arg-type]
                    settings=EngineSettings.model_construct(**base), launched_seqs=64)
    assert gateway_limit(inst) == 16
    assert soft_change(inst, {**base, "max_num_seqs": 48})  # within the ceiling it was started with
    assert soft_change(inst, {**base, "replicas": 3})
    assert not soft_change(inst, {**base, "max_num_seqs": 64, "max_num_seqs_ceiling": None})  # a launch change
    assert not soft_change(inst, {**base, "max_num_seqs": 65, "max_num_seqs_ceiling": None})  # above: restart
    assert not soft_change(inst, {**base, "max_num_seqs_ceiling": 128})  # a new ceiling: restart
    assert not soft_change(inst, {**base, "gpu_memory_utilization": 0.8})
    inst.settings = EngineSettings.model_construct(**{**base, "max_num_seqs": 64})
    assert gateway_limit(inst) == inst.settings.max_num_seqs  # at the ceiling too: the rest wait fairly here
    plain = {**base, "max_num_seqs_ceiling": None}  # no headroom asked for: a change restarts, as before
    inst = Instance("a", child=None, revision=Revision(id=1, values=plain),  # type: ignore[arg-type]
                    settings=EngineSettings.model_construct(**plain), launched_seqs=16)
    assert not soft_change(inst, {**plain, "max_num_seqs": 8}) and soft_change(inst, {**plain, "replicas": 2})


def _order_served(gate: Admission, arrivals: list[tuple[str, float]], slots: int = 1) -> list[str]:
    """Queue ``arrivals`` (flow, weight) behind ``slots`` busy slots, then free slots one at a time: the flows in
    the order they were let through."""
    async def go() -> list[str]:
        busy = [await gate.acquire(time.monotonic() + 5) for _ in range(slots)]
        served: list[str] = []

        async def wait(flow: str, weight: float) -> None:
            up = await gate.acquire(time.monotonic() + 5, None, (flow, weight))
            served.append(flow)
            await asyncio.sleep(0)  # (let the others queue their turn first)
            held.append((up, flow))

        held: list[Any] = []
        tasks = []
        for flow, weight in arrivals:
            tasks.append(asyncio.create_task(wait(flow, weight)))
            await asyncio.sleep(0)  # arrive in this order
        for up in busy:
            await gate.release(up)
        while len(served) < len(arrivals):
            await eventually(lambda: bool(held), 5, what="a request let through")
            up, flow = held.pop(0)
            await gate.release(up, flow=flow)
        await asyncio.gather(*tasks)
        return served
    return asyncio.run(go())


async def _one_slot() -> Admission:
    gate = Admission(queue_size=100, queue_timeout_s=5)
    await gate.open("http://x", limit=1)
    return gate


def test_a_flow_sending_ten_times_as_many_requests_does_not_push_another_s_back() -> None:
    """Key A queues 10 requests before key B's one: first come, first served would let B through last; the fair
    queue lets it through right after A's first."""
    gate = asyncio.run(_one_slot())
    order = _order_served(gate, [("A", 1.0)] * 10 + [("B", 1.0)])
    assert order.index("B") <= 1, order


def test_with_one_flow_the_queue_is_first_come_first_served() -> None:
    gate = asyncio.run(_one_slot())
    names = [f"r{i}" for i in range(8)]

    async def go() -> list[int]:
        busy = await gate.acquire(time.monotonic() + 5)
        served: list[int] = []

        async def wait(i: int) -> None:
            up = await gate.acquire(time.monotonic() + 5)
            served.append(i)
            await gate.release(up)

        tasks = []
        for i in range(len(names)):
            tasks.append(asyncio.create_task(wait(i)))
            await asyncio.sleep(0)
        await gate.release(busy)
        await asyncio.gather(*tasks)
        return served
    assert asyncio.run(go()) == list(range(len(names)))


def test_a_flow_of_twice_the_weight_is_let_through_twice_as_often_while_both_wait() -> None:
    gate = asyncio.run(_one_slot())
    order = _order_served(gate, [("heavy", 2.0)] * 12 + [("light", 1.0)] * 12)
    first = order[:12]
    assert first.count("heavy") == 8 and first.count("light") == 4, order


def test_a_waiting_request_that_gives_up_leaves_no_trace_in_the_queue() -> None:
    async def go() -> None:
        gate = await _one_slot()
        busy = await gate.acquire(time.monotonic() + 5)
        with pytest.raises(QueueTimeoutError):
            await gate.acquire(time.monotonic() + 0.05, None, ("A", 1.0))
        cancelled = asyncio.create_task(gate.acquire(time.monotonic() + 5, None, ("B", 1.0)))
        await asyncio.sleep(0.01)
        cancelled.cancel()
        with pytest.raises(asyncio.CancelledError):
            await cancelled
        assert gate.waiting == 0
        waiting = asyncio.create_task(gate.acquire(time.monotonic() + 5, None, ("C", 1.0)))
        await asyncio.sleep(0.01)
        await gate.release(busy)
        up = await waiting  # the slot went to the one still waiting, none to those that left
        assert gate.in_flight == 1 and up.outstanding == 1
        await gate.release(up)
        assert gate.in_flight == 0
    run(go())


def test_a_light_flow_finds_a_slot_free_at_once_while_a_heavy_one_has_every_other(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """At capacity, fair order alone makes B wait for a slot to free; the headroom kept while B is about lets B's
    request go at once. Alone, A has every slot; once B is quiet (ACTIVE_S) A takes the headroom back."""
    from engine.gateway import admission as module

    monkeypatch.setattr(module, "ACTIVE_S", 0.4)

    async def go() -> None:
        gate = Admission(queue_size=100, queue_timeout_s=5)
        await gate.open("http://x", limit=4)
        alone = [await gate.acquire(time.monotonic() + 1, None, ("A", 1.0)) for _ in range(4)]
        assert gate.in_flight == 4  # nobody else about: every slot
        for up in alone:
            await gate.release(up, flow="A")
        b = await gate.acquire(time.monotonic() + 1, None, ("B", 1.0))
        await gate.release(b, flow="B")  # B has sent: it is about for ACTIVE_S
        heavy = [asyncio.create_task(gate.acquire(time.monotonic() + 5, None, ("A", 1.0))) for _ in range(8)]
        await eventually(lambda: gate.in_flight == 3 and gate.waiting == 5, 1, what="A held to three slots")
        began = time.monotonic()
        b = await gate.acquire(time.monotonic() + 1, None, ("B", 1.0))
        assert time.monotonic() - began < 0.05 and gate.in_flight == 4  # at once, beside A's three
        await gate.release(b, flow="B")
        # B quiet: A takes the fourth slot back (within a look of ACTIVE_S / 4 after B leaves it)
        await eventually(lambda: gate.in_flight == 4 and gate.waiting == 4, 2, what="A back to every slot")
        for task in heavy:
            task.cancel()
        await asyncio.gather(*heavy, return_exceptions=True)
    run(go())


def test_a_burst_that_timed_out_does_not_push_its_flow_behind_the_others() -> None:
    """Requests that gave up waiting never had a slot: they must not count in their flow's place (A's 20 timed-out
    requests once put its next ones 20 turns behind B's)."""
    async def go() -> list[str]:
        gate = await _one_slot()
        busy = await gate.acquire(time.monotonic() + 5)
        gave_up = [asyncio.create_task(gate.acquire(time.monotonic() + 0.05, None, ("A", 1.0))) for _ in range(20)]
        for task in gave_up:
            with pytest.raises(QueueTimeoutError):
                await task
        served: list[str] = []

        async def wait(flow: str) -> None:
            up = await gate.acquire(time.monotonic() + 5, None, (flow, 1.0))
            served.append(flow)
            await gate.release(up, flow=flow)

        tasks = []
        for flow in ["B", "B", "B", "A", "A", "A"]:
            tasks.append(asyncio.create_task(wait(flow)))
            await asyncio.sleep(0)
        await gate.release(busy)
        await asyncio.gather(*tasks)
        return served
    order = asyncio.run(go())
    assert order.index("A") <= 2, order  # A's first goes within B's first turns, not after all of B's
