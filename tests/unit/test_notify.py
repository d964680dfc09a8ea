"""Alerts (issue 34, item 4): when an alert fires and resolves — after its condition held, not on every flap — and
what a channel is sent (Slack's text, a generic JSON body), tried again when the webhook fails."""

from __future__ import annotations

import asyncio

import httpx
import pytest

from engine.notify import Alert, ChannelError, Tracker, check_url, generic_body, send, shown_url, slack_body


def test_a_level_fires_once_it_has_held_and_a_flap_sends_nothing() -> None:
    t = Tracker()
    assert t.level(1, "deployment a", 3.0, 2.0, 60, 0, "") is None  # over, not yet for 60 s
    assert t.level(1, "deployment a", 1.0, 2.0, 60, 30, "") is None  # back under: the wait starts again
    assert t.level(1, "deployment a", 3.0, 2.0, 60, 40, "") is None
    fired = t.level(1, "deployment a", 3.5, 2.0, 60, 100, "slow")
    assert fired is not None and fired.firing and fired.value == 3.5
    assert t.level(1, "deployment a", 4.0, 2.0, 60, 110, "") is None  # firing: said once
    # 1.9 is under the threshold but not under 90 % of it: it hovers, nothing resolves
    assert t.level(1, "deployment a", 1.9, 2.0, 60, 200, "") is None
    assert t.level(1, "deployment a", 1.9, 2.0, 60, 400, "") is None
    assert t.level(1, "deployment a", 1.0, 2.0, 60, 410, "") is None  # under: resolves once it stays so 60 s
    assert t.level(1, "deployment a", 2.5, 2.0, 60, 420, "") is None  # back over: still firing, the wait is reset
    assert t.level(1, "deployment a", 1.0, 2.0, 60, 430, "") is None
    resolved = t.level(1, "deployment a", 1.0, 2.0, 60, 490, "")
    assert resolved is not None and not resolved.firing


def test_an_event_fires_once_and_resolves_when_it_serves_again_or_after_quiet() -> None:
    t = Tracker()
    assert t.fire(2, "deployment a", 0, "crash loop") is not None
    assert t.fire(2, "deployment a", 5, "crash loop again") is None
    resolved = t.resolve(2, "deployment a", "serves again")
    assert resolved is not None and not resolved.firing
    assert t.resolve(2, "deployment a", "again") is None  # nothing firing: nothing sent
    t.fire(3, "GPU 0", 0, "XID 79")
    assert t.quiet(3, 600, 300) == []
    t.fire(3, "GPU 0", 300, "XID 79")  # a new one: the quiet starts again
    assert t.quiet(3, 600, 800) == []
    assert [c.subject for c in t.quiet(3, 600, 901)] == ["GPU 0"]


def test_an_alert_firing_when_the_engine_stopped_resolves_after_the_restart_without_firing_again() -> None:
    t = Tracker()
    t.resume(4, "team research", 0.85, "85 %", 0)
    assert t.level(4, "team research", 0.9, 0.8, 0, 1, "") is None
    resolved = t.level(4, "team research", 0.0, 0.8, 0, 2, "")
    assert resolved is not None and not resolved.firing


ALERT = Alert("firing", "Budget 80 % used", "budget", "Token budget used", "team research", "used 85 %", 0.85, 0.8,
              1_700_000_000.0, None, "http://engine:8000", 7)


def test_slack_gets_one_line_of_text_and_a_generic_webhook_every_field() -> None:
    text = slack_body(ALERT)["text"]
    assert text.startswith(":rotating_light: FIRING · Token budget used · team research (value 0.85, threshold 0.8)")
    assert "http://engine:8000" in text
    body = generic_body(ALERT)
    assert body["status"] == "firing" and body["subject"] == "team research" and body["alert_id"] == 7


@pytest.mark.parametrize("url", ["ftp://x/y", "http://", "javascript:alert(1)", "http://a b/", "http://x/\x00",
                                 "http://x/" + "a" * 3000])
def test_a_channel_url_that_cannot_be_sent_to_is_refused(url: str) -> None:
    with pytest.raises(ChannelError, match="url: "):
        check_url(url)


def test_the_api_shows_a_webhook_s_host_and_never_its_secret_path() -> None:
    assert shown_url("https://user:pw@hooks.slack.com/services/T0/B0/XXXX?x=1") == "https://hooks.slack.com/…"


def test_a_failing_webhook_is_tried_again_and_one_that_refuses_for_good_is_not() -> None:
    answers = iter([500, 503, 200])
    seen: list[int] = []

    def handler(request: httpx.Request) -> httpx.Response:
        status = next(answers)
        seen.append(status)
        return httpx.Response(status)

    async def go(transport: httpx.MockTransport) -> dict[str, object]:
        async with httpx.AsyncClient(transport=transport) as client:
            return await send(client, "webhook", "http://hook", ALERT, backoff_s=0.0)

    outcome = asyncio.run(go(httpx.MockTransport(handler)))
    assert outcome["ok"] and outcome["tries"] == 3 and seen == [500, 503, 200]
    gone = asyncio.run(go(httpx.MockTransport(lambda _: httpx.Response(404, text="no such hook"))))
    assert not gone["ok"] and gone["tries"] == 1 and gone["status"] == 404 and gone["detail"] == "no such hook"


def test_the_shipped_prometheus_rules_load_in_debian_s_promtool() -> None:
    """docs/alerting/llmops-rules.yml, for Alertmanager through Prometheus: `promtool check rules` accepts it, and
    every metric it reads is one the exporter writes."""
    import os
    import re
    import shutil
    import subprocess
    from pathlib import Path

    rules = Path(__file__).parents[2] / "docs" / "alerting" / "llmops-rules.yml"
    promtool = shutil.which("promtool")
    if promtool is None:
        if os.environ.get("LLMOPS_REQUIRE_PROMTOOL") == "1":
            pytest.fail("promtool is required here: apt-get install prometheus")
        pytest.skip("no promtool: `apt-get install prometheus` to check the rules file")
    done = subprocess.run([promtool, "check", "rules", str(rules)], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "SUCCESS: 14 rules found" in done.stdout
    exporter = (Path(__file__).parents[2] / "engine" / "metrics" / "exporter.py").read_text()
    written = set(re.findall(r'"(llmops_[a-z_]+)"', exporter))
    read = {re.sub(r"_(total|bucket)$", "", m) for m in re.findall(r"\b(llmops_[a-z_]+)", rules.read_text())}
    assert read <= written, read - written
