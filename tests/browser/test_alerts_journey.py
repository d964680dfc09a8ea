"""An on-call engineer sets up where alerts go, in Debian's Chromium: an admin adds a webhook (a real local
receiver), sends a test message and sees what it answered, switches a rule off and on again, and finds the rules
and what fired on the Alerts page after a reload (issue 34)."""

from __future__ import annotations

from typing import Any

from playwright.sync_api import expect

from tests.browser.conftest import no_error_on, open_page, shot, wait_rendered
from tests.testkit.engine import EngineHandle
from tests.testkit.receiver import receiver


def test_an_admin_adds_a_webhook_tests_it_and_sees_the_rules(page: Any, console_url: str,
                                                            engine: EngineHandle) -> None:
    with receiver() as hook:
        open_page(page, "Alerts")
        page.get_by_text("Change a rule").wait_for()  # (the rules' table is drawn on a canvas: its text is not
        expect(page.get_by_role("combobox", name="Rule")).to_have_value("GPU memory high")  # the page's)
        form = page.get_by_test_id("stForm").filter(has_text="Add a channel")
        form.get_by_label("Name", exact=True).fill("journey pager")
        form.get_by_role("textbox", name="Webhook address").fill(hook.url)
        form.get_by_role("button", name="Add channel").click()
        page.get_by_text("Channel journey pager added").wait_for()
        wait_rendered(page, "Alerts")
        expect(page.get_by_role("combobox", name="Channel")).to_have_value("journey pager")
        assert "s3cr3t" not in page.content()  # the webhook's secret path is never shown again
        page.get_by_role("button", name="Send a test message").click()
        page.get_by_text("journey pager answered 200").wait_for()
        assert hook.bodies and hook.bodies[-1]["text"].startswith(":bell: TEST")
        no_error_on(page)
        shot(page, "alerts-channel-tested")
        # the page after a reload: the rules, the channel, nothing broken
        page.reload()
        wait_rendered(page, "Alerts")
        page.get_by_text("What fired").wait_for()
        expect(page.get_by_role("combobox", name="Channel")).to_have_value("journey pager")
        no_error_on(page)
        shot(page, "alerts-after-reload")
        channel = next(c for c in engine.client.alert_channels() if c.name == "journey pager")
        engine.client.delete_alert_channel(channel.id)
