"""End to end in headless Chromium: every page, an apply watched to the end, a prompt streamed."""

from __future__ import annotations

import re
from typing import Any

import pytest
from playwright.sync_api import expect

from tests.e2e.conftest import shot
from tests.engine_process import EngineHandle

pytestmark = [pytest.mark.e2e, pytest.mark.integration]
# title, screenshot name, a text that is there once the page (and its live fragment) has rendered
PAGES = [("Overview", "overview", "Requests running"), ("GPU health", "gpu-health", "NVML says"),
         ("Engine settings", "engine-settings", "Capacity preview"), ("Playground", "playground", "Saved prompts"),
         ("Metrics", "metrics", "KPIs per revision"), ("Benchmarks", "benchmarks", "Concurrency sweep"),
         ("Events & logs", "events", "vLLM's log")]


def no_error_on(pg: Any) -> None:
    assert pg.locator('[data-testid="stException"]').count() == 0
    assert "Traceback" not in pg.inner_text("body")


def wait_rendered(pg: Any, title: str) -> None:
    pg.get_by_role("heading", name=title, level=1).wait_for()
    pg.wait_for_function("() => !document.querySelector('[data-testid=\"stStatusWidget\"]')", timeout=30_000)


def test_every_page_opens_from_the_sidebar(page: Any, console_url: str) -> None:
    page.goto(console_url)
    wait_rendered(page, "Overview")
    for title, slug, marker in PAGES:
        page.get_by_test_id("stSidebarNav").get_by_text(title, exact=True).click()
        wait_rendered(page, title)
        page.get_by_text(marker).first.wait_for()
        no_error_on(page)
        shot(page, f"page-{slug}")
    page.get_by_test_id("stSidebarNav").get_by_text("Overview", exact=True).click()
    wait_rendered(page, "Overview")
    assert "READY" in page.inner_text("body")


def test_dark_theme_at_laptop_width(browser: Any, console_url: str) -> None:
    context = browser.new_context(viewport={"width": 1280, "height": 800}, color_scheme="dark")
    pg = context.new_page()
    pg.goto(console_url)
    wait_rendered(pg, "Overview")
    pg.get_by_text("Requests running").wait_for()
    pg.get_by_text("engine_started").first.wait_for()
    no_error_on(pg)
    background = pg.evaluate("() => getComputedStyle(document.querySelector('.stApp')).backgroundColor")
    assert background != "rgb(255, 255, 255)"  # Streamlit followed the browser's dark preference
    shot(pg, "overview-dark-1280")
    context.close()


def test_apply_a_setting_and_watch_the_restart_finish(page: Any, console_url: str, engine: EngineHandle) -> None:
    before = engine.client.settings()
    page.goto(f"{console_url}/settings")
    wait_rendered(page, "Engine settings")
    seqs = page.get_by_label("max_num_seqs", exact=True)
    seqs.fill(str(before.values["max_num_seqs"] + 1))
    seqs.press("Tab")
    page.get_by_text("Capacity preview").wait_for()
    page.get_by_test_id("stDataFrame").wait_for()
    page.get_by_label("Note (why)").fill("e2e: one more sequence")
    page.get_by_label("Note (why)").press("Tab")
    page.get_by_role("button", name="Apply & restart").first.click()
    dialog = page.get_by_role("dialog")
    dialog.get_by_text("vLLM restarts with the new values").wait_for()
    shot(page, "apply-confirm")
    dialog.get_by_role("button", name="Apply & restart").click()
    page.get_by_role("heading", name=re.compile(r"Applying revision \d+")).wait_for()
    page.get_by_text(re.compile(r"Revision \d+ is ready after")).wait_for(timeout=600_000)
    shot(page, "apply-done")
    no_error_on(page)
    after = engine.client.status()
    assert after.state == "ready" and after.running_revision == before.revision + 1
    assert engine.client.settings().values["max_num_seqs"] == before.values["max_num_seqs"] + 1


def test_run_a_prompt_and_see_it_stream(page: Any, console_url: str) -> None:
    page.goto(f"{console_url}/playground")
    wait_rendered(page, "Playground")
    page.get_by_label("System prompt template").click()
    page.get_by_role("option", name="Concise JSON (under ~100 tokens)").click()
    expect(page.get_by_label("System prompt", exact=True)).to_have_value(re.compile("compact JSON"))
    page.get_by_label("Prompt", exact=True).fill("Describe what this module does.")
    page.get_by_role("button", name="Run").click()
    page.get_by_text("Time to first token").wait_for(timeout=120_000)
    no_error_on(page)
    body = page.inner_text("body")
    assert "Output tokens" in body and "Finish" in body
    shot(page, "playground-run")
