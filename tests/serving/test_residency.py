"""Many models on one GPU (issue 33, item 3), over fake vLLM children and the test's clock: deployments whose
gpu_memory_utilization adds up to more than the GPU, no more of them awake at once than fits, a request for one
asleep putting the least recently used idle one to sleep and waiting for it, a pinned one never put to sleep, a busy
one put to sleep only once its requests end — and not one request failed through any of it."""

from __future__ import annotations

from pathlib import Path

from tests.testkit.serving import Clients, Scenario

SHARE = {"gpu_memory_utilization": 0.85, "scale_to_zero_after_s": 3600.0}


def awake(sc: Scenario) -> list[str]:
    """The deployments with an instance that holds GPU memory now (alive and not asleep)."""
    return [c.deployment.name for c in sc.controllers
            if any(i.role != "sleeping" and not i.child.exited for i in c.instances)]


def answered(clients: Clients, n: int) -> bool:
    return len([r for r in clients.results if r.ok]) >= n


async def test_four_models_at_0_85_take_turns_on_one_gpu_and_no_request_fails(tmp_path: Path) -> None:
    async with Scenario(tmp_path, build="cuda", values=SHARE,
                        neighbours={name: SHARE for name in ("b", "c", "d")}) as sc:
        # at the engine's start only what fits comes up; the others sleep until a request asks for them
        await sc.until(lambda: awake(sc) == ["demo"] and all(c.work_name is None for c in sc.controllers)
                       and all(c.scaler.asleep for c in sc.neighbours.values()))
        boot = sc.neighbours["b"].events.events(limit=50, kinds=["autoscale"])
        assert boot and "no request for it yet" in boot[0].message
        order = ["b", "c", "demo", "d", "b", "c"]
        for model in order:
            async with sc.clients(2, model=model) as clients:
                await sc.until(lambda c=clients: answered(c, 4), within_s=400)  # type: ignore[misc]
            assert clients.failed == [], (model, clients.failed[:1])
            assert awake(sc) == [model]
            await sc.ticks(2)
        assert max(seen.awake for seen in sc.seen) == 1  # never two at 0.85 on the GPU at once
        # each switch said whom it put to sleep and why (the least recently used), and the one woken waited for it
        evicted = [e for e in sc.event_list("autoscale") if "to make room for" in e.message]  # (every deployment's)
        assert len(evicted) == len(order)
        to_c = next(e for e in sc.neighbours["b"].events.events(limit=200, kinds=["autoscale"])
                    if "make room for c" in e.message)
        assert to_c.data["action"] == "to_zero" and "least recently used" in to_c.message
        waited = sc.neighbours["c"].events.events(limit=200, kinds=["room_waiting"])
        assert waited and "b" in waited[-1].message
        # the second round wakes what slept: no further start (one per deployment)
        assert sum(1 for f in sc.fakes) == 4


async def test_a_busy_neighbour_is_put_to_sleep_only_once_its_requests_end(tmp_path: Path) -> None:
    async with Scenario(tmp_path, build="cuda", values=SHARE, neighbours={"b": SHARE}) as sc:
        await sc.until(lambda: awake(sc) == ["demo"] and sc.controller.work_name is None)
        async with sc.clients(3, model="demo") as busy:
            await sc.until(lambda: answered(busy, 3))
            async with sc.clients(1, model="b") as waiting:
                await sc.ticks(20)
                assert awake(sc) == ["demo"] and waiting.results == []  # demo is serving: b waits, not refused
                held = sc.neighbours["b"].autoscale_view()
                assert held is not None and held.held is not None and "demo is serving" in held.held
                await busy.stop()
                await sc.until(lambda: answered(waiting, 2), within_s=120)
        assert busy.failed == [] and waiting.failed == []
        assert awake(sc) == ["b"] and max(seen.awake for seen in sc.seen) == 1


async def test_a_pinned_neighbour_is_never_put_to_sleep_and_the_wait_says_why(tmp_path: Path) -> None:
    pinned = {"gpu_memory_utilization": 0.85}  # no scale_to_zero_after_s: pinned awake
    async with Scenario(tmp_path, build="cuda", values=pinned, neighbours={"b": SHARE}, queue_timeout_s=0.3) as sc:
        await sc.until(lambda: awake(sc) == ["demo"] and sc.controller.work_name is None
                       and sc.neighbours["b"].scaler.asleep)
        async with sc.clients(1, model="b") as waiting:
            await sc.ticks(10)
            view = sc.neighbours["b"].autoscale_view()
            assert view is not None and view.held is not None and "demo is pinned awake" in view.held
            said = sc.neighbours["b"].events.events(limit=20, kinds=["room_waiting"])
            assert len(said) == 1 and said[0].severity == "warning"
            await sc.until(lambda: bool(waiting.results), within_s=3000)  # the queue's timeout answers it (real s)
            assert not waiting.results[0].ok and waiting.results[0].status in (503, 504)
        assert awake(sc) == ["demo"] and not [e for e in sc.event_list("autoscale") if "make room" in e.message]


async def test_the_one_that_put_a_neighbour_to_sleep_comes_back_first(tmp_path: Path) -> None:
    """b puts demo to sleep; a request for demo arriving meanwhile waits: b serves first, then demo's turn comes
    when b is idle, and neither client sees a failure. (Which of two controllers that look in the same instant gets
    the room is the residency's reservation: tests/unit/test_residency.py.)"""
    async with Scenario(tmp_path, build="cuda", values=SHARE, neighbours={"b": SHARE}) as sc:
        await sc.until(lambda: awake(sc) == ["demo"] and sc.controller.work_name is None
                       and sc.neighbours["b"].scaler.asleep)
        async with sc.clients(1, model="b") as first:
            await sc.until(lambda: sc.controller.scaler.asleep or sc.controller.work_name == "to_zero")
            async with sc.clients(1, model="demo") as second:
                await sc.until(lambda: answered(first, 2), within_s=120)
                assert awake(sc) == ["b"] and second.results == []
                await first.stop()
                await sc.until(lambda: answered(second, 2), within_s=120)
        assert first.failed == [] and second.failed == []
        assert max(seen.awake for seen in sc.seen) == 1
