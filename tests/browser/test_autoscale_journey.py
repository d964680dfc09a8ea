"""An operator lets the deployment sleep when idle, in Debian's Chromium: the settings form's scale-to-zero field
applied without a restart, the Overview saying it is asleep and what the next request meets, a prompt in the
Playground answered (it waits while vLLM comes back: not refused), the Overview awake again and the Metrics page
drawing replicas against load. The deployment is put back as it was for the tests after this one."""

from __future__ import annotations

import re
from typing import Any

from playwright.sync_api import expect

from tests.browser.conftest import no_error_on, open_page, shot
from tests.testkit.engine import COLD_START_S, EngineHandle


def test_operator_lets_it_sleep_when_idle_and_a_prompt_wakes_it(page: Any, console_url: str,
                                                               engine: EngineHandle) -> None:
    engine.client.wait_for({"ready"}, COLD_START_S)
    before = engine.client.settings()
    try:
        open_page(page, "Engine settings")
        page.get_by_text("Replicas, autoscaling and scale to zero").click()
        idle = page.get_by_role("spinbutton", name="scale_to_zero_after_s (0 = never)", exact=True)
        idle.fill("3")  # below the least it takes: refused, naming the field, and nothing can be applied
        idle.press("Tab")
        page.get_by_text(re.compile(r"scale_to_zero_after_s: .*greater than or equal to 5")).wait_for()
        expect(page.get_by_role("button", name="Apply & restart")).to_be_disabled()
        idle.fill("5")
        idle.press("Tab")
        page.get_by_test_id("stDataFrame").wait_for()  # "Changes": what was edited
        page.get_by_label("Note (why)").fill("journey: sleep when idle")
        page.get_by_label("Note (why)").press("Tab")
        shot(page, "autoscale-settings-edited")
        page.get_by_role("button", name="Apply now").first.click()
        dialog = page.get_by_role("dialog")
        dialog.get_by_text("without a restart").wait_for()
        dialog.get_by_role("button", name="Apply now").click()
        # ready, or (idle for longer than 5 s already) to zero at once: the apply's outcome says which (it waited
        # forever for a "ready" that never came when the deployment had been idle)
        page.get_by_text(re.compile(r"Revision \d+ is (ready after|applied after \d+ s; the deployment was idle, so "
                                    r"it is scaled to zero now)")).wait_for(timeout=60_000)
        assert engine.client.settings().values.scale_to_zero_after_s == 5
        shot(page, "autoscale-settings-applied")

        # the Overview says it is asleep, and what the next request will meet
        engine.client.wait_for({"stopped"}, 120)
        open_page(page, "Overview")
        card = page.get_by_text(re.compile(r"Autoscaling · .* to zero after 5(\.0)? s idle"))
        card.wait_for()
        page.get_by_text("0 (asleep)").wait_for()
        page.get_by_text(re.compile(r"The next request starts it again: a cold start")).wait_for()
        no_error_on(page)
        shot(page, "autoscale-overview-asleep")

        # a prompt: it waits while vLLM starts again, and is answered
        open_page(page, "Playground")
        page.get_by_label("Prompt", exact=True).fill("Wake up and describe what this module does.")
        page.get_by_role("button", name="Run").click()
        page.get_by_text("Time to first token").wait_for(timeout=COLD_START_S * 1000)
        expect(page.get_by_test_id("stMetricLabel").filter(has_text="Finish")).to_be_visible()
        no_error_on(page)
        shot(page, "autoscale-playground-woke-it")
        woke = engine.client.events(kinds=["autoscale"], newest_first=True, limit=1)[0]
        assert woke.data["action"] == "wake" and "a request arrived" in woke.message

        open_page(page, "Metrics")
        page.get_by_text("Replicas against load").first.wait_for(timeout=30_000)
        no_error_on(page)
        shot(page, "autoscale-metrics-replicas")
    finally:  # awake and never sleeping again, for the tests after this one
        now = engine.client.settings()
        rev = engine.client.put_settings(now.revision, {"scale_to_zero_after_s": before.values.scale_to_zero_after_s},
                                         "journey: awake again")
        engine.client.wait_for({"ready"}, COLD_START_S, revision=rev.revision)
