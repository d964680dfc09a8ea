"""What operators ask of serving, over fake vLLM children: stop and start, a restart, more replicas than there is
room for, a revision written straight into the store that must not start; and a bug in serving itself."""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path

from engine.db import RevisionStatus
from tests.testkit.serving import Scenario


async def test_a_stop_refuses_requests_saying_why_and_a_start_serves_again(tmp_path: Path) -> None:
    async with Scenario(tmp_path) as sc:
        await sc.until(sc.serving_revision(1))
        async with sc.clients(4) as clients:
            await sc.ticks(2)
            stopped_at = sc.clock.monotonic()
            sc.controller.request_stop()
            await sc.until(lambda: sc.snapshot().state == "stopped" and not sc.controller.instances)
            await sc.ticks(3)
            refused = [r for r in clients.results if r.at > stopped_at and not r.ok]
            assert refused and all(r.status == 503 for r in refused)
            assert b"stopped by an operator" in refused[-1].body and b"/api/engine/start" in refused[-1].body
            assert all(r.ok for r in clients.results if r.at < stopped_at)  # in flight then: drained, not cut
            started_at = sc.clock.monotonic()
            sc.controller.request_start()
            await sc.until(sc.serving_revision(1))
            await sc.ticks(2)
        assert [r for r in clients.results if r.at > started_at + 1 and r.ok]
        assert sc.kinds().count("stopped") == 1 and sc.event_list("drained")


async def test_a_restart_replaces_the_instance_without_a_gap(tmp_path: Path) -> None:
    async with Scenario(tmp_path) as sc:
        await sc.until(sc.serving_revision(1))
        async with sc.clients(6) as clients:
            await sc.ticks(2)
            sc.controller.request_restart()
            await sc.until(sc.apply_ended(1))
        plan = sc.event_list("apply_plan")[-1]
        assert plan.data["restart"] is True and plan.message.startswith("restart: blue/green")
        assert clients.failed == [] and sc.longest_gap == 0
        assert sc.serving_revision(1)() and sc.controller.instances.all()[0].name == "b"


async def test_a_revision_written_past_the_api_that_must_not_start_is_rejected_and_the_last_good_serves(
        tmp_path: Path) -> None:
    async with Scenario(tmp_path) as sc:
        await sc.until(sc.serving_revision(1))
        elsewhere = tmp_path / "elsewhere"
        elsewhere.mkdir()
        (elsewhere / "config.json").write_text("{}")
        bad = sc.write({"model": str(elsewhere)})  # a model outside the model roots: never handed to vLLM
        await sc.ticks(4)
        assert sc.revisions.get_revision(bad.id or 0).status == RevisionStatus.REJECTED.value
        rejected = sc.event_list("rejected")[-1]
        assert rejected.revision_id == bad.id and "model" in rejected.message
        assert sc.serving_revision(1)() and len(sc.event_list("starting")) == 1


async def test_a_replica_with_no_room_waits_saying_why_and_starts_once_there_is(tmp_path: Path) -> None:
    async with Scenario(tmp_path) as sc:
        await sc.until(sc.serving_revision(1))
        sc.capacity.room = "6.0 GiB free on the host, 7.2 GiB needed"
        more = sc.write({"replicas": 2})
        await sc.ticks(30)
        waiting = sc.event_list("replica_waiting")
        assert len(waiting) == 1 and "7.2 GiB needed" in waiting[0].message  # said once, not every look
        assert len(sc.controller.instances) == 1
        sc.capacity.room = None
        await sc.until(sc.serving_revision(more.id, instances=2), within_s=120)


async def test_a_bug_in_serving_fails_visibly_and_serving_goes_on(tmp_path: Path) -> None:
    async with Scenario(tmp_path) as sc:
        await sc.until(sc.serving_revision(1))
        broken = sc.controller.operations

        async def bug(*_: object) -> AsyncIterator[None]:
            raise RuntimeError("a plan's bug")
            yield  # (an operation is an async generator)

        broken.apply = bug  # type: ignore[method-assign, assignment]
        sc.write({"max_model_len": 1024})
        try:
            await sc.controller.tick()
        except RuntimeError as exc:  # the loop's own guard records it (engine/serving/controller.py _run)
            await sc.controller._survive(f"internal error RuntimeError: {exc}")
        status = sc.snapshot()
        assert status.state == "failed" and "a plan's bug" in status.reason
        assert "a plan's bug" in sc.event_list("failed")[-1].message
        assert sc.controller.intent.next_attempt > sc.clock.monotonic()  # retried after the backoff, not spun


async def test_a_data_dir_without_the_demo_model_builds_it_then_starts_vllm(tmp_path: Path) -> None:
    """The first run of a fresh data dir: the demo model is built (its progress as the reason), then started. The
    build is `llmops demo-model` (about two minutes: the CLI's own tests train it); here a command that writes its
    config as the build would."""
    import json
    import sys

    from tests.testkit.data import DEMO_SHAPE

    async with Scenario(tmp_path) as sc:
        config = sc.config.demo_model_dir / "config.json"
        config.unlink()
        sc.controller.checks.demo_command = [
            sys.executable, "-c", f"import pathlib,sys; print('step    1/2', flush=True); "
            f"pathlib.Path({str(config)!r}).write_text({json.dumps(DEMO_SHAPE)!r}); print('step    2/2')"]
        await sc.tick()
        status = sc.snapshot()
        assert status.state == "starting" and "building the demo model" in status.reason and not status.instances
        await sc.until(sc.serving_revision(1))
        kinds = [k for k in sc.kinds() if k in ("demo_model_building", "demo_model_built", "starting", "model_missing")]
        assert kinds == ["demo_model_building", "demo_model_built", "starting"]
        assert config.is_file()


async def test_a_missing_model_folder_is_named_with_what_to_do_and_vllm_is_not_started(tmp_path: Path) -> None:
    mine = tmp_path / "data" / "models" / "mine"
    async with Scenario(tmp_path) as sc:
        rev = sc.write({"model": str(mine)})  # the folder went away before the start (a moved disk, a typo)
        await sc.ticks(12)
        status = sc.snapshot()
        assert status.state == "failed" and str(mine) in status.reason and "has no config.json" in status.reason
        assert not sc.fakes  # vLLM was never started
        missing = sc.event_list("model_missing")
        assert len(missing) == 1 and missing[0].revision_id == rev.id  # said once, not every look
        assert sc.revisions.get_revision(rev.id or 0).status == "pending"  # not rejected: copy the model back


async def test_a_stop_during_a_start_stops_it_and_says_stopped(tmp_path: Path) -> None:
    """A stop while vLLM was starting left the deployment in "starting" (issue 31): the start is given up, its
    process stopped, and the state says stopped, both during a first start and during a restart."""
    async with Scenario(tmp_path) as sc:
        await sc.ticks(3)  # the first start is under way (ready at 20 s)
        assert sc.snapshot().state == "starting"
        sc.controller.request_stop()
        await sc.until(lambda: sc.snapshot().state == "stopped" and not sc.controller.instances, within_s=120)
        await sc.ticks(30)  # and it stays so: nothing starts on its own
        assert sc.snapshot().state == "stopped" and not sc.controller.instances
        sc.controller.request_start()
        await sc.until(sc.serving_revision(1))
        sc.controller.request_restart()
        await sc.ticks(3)
        sc.controller.request_stop()
        await sc.until(lambda: sc.snapshot().state == "stopped" and not sc.controller.instances, within_s=120)
        await sc.ticks(30)
        assert sc.snapshot().state == "stopped" and not sc.controller.instances
