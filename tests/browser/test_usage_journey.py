"""An admin gives a team a daily token budget and a key in it, in Debian's Chromium; the key's requests to the real
vLLM are answered until the budget is spent, then refused with 429 naming it; the Usage page shows the key's
tokens, the team's, the budget's bar, and keeps the grouping chosen across a reload (issue 34)."""

from __future__ import annotations

import re
import time
from typing import Any

import httpx
from playwright.sync_api import TimeoutError as PlaywrightTimeoutError
from playwright.sync_api import expect

from tests.browser.conftest import no_error_on, open_page, shot, wait_rendered
from tests.testkit.engine import COLD_START_S, EngineHandle


def pick(page: Any, scope: Any, label: str, option: str) -> None:
    """An option of the select box ``label`` of one form (several forms have a Role or a Team)."""
    box = scope.get_by_role("combobox", name=label)
    for attempt in range(3):
        box.click()
        wanted = page.get_by_role("option", name=option, exact=True).first
        try:
            wanted.click(timeout=15_000)
            expect(box).to_have_value(option, timeout=15_000)
            return
        except PlaywrightTimeoutError:
            if attempt == 2:
                raise
            page.keyboard.press("Escape")


def test_an_admin_budgets_a_team_and_watches_its_key_use_it_up(page: Any, console_url: str,
                                                                engine: EngineHandle) -> None:
    engine.client.wait_for({"ready"}, COLD_START_S)
    open_page(page, "Access")
    form = page.get_by_test_id("stForm").filter(has_text="New team")
    form.get_by_label("Name", exact=True).fill("journey team")
    form.get_by_label("Token budget (0: none)").fill("400")
    form.get_by_label("Token budget (0: none)").press("Tab")
    form.get_by_role("button", name="Create team").click()
    page.get_by_text("Team journey team created").wait_for()
    # a gateway key in the team
    form = page.get_by_test_id("stForm").filter(has_text="New token")
    form.get_by_label("Name (what it is for)").fill("journey key")
    pick(page, form, "Kind", "gateway")
    pick(page, form, "Role", "prompter")
    pick(page, form, "Team", "journey team")
    form.get_by_role("button", name="Create").click()
    page.get_by_text("Copy it now: it is shown this once.").wait_for()
    key = page.get_by_test_id("stCode").inner_text().strip()
    assert key.startswith("llmops_")
    shot(page, "usage-access-team-and-key")
    no_error_on(page)

    # its requests are answered until the team's budget is spent, then refused naming it
    answered, refusal = 0, None
    with httpx.Client(base_url=engine.url, timeout=120, headers={"authorization": f"Bearer {key}"}) as v1:
        for n in range(40):
            resp = v1.post("/v1/completions", json={"prompt": f"Say something about number {n}.",
                                                     "max_tokens": 16})
            if resp.status_code == 429:
                refusal = resp
                break
            assert resp.status_code == 200, resp.text
            answered += 1
    assert refusal is not None and answered >= 1, f"{answered} answered and never refused"
    error = refusal.json()["error"]
    assert error["limit"] == "token_budget" and error["scope"] == "team" and error["limit_value"] == 400
    assert int(refusal.headers["retry-after"]) > 0

    # the Usage page: the key's tokens, then the team's with its budget's bar
    open_page(page, "Usage")
    deadline = time.monotonic() + 30
    while page.get_by_text("journey key").count() == 0:  # the ledger writes once a second
        assert time.monotonic() < deadline, "the key's usage never showed"
        page.reload()
        wait_rendered(page, "Usage")
    page.get_by_text(re.compile(r"team journey team: \d[\d,]* of 400 tokens this day")).wait_for()
    no_error_on(page)
    shot(page, "usage-by-key")
    team_choice = page.get_by_role("radiogroup", name="By").get_by_role("radio", name="team", exact=True)
    team_choice.click()
    expect(team_choice).to_have_attribute("aria-checked", "true")
    page.get_by_text("journey team").first.wait_for()
    wait_rendered(page, "Usage")
    no_error_on(page)
    shot(page, "usage-by-team")
    # a reload keeps the grouping chosen
    page.reload()
    wait_rendered(page, "Usage")
    expect(page.get_by_role("radiogroup", name="By").get_by_role("radio", name="team", exact=True)).to_have_attribute(
        "aria-checked", "true")
    no_error_on(page)
    engine.client.revoke_token(next(t.id for t in engine.client.tokens() if t.name == "journey key"))
