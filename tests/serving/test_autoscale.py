"""Capacity that follows demand (issue 33), over fake vLLM children and the test's clock: replicas that follow
the load up and down (a replica retired is drained first: no request lost), a count held at max_replicas or by a
lack of room and saying why, and scale to zero — stopped on the CPU build, asleep on CUDA — with the first request
after it waiting in the gateway's queue and answered."""

from __future__ import annotations

from pathlib import Path

from tests.testkit.serving import Scenario

SCALING = {"max_replicas": 3, "min_replicas": 1, "target_in_flight": 2.0, "scale_up_delay_s": 5.0,
           "scale_down_delay_s": 20.0}


def serving_count(sc: Scenario) -> int:
    return len(sc.controller.instances.serving())


async def test_replicas_follow_the_load_up_and_back_down_and_no_request_is_lost(tmp_path: Path) -> None:
    async with Scenario(tmp_path, values=SCALING) as sc:
        await sc.until(sc.serving_revision(1))
        assert sc.snapshot().autoscale is not None and sc.snapshot().autoscale.wanted == 1  # type: ignore[union-attr]
        async with sc.clients(6) as busy:
            up_from = sc.clock.monotonic()
            await sc.until(lambda: serving_count(sc) == 3, within_s=200)
            decisions = sc.event_list("autoscale")
            assert [e.data["action"] for e in decisions] == ["up"]
            up = decisions[0]
            assert up.data["from"] == 1 and up.data["to"] == 3 and up.data["load"] >= 4
            assert "per replica" in up.message and "target of 2" in up.message
            # the load asked for more for scale_up_delay_s before the count moved, not at the first tick
            assert sc.clock.monotonic() - up_from >= 5
            await sc.ticks(5)
            status = sc.snapshot().autoscale
            assert status is not None and status.wanted == 3 and status.serving == 3 and status.held is None
        async with sc.clients(1) as light:
            await sc.until(lambda: serving_count(sc) == 1 and sc.controller.work_name is None, within_s=200)
            await sc.ticks(3)
        down = sc.event_list("autoscale")[-1]
        assert down.data["action"] == "down" and down.data["to"] == 1 and "drained first" in down.message
        assert sc.event_list("drained") or sc.kinds().count("stopped") >= 2
        assert busy.failed == [] and light.failed == [] and sc.longest_gap == 0
        assert len(busy.results) > 50 and len(light.results) > 5


async def test_a_short_burst_moves_nothing(tmp_path: Path) -> None:
    """Load above the target for less than scale_up_delay_s: the count stays (no flapping on a blip)."""
    async with Scenario(tmp_path, values={**SCALING, "scale_up_delay_s": 30.0}) as sc:
        await sc.until(sc.serving_revision(1))
        async with sc.clients(6):
            await sc.ticks(10)
            pending = sc.snapshot().autoscale
            assert pending is not None and pending.pending is not None and "to 3 replica(s)" in pending.pending
        await sc.ticks(40)
        assert sc.event_list("autoscale") == [] and serving_count(sc) == 1
        assert sc.snapshot().autoscale.pending is None  # type: ignore[union-attr]


async def test_at_max_replicas_it_says_why_it_does_not_scale_once(tmp_path: Path) -> None:
    async with Scenario(tmp_path, values={**SCALING, "max_replicas": 2}) as sc:
        await sc.until(sc.serving_revision(1))
        async with sc.clients(10) as clients:
            await sc.until(lambda: serving_count(sc) == 2, within_s=200)
            await sc.ticks(10)
            first = sc.event_list("autoscale_held")[0].message
            async with sc.clients(6) as more:  # the load moves while held: still the one warning, a live status
                await sc.until(lambda: (sc.snapshot().autoscale.held or first) not in first,  # type: ignore[union-attr]
                               within_s=100)
                await sc.ticks(5)
            held = sc.event_list("autoscale_held")
            assert len(held) == 1 and "max_replicas is 2" in held[0].message and held[0].severity == "warning"
            status = sc.snapshot().autoscale
            assert status is not None and status.held is not None and "max_replicas is 2" in status.held
        assert clients.failed == [] and more.failed == []
        await sc.ticks(30)  # the load stayed within max_replicas for scale_down_delay_s: the episode is over
        async with sc.clients(10):
            await sc.until(lambda: len(sc.event_list("autoscale_held")) >= 2, within_s=200)
            await sc.ticks(10)
        assert len(sc.event_list("autoscale_held")) == 2


async def test_held_again_after_a_stop_and_start_is_said_again(tmp_path: Path) -> None:
    """A stop ends the episode: the same count held after the next start is a new warning, not a silent one (the
    load's own end of an episode, scale_down_delay_s within max_replicas, is too long to happen meanwhile)."""
    async with Scenario(tmp_path, values={**SCALING, "max_replicas": 2, "scale_down_delay_s": 3600.0}) as sc:
        await sc.until(sc.serving_revision(1))
        async with sc.clients(10) as clients:
            await sc.until(lambda: len(sc.event_list("autoscale_held")) == 1, within_s=200)
            sc.controller.request_stop()
            await sc.until(lambda: not sc.controller.instances, within_s=200)
            sc.controller.request_start()
            await sc.until(lambda: len(sc.event_list("autoscale_held")) == 2, within_s=300)
        assert all("max_replicas is 2" in e.message for e in sc.event_list("autoscale_held"))
        assert clients.results


async def test_a_new_max_replicas_while_held_is_said_at_its_own_value(tmp_path: Path) -> None:
    async with Scenario(tmp_path, values=SCALING) as sc:
        await sc.until(sc.serving_revision(1))
        async with sc.clients(12) as clients:
            await sc.until(lambda: serving_count(sc) == 3, within_s=200)
            await sc.until(lambda: len(sc.event_list("autoscale_held")) == 1, within_s=100)
            revision = sc.write({"max_replicas": 2}, note="fewer replicas")
            await sc.until(lambda: serving_count(sc) == 2 and len(sc.event_list("autoscale_held")) == 2,
                           within_s=200)
            await sc.ticks(10)
        held = sc.event_list("autoscale_held")
        assert len(held) == 2 and "max_replicas is 3" in held[0].message
        assert held[1].revision_id == revision.id and "max_replicas is 2" in held[1].message, held[1].message
        assert clients.failed == []


async def test_a_replica_the_load_asks_for_waits_for_room_and_says_so(tmp_path: Path) -> None:
    async with Scenario(tmp_path, values=SCALING) as sc:
        await sc.until(sc.serving_revision(1))
        sc.capacity.room = "6.0 GiB free on the host, 7.2 GiB needed"
        async with sc.clients(6) as clients:
            await sc.ticks(30)
            waiting = sc.event_list("replica_waiting")
            assert len(waiting) == 1 and "7.2 GiB needed" in waiting[0].message
            assert serving_count(sc) == 1 and len(sc.controller.instances) == 1
            sc.capacity.room = None
            await sc.until(lambda: serving_count(sc) == 3, within_s=200)
        assert clients.failed == []


async def test_a_fixed_count_is_kept_and_only_changes_with_the_revision(tmp_path: Path) -> None:
    async with Scenario(tmp_path, values={"replicas": 2}) as sc:
        await sc.until(sc.serving_revision(1, instances=2))
        async with sc.clients(12):
            await sc.ticks(30)
        await sc.ticks(30)
        assert serving_count(sc) == 2 and sc.event_list("autoscale") == []
        status = sc.snapshot().autoscale
        assert status is not None and not status.autoscaled and status.wanted == 2


async def test_scale_to_zero_on_the_cpu_build_stops_and_the_first_request_is_answered_after_a_cold_start(
        tmp_path: Path) -> None:
    async with Scenario(tmp_path, values={"scale_to_zero_after_s": 30.0}) as sc:
        await sc.until(sc.serving_revision(1))
        async with sc.clients(2) as clients:
            await sc.ticks(5)
        at = await sc.until(lambda: not sc.controller.instances and sc.controller.work_name is None, within_s=120)
        snap = sc.snapshot()
        assert snap.state == "stopped" and snap.reason.startswith("scaled to zero: no request for")
        assert "a cold start" in snap.reason
        assert snap.autoscale is not None and snap.autoscale.asleep and snap.autoscale.wake == "cold_start"
        assert snap.autoscale.wanted == 0
        to_zero = sc.event_list("autoscale")[-1]
        assert to_zero.data["action"] == "to_zero" and to_zero.data["wake"] == "cold_start"
        assert at >= 30  # not before scale_to_zero_after_s with no request
        await sc.ticks(20)
        assert not sc.controller.instances  # asleep stays asleep: nothing starts without a request
        async with sc.clients(1) as first:
            await sc.until(lambda: any(r.ok for r in first.results), within_s=120)
        assert first.failed == [] and clients.failed == []
        wake = sc.event_list("autoscale")[-1]
        assert wake.data["action"] == "wake" and "a request arrived" in wake.message
        assert sc.kinds().count("starting") == 2 and sc.snapshot().state == "ready"


async def test_scale_to_zero_on_cuda_sleeps_and_the_same_instance_wakes_for_the_next_request(
        tmp_path: Path) -> None:
    async with Scenario(tmp_path, build="cuda", values={"scale_to_zero_after_s": 30.0}) as sc:
        await sc.until(sc.serving_revision(1))
        await sc.until(lambda: [i.role for i in sc.controller.instances] == ["sleeping"]
                       and sc.controller.work_name is None, within_s=120)
        snap = sc.snapshot()
        assert snap.state == "stopped" and "wakes it in about a second" in snap.reason
        assert snap.autoscale is not None and snap.autoscale.wake == "sleep" and not sc.admission.upstreams
        async with sc.clients(1) as first:
            await sc.until(lambda: any(r.ok for r in first.results), within_s=30)
        assert first.failed == []
        assert sc.serving_revision(1)() and sc.controller.instances.all()[0].name == "a"  # woken, not restarted
        kinds = sc.kinds()
        assert kinds.count("starting") == 1 and kinds.index("sleeping") < kinds.index("woken")
        assert sc.snapshot().state == "ready"


async def test_a_deployment_stopped_longer_than_the_idle_time_serves_again_when_started(tmp_path: Path) -> None:
    """Stopped, it is down, not idle: a start after scale_to_zero_after_s serves (it went to zero at once and
    stayed stopped)."""
    async with Scenario(tmp_path, values={"scale_to_zero_after_s": 30.0}) as sc:
        await sc.until(sc.serving_revision(1))
        sc.controller.request_stop()
        await sc.until(lambda: sc.snapshot().state == "stopped" and not sc.controller.instances)
        await sc.ticks(60)
        sc.controller.request_start()
        await sc.until(sc.serving_revision(1), within_s=120)
        assert sc.event_list("autoscale") == []  # serving again, not 'scaled to zero'
        async with sc.clients(1) as clients:
            await sc.ticks(3)
        assert clients.failed == [] and clients.results


async def test_asleep_with_the_database_down_a_request_still_wakes_it(tmp_path: Path) -> None:
    async with Scenario(tmp_path, build="cuda", values={"scale_to_zero_after_s": 30.0}) as sc:
        await sc.until(sc.serving_revision(1))
        await sc.until(lambda: [i.role for i in sc.controller.instances] == ["sleeping"]
                       and sc.controller.work_name is None, within_s=120)
        sc.sessions.down = True
        async with sc.clients(1) as first:
            await sc.until(lambda: any(r.ok for r in first.results), within_s=30)
        assert first.failed == [] and sc.controller.instances.all()[0].name == "a"
        assert not sc.controller.scaler.asleep  # wanted again: the store's return does not put it back to sleep
        sc.sessions.down = False
        await sc.ticks(3)
        assert [i.role for i in sc.controller.instances] == ["serving"]


async def test_three_asleep_one_wanted_one_wakes_and_the_others_stop(tmp_path: Path) -> None:
    values = {**SCALING, "scale_down_delay_s": 1000.0, "scale_to_zero_after_s": 30.0}
    async with Scenario(tmp_path, build="cuda", values=values) as sc:
        await sc.until(sc.serving_revision(1))
        async with sc.clients(6):
            await sc.until(lambda: serving_count(sc) == 3, within_s=200)
        await sc.until(lambda: [i.role for i in sc.controller.instances] == ["sleeping"] * 3
                       and sc.controller.work_name is None, within_s=120)
        async with sc.clients(1) as first:
            await sc.until(lambda: any(r.ok for r in first.results) and sc.controller.work_name is None,
                           within_s=30)
        assert first.failed == [] and [i.role for i in sc.controller.instances] == ["serving"]
        assert sc.kinds().count("woken") == 1 and sc.event_list("drained") == []


async def test_its_name_reaches_it_asleep_and_while_it_comes_back(tmp_path: Path) -> None:
    """A served name of its own must find the deployment while it is scaled to zero and during the cold start
    that follows (404 model_not_found otherwise)."""
    async with Scenario(tmp_path, values={"scale_to_zero_after_s": 30.0, "served_model_name": "chat"}) as sc:
        await sc.until(sc.serving_revision(1))
        await sc.until(lambda: not sc.controller.instances and sc.controller.work_name is None, within_s=120)
        assert sc.controller.served_names() == {"chat"}
        sc.admission.on_wait = None  # (the request's wait is what the test drives: tick by tick)
        async with sc.clients(1) as first:
            names: list[set[str]] = []

            def answered() -> bool:
                names.append(sc.controller.served_names())
                return any(r.ok for r in first.results)

            await sc.until(answered, within_s=120)
        assert all(n == {"chat"} for n in names)
        sc.controller.request_stop()
        await sc.until(lambda: sc.snapshot().state == "stopped" and not sc.controller.instances)
        assert sc.controller.served_names() == set()  # stopped by an operator: not listed, not reached


async def test_on_a_fleet_a_replica_fewer_is_taken_where_memory_is_scarcest(tmp_path: Path) -> None:
    """Item 4: added where the placement has room, removed first from the node that most needs its memory back."""
    async with Scenario(tmp_path, values=SCALING, nodes=["n1", "n2", "n3"]) as sc:
        await sc.until(sc.serving_revision(1))
        async with sc.clients(6):
            await sc.until(lambda: serving_count(sc) == 3, within_s=200)
        nodes = {i.name: i.child.node for i in sc.controller.instances}
        assert sorted(str(n) for n in nodes.values()) == ["n1", "n2", "n3"]  # one a node
        free = {"n1": 40e9, "n2": 2e9, "n3": 90e9}
        sc.controller.free_on = lambda node: free.get(node or "")
        async with sc.clients(3):  # asks for 2 replicas: one goes
            await sc.until(lambda: serving_count(sc) == 2 and sc.controller.work_name is None, within_s=200)
        assert {i.child.node for i in sc.controller.instances} == {"n1", "n3"}
        await sc.until(lambda: serving_count(sc) == 1 and sc.controller.work_name is None, within_s=200)
        assert [i.child.node for i in sc.controller.instances] == ["n3"]


async def test_on_a_fleet_a_replica_goes_to_a_node_with_room_when_the_placement_s_choice_has_none(
        tmp_path: Path) -> None:
    async with Scenario(tmp_path, values=SCALING, nodes=["n1", "n2", "n3"]) as sc:
        await sc.until(sc.serving_revision(1))
        sc.controller.room = lambda node, _settings, _index: None if node == "n3" else f"{node} is full"
        async with sc.clients(4) as clients:  # asks for 2
            await sc.until(lambda: serving_count(sc) == 2, within_s=200)
        assert sorted(str(i.child.node) for i in sc.controller.instances) == ["n1", "n3"]
        assert sc.event_list("replica_waiting") == [] and clients.failed == []


async def test_an_operator_s_start_of_a_deployment_asleep_starts_it_now(tmp_path: Path) -> None:
    """Stopped while asleep, then started: it serves now (it stayed stopped, saying "stop requested", until a
    request came)."""
    async with Scenario(tmp_path, values={"scale_to_zero_after_s": 30.0}) as sc:
        await sc.until(sc.serving_revision(1))
        await sc.until(lambda: not sc.controller.instances and sc.controller.work_name is None, within_s=120)
        sc.controller.request_stop()
        await sc.ticks(3)
        sc.controller.request_start()
        await sc.until(sc.serving_revision(1), within_s=120)
        assert sc.snapshot().state == "ready"
