"""Alerts end to end on the session's engine and its real vLLM (issue 34): a real local HTTP receiver, made a
channel through the API, gets the fire and the resolve of a team's budget at 80 % (requests to the real model) and
of a crash loop (vLLM killed as it starts until restarts halt, then started again by an operator) — each once."""

from __future__ import annotations

import os
import signal
import time

import httpx

from tests.testkit.engine import COLD_START_S, EngineHandle
from tests.testkit.receiver import receiver
from tests.testkit.wait import wait_until


def test_a_budget_at_80_percent_and_a_crash_loop_reach_a_webhook_once_when_they_fire_and_once_when_they_resolve(
        engine: EngineHandle) -> None:
    c = engine.client
    c.wait_for({"ready"}, COLD_START_S)
    with receiver() as hook:
        channel = c.create_alert_channel("system receiver", "webhook", hook.url)
        team = c.create_team("system budget", token_budget=1000, budget_period="day")
        key = c.create_token("system budget key", "prompter", "gateway", team=team.name)
        try:
            # the team's budget: requests to the real model until 80 % of it is used
            used = 0
            with httpx.Client(base_url=engine.url, timeout=120,
                              headers={"authorization": f"Bearer {key.token}"}) as v1:
                for n in range(60):
                    budget = next(t for t in c.teams() if t.id == team.id).budget
                    assert budget is not None
                    used = budget.used
                    if used >= 800:
                        break
                    resp = v1.post("/v1/completions", json={"prompt": f"Count to {n} in words.", "max_tokens": 16})
                    assert resp.status_code == 200, resp.text
            assert 800 <= used < 1000
            fired = wait_until(lambda: hook.received(rule="Budget 80 % used", status="firing"), 30,
                               what="the budget's alert at the receiver")
            assert fired[0]["subject"] == "team system budget" and fired[0]["value"] >= 0.8
            c.update_team(team.name, token_budget=1_000_000)
            wait_until(lambda: hook.received(rule="Budget 80 % used", status="resolved"), 30,
                       what="the budget's resolve at the receiver")
            assert len(hook.received(rule="Budget 80 % used")) == 2

            # a crash loop: vLLM killed once it serves, then each time it is started again (in its start: a
            # revision that ran before is retried, not rolled back), until the engine halts its restarts
            def halted() -> bool:
                return bool(c.events(kinds=["crash_loop"], since=marker))

            marker = c.events(limit=1, newest_first=True)[0].id
            killed: set[int] = set()
            deadline = time.monotonic() + 2 * COLD_START_S
            while not halted():
                assert time.monotonic() < deadline, "no crash loop"
                pid = c.status().pid
                if pid is not None and pid not in killed:
                    os.kill(pid, signal.SIGKILL)
                    killed.add(pid)
                time.sleep(0.2)
            assert len(killed) == 3  # crashloop_max_failures
            crash = wait_until(lambda: hook.received(kind="crash_loop", status="firing"), 30,
                               what="the crash loop's alert at the receiver")
            assert crash[0]["subject"].startswith("deployment ") and crash[0]["title"] == "Crash loop: restarts halted"
            c.engine_action("start")  # the operator starts it again: it serves, and the alert resolves
            c.wait_for({"ready"}, COLD_START_S)
            wait_until(lambda: hook.received(kind="crash_loop", status="resolved"), 30,
                       what="the crash loop's resolve at the receiver")
            assert len(hook.received(kind="crash_loop")) == 2
            fired_rows = [f for f in c.alerts_fired() if f.kind in ("crash_loop", "budget")]
            assert all(f.state == "resolved" and any(d.ok for d in f.deliveries) for f in fired_rows[:2])
        finally:
            c.delete_alert_channel(channel.id)
            c.revoke_token(key.id)
            c.delete_team(team.name)
            c.wait_for({"ready"}, COLD_START_S)
