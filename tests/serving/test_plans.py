"""Every apply plan, end to end over fake vLLM children, each under streaming clients: what they see (nothing
dropped; something serving throughout, or for a pause, every request held and served), the rule each plan keeps
(how many instances at once, in what order), and the events an operator reads."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

from engine.db import RevisionStatus
from tests.testkit.fake_vllm import Script
from tests.testkit.serving import Scenario, by_revision


async def test_blue_green_moves_the_traffic_to_the_new_instance_then_drains_the_old(tmp_path: Path) -> None:
    async with Scenario(tmp_path, plan="blue_green") as sc:
        await sc.until(sc.serving_revision(1))
        async with sc.clients(8) as clients:
            await sc.ticks(2)
            t0 = sc.clock.monotonic()
            rev = sc.write({"max_num_seqs": 5})
            await sc.until(sc.apply_ended(rev.id))
            await sc.ticks(2)
        apply = sc.controller.apply
        assert apply is not None and apply.outcome == "applied" and apply.longest_gap_s in (None, 0)
        assert clients.failed == [] and len(clients.results) > 50
        assert sc.longest_gap == 0  # an instance was open in the gateway at every tick
        during = sc.since(t0)
        assert max(len(s.instances) for s in during) == 2  # the new one beside the old, never more
        # the old one was drained only once the new one served
        first_drain = next(s for s in during if s.of_role("draining"))
        assert "b" in first_drain.of_role("serving")
        assert sc.serving_revision(rev.id)() and sc.controller.instances.all()[0].name == "b"
        assert sc.kinds()[-6:] == ["apply_plan", "starting", "ready", "drained", "stopped", "apply_done"]
        assert [t.action for t in apply.timings] == ["start", "handover", "drain", "stop"]
        assert all(t.eta_s is not None for t in apply.timings)  # each step beside its plan's ETA
        old = next(f for f in sc.fakes if f.name == "a")
        assert old.served.cut == 0  # the old instance ended every request it had before it stopped


async def test_the_old_instance_s_stop_is_told_before_the_apply_s_end_however_slow_its_record(tmp_path: Path) -> None:
    """An operator reads the log in order: the old instance stopped, then the apply was done. The record of the stop
    may take a while (an event is a database write off the loop); the apply waits for it."""
    async with Scenario(tmp_path, plan="blue_green") as sc:
        await sc.until(sc.serving_revision(1))
        recorder = sc.controller.recorder
        record = recorder.event

        async def slow_stopped(kind: str, *args: Any, **kwargs: Any) -> None:
            if kind == "stopped" and recorder.event is slow_stopped:  # a write that takes two of the scenario's
                recorder.event = record  # type: ignore[method-assign]  # ticks, which go on meanwhile; once
                until = sc.clock.monotonic() + 2
                while sc.clock.monotonic() < until:
                    await asyncio.sleep(0.01)
            await record(kind, *args, **kwargs)

        recorder.event = slow_stopped  # type: ignore[method-assign]
        async with sc.clients(4) as clients:
            rev = sc.write({"max_num_seqs": 5})
            await sc.until(sc.apply_ended(rev.id))
            await sc.until(lambda: "stopped" in sc.kinds() and sc.kinds()[-1] != "starting")
        assert sc.kinds()[-6:] == ["apply_plan", "starting", "ready", "drained", "stopped", "apply_done"]
        assert clients.failed == []


async def test_bridge_holds_the_traffic_while_the_old_instance_is_replaced(tmp_path: Path) -> None:
    async with Scenario(tmp_path, plan="bridge") as sc:
        await sc.until(sc.serving_revision(1))
        async with sc.clients(8) as clients:
            await sc.ticks(2)
            t0 = sc.clock.monotonic()
            rev = sc.write({"max_model_len": 1024})
            await sc.until(sc.apply_ended(rev.id))
        apply = sc.controller.apply
        assert apply is not None and apply.outcome == "applied"
        assert clients.failed == [] and sc.longest_gap == 0
        during = sc.since(t0)
        # memory holds two instances at most: the bridge beside the old, then the new beside the bridge
        assert max(len(s.instances) for s in during) == 2
        starting = [e for e in sc.event_list("starting") if e.revision_id is not None][-2:]
        assert starting[0].data["bridge"] is True and starting[0].revision_id == 1  # a small old revision
        assert "--max-num-seqs" in starting[0].data["args"] and \
            starting[0].data["args"][starting[0].data["args"].index("--max-num-seqs") + 1] == "8"
        assert starting[1].data["bridge"] is False and starting[1].revision_id == rev.id
        # the new revision started only once the old instance had stopped (its memory free)
        new_started = next(s for s in during if any(r == rev.id for _, _, r, _ in s.instances))
        assert [(r, bridge) for _, _, r, bridge in new_started.instances if r != rev.id] == [(1, True)]
        assert sc.serving_revision(rev.id)()
        kinds = sc.kinds()
        assert kinds[kinds.index("apply_plan"):] == ["apply_plan", "starting", "ready", "drained", "stopped",
                                                     "starting", "ready", "drained", "stopped", "apply_done"]


async def test_rolling_replaces_one_replica_at_a_time(tmp_path: Path) -> None:
    async with Scenario(tmp_path, plan="rolling", values={"replicas": 2}) as sc:
        await sc.until(sc.serving_revision(1, instances=2))
        async with sc.clients(8) as clients:
            await sc.ticks(2)
            t0 = sc.clock.monotonic()
            rev = sc.write({"max_model_len": 1024})
            await sc.until(sc.apply_ended(rev.id))
        apply = sc.controller.apply
        assert apply is not None and apply.outcome == "applied"
        assert clients.failed == []
        during = sc.since(t0)
        assert min(s.open for s in during) >= 1  # capacity never below (N-1)/N
        assert max(len(s.instances) for s in during) == 2  # one replaced at a time: never a third
        assert sc.serving_revision(rev.id, instances=2)()
        assert [t.action for t in apply.timings] == ["drain", "stop", "start", "handover", "drain", "stop", "start"]


async def test_pause_holds_requests_in_the_queue_and_the_new_instance_serves_them(tmp_path: Path) -> None:
    async with Scenario(tmp_path, plan="pause") as sc:
        await sc.until(sc.serving_revision(1))
        async with sc.clients(6) as clients:
            await sc.ticks(2)
            t0 = sc.clock.monotonic()
            rev = sc.write({"max_model_len": 1024})
            await sc.until(sc.apply_ended(rev.id))
            await sc.ticks(2)
        apply = sc.controller.apply
        assert apply is not None and apply.outcome == "applied"
        assert clients.failed == []  # held in the gateway's queue, not refused
        assert apply.longest_gap_s and apply.longest_gap_s >= 15  # nothing served while the new one started
        assert max(len(s.instances) for s in sc.since(t0)) == 1  # never two at once: nothing fits beside
        assert [r for r in clients.results if r.at > t0 + 5]  # requests were served after the pause
        assert sc.serving_revision(rev.id)()
        states = [e.message for e in sc.event_list("drained")]
        assert states and "drained in-flight requests" in states[-1]


async def test_pause_on_cuda_sleeps_the_old_instance_and_wakes_it_when_the_new_revision_fails(
        tmp_path: Path) -> None:
    """Sleep mode: a revision that fails after a pause is rolled back in about a second, the old instance woken."""
    script = by_revision({2: Script(fail_s=12.0, exit_code=1)})
    async with Scenario(tmp_path, plan="pause", build="cuda", script=script) as sc:
        await sc.until(sc.serving_revision(1))
        async with sc.clients(4) as clients:
            await sc.ticks(2)
            rev = sc.write({"max_model_len": 1024})
            await sc.until(sc.apply_ended(rev.id))
            await sc.ticks(2)
        assert sc.controller.apply is not None and sc.controller.apply.outcome == "rejected"
        assert clients.failed == []
        kinds = sc.kinds()
        assert kinds.index("sleeping") < kinds.index("woken") < kinds.index("rollback")
        assert sc.serving_revision(1)() and sc.controller.instances.all()[0].name == "a"  # the same instance
        assert sc.revisions.get_revision(rev.id or 0).status == RevisionStatus.REJECTED.value


async def test_a_soft_change_takes_effect_without_a_restart_and_replicas_follow(tmp_path: Path) -> None:
    async with Scenario(tmp_path, values={"max_num_seqs": 16, "max_num_seqs_ceiling": 64}) as sc:
        await sc.until(sc.serving_revision(1))
        async with sc.clients(4) as clients:
            started = len(sc.event_list("starting"))
            rev = sc.write({"max_num_seqs": 32})
            await sc.ticks(2)
            assert [u.limit for u in sc.admission.upstreams] == [32]  # the gateway holds it to 32 from now
            assert len(sc.event_list("starting")) == started  # nothing restarted
            soft = sc.event_list("applied_soft")[-1]
            assert soft.revision_id == rev.id and soft.data["max_num_seqs"] == 32
            up = sc.write({"replicas": 2})
            await sc.until(sc.serving_revision(up.id, instances=2))
            down = sc.write({"replicas": 1})
            await sc.until(sc.serving_revision(down.id, instances=1))
        assert clients.failed == [] and sc.longest_gap == 0
        assert sc.controller.apply is None  # none of it was an apply
