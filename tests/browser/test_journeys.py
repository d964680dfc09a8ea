"""The three journeys through the console, in Debian's Chromium, each step asserted as a person sees it: the
operator who tunes, applies, watches and rolls back; the on-call engineer who checks health, events and logs during
a restart; the product team who chats, asks for JSON, saves, loads and compares. And a viewer with a deep link
and a reload. Each ends with a screenshot in tests/artifacts/."""

from __future__ import annotations

import re
import time
from typing import Any

import httpx
import pytest
from playwright.sync_api import TimeoutError as PlaywrightTimeoutError
from playwright.sync_api import expect

from engine.schemas import EventOut, SettingsValues
from tests.browser.conftest import (
    External,
    cut_figures,
    eventually,
    no_error_on,
    open_page,
    shot,
    sign_in,
    wait_rendered,
)
from tests.testkit.engine import COLD_START_S, EngineHandle
from tests.testkit.wait import wait_until


def field(pg: Any, label: str) -> Any:
    return pg.get_by_role("spinbutton", name=label, exact=True)


def form_shows(pg: Any, values: SettingsValues) -> None:
    """The settings form shows the desired revision's values (retrying: the page may still be rendering)."""
    expect(field(pg, "max_num_seqs")).to_have_value(str(values.max_num_seqs))
    expect(field(pg, "max_model_len (0 = the model's maximum)")).to_have_value(str(values.max_model_len or 0))
    expect(field(pg, "cpu_kv_cache_gib (memory for the KV cache)")).to_have_value(f"{values.cpu_kv_cache_gib:.3f}")


def choose(pg: Any, label: str, option: str) -> None:
    """Pick an option of a select box (its text filters the list: cleared first). A rerun of the page that lands
    while the list is open closes it (seen on a busy 2-core CI host): then the box is opened again."""
    box = pg.get_by_role("combobox", name=label)
    for attempt in range(3):
        box.click()
        box.fill("")
        wanted = pg.get_by_role("option", name=option, exact=True).first
        try:
            wanted.wait_for(timeout=15_000)
            wanted.click(timeout=15_000)
            return
        except PlaywrightTimeoutError:
            if attempt == 2:
                raise
            pg.keyboard.press("Escape")


def user(engine: EngineHandle, role: str) -> tuple[str, str]:
    name, password = f"journey-{role}", f"journey-{role}-password"
    if name not in {u.username for u in engine.client.users()}:
        engine.client.create_user(name, password, role)
    return name, password


def no_queue_talk(dialog: Any) -> None:
    """A confirmation of a plan that keeps serving (this host: blue/green) shows that plan and its ETA, and does
    not describe a pause."""
    dialog.get_by_text(re.compile(r"^Blue/green — ")).wait_for()
    expect(dialog).to_contain_text("no pause: something serves throughout")
    expect(dialog).to_contain_text(re.compile(r"It should take about \d+|How long it takes is not known"))
    expect(dialog).not_to_contain_text("wait in the gateway's queue")


def test_operator_tunes_applies_watches_the_phases_and_rolls_back(page: Any, engine: EngineHandle) -> None:
    external = External(page)
    engine.client.wait_for({"ready"}, COLD_START_S)
    for _ in range(25):  # a client's short requests: a max_model_len sized from them would refuse the playground's
        reply = httpx.post(f"{engine.url}/v1/completions", json={"model": "demo", "prompt": "Return the",
                                                                 "max_tokens": 4}, timeout=120)
        assert reply.status_code == 200, reply.text
    before = engine.client.settings()
    open_page(page, "Engine settings")
    form_shows(page, before.values)
    for _ in range(2):  # leave and come back: the form starts from the desired revision each time
        open_page(page, "Overview")
        open_page(page, "Engine settings")
        form_shows(page, before.values)
        page.get_by_text(f"No edits: the form shows desired revision {before.revision}").wait_for()
        expect(page.get_by_role("button", name="Apply & restart")).to_be_disabled()

    kv = field(page, "cpu_kv_cache_gib (memory for the KV cache)")
    kv.fill("0.001")
    kv.press("Tab")
    use = page.get_by_role("button", name=re.compile(r"Use cpu_kv_cache_gib = "))
    use.wait_for()
    fit = use.inner_text().rsplit("=", 1)[1].strip()
    use.click()
    expect(kv).to_have_value(f"{float(fit):.3f}")
    expect(page.get_by_role("button", name=re.compile(r"Use cpu_kv_cache_gib = "))).to_have_count(0)
    kv.fill(f"{before.values.cpu_kv_cache_gib:.3f}")
    kv.press("Tab")

    # the KV cache's size is fixed at vLLM's start: a change restarts it (max_num_seqs below its ceiling would not)
    kv.fill(f"{before.values.cpu_kv_cache_gib + 0.05:.3f}")
    kv.press("Tab")
    page.get_by_test_id("stDataFrame").wait_for()  # "Changes": what was edited, and nothing else
    expect(page.get_by_role("button", name="Apply & restart")).to_be_enabled()
    page.get_by_text("Capacity preview").wait_for()
    expect(page.get_by_test_id("stMetricLabel").filter(has_text="Concurrency")).to_be_visible()
    assert cut_figures(page) == []
    # the CPU build's KV cache is cpu_kv_cache_gib whatever max_model_len is: no smaller one is suggested
    expect(page.get_by_role("button", name=re.compile(r"Use max_model_len = "))).to_have_count(0)
    expect(page.locator("body")).not_to_contain_text("free KV cache")
    note = page.get_by_label("Note (why)")
    note.fill("journey: a larger KV cache")
    note.press("Tab")
    page.get_by_role("button", name="Apply & restart").first.click()
    dialog = page.get_by_role("dialog")
    dialog.get_by_text("vLLM restarts with the new values").wait_for()
    no_queue_talk(dialog)
    dialog.get_by_role("button", name="Apply & restart").click()
    page.get_by_role("heading", name=re.compile(r"Applying revision \d+")).wait_for()
    for phase in ("Process and imports", "Loading weights", "API server up"):  # the phases, as they happen
        page.get_by_text(phase).first.wait_for(timeout=COLD_START_S * 1000)
    page.get_by_text(re.compile(r"Revision \d+ is ready after")).wait_for(timeout=COLD_START_S * 1000)
    applied = engine.client.settings()
    assert applied.values.cpu_kv_cache_gib == pytest.approx(before.values.cpu_kv_cache_gib + 0.05)
    expect(page.get_by_label("Note (why)")).to_have_value("")
    form_shows(page, applied.values)
    page.get_by_text("Timeline of the restart").click()
    page.get_by_text(re.compile(r"Ready after .* expected .* off by")).first.wait_for()
    ready = engine.client.events(kinds=["ready"], newest_first=True, limit=1)[0]
    startup = ready.data["startup"]
    assert ready.revision == applied.revision and isinstance(startup, dict) and "phases" in startup
    shot(page, "journey-operator-applied")

    # a forced revision that cannot start: its confirmation shows the plan that will run, then it is rejected
    length = field(page, "max_model_len (0 = the model's maximum)")
    length.fill("4096")
    length.press("Tab")
    page.get_by_text("is above the model's limit of 2048").first.wait_for()
    page.get_by_role("button", name="Apply & restart").first.click()
    dialog = page.get_by_role("dialog")
    no_queue_talk(dialog)
    dialog.get_by_text("Force it anyway").click()
    dialog.get_by_role("button", name="Apply & restart").click()
    page.get_by_text(re.compile(r"Revision \d+ did not start and was rolled back")).wait_for(
        timeout=COLD_START_S * 1000)
    rejected = next(r for r in engine.client.history(limit=5) if r.status == "rejected")
    page.get_by_text(re.compile(rf"^{rejected.revision} · rejected")).first.click()
    page.get_by_text(f"No rollback to revision {rejected.revision}: pre-flight refuses its values").wait_for()
    expect(page.get_by_role("button", name=f"Roll back to revision {rejected.revision}")).to_have_count(0)
    shot(page, "journey-operator-rejected")

    page.get_by_text(re.compile(rf"^{before.revision} · ")).first.click()  # its history entry
    page.get_by_role("button", name=f"Roll back to revision {before.revision}").click()
    dialog = page.get_by_role("dialog")
    dialog.get_by_text("becomes the desired one").wait_for()
    no_queue_talk(dialog)  # the plan for revision 1's values, with its ETA
    shot(page, "journey-operator-rollback-confirm")
    dialog.get_by_role("button", name=f"Roll back to revision {before.revision}").click()
    # the heading names the revision rolled back to, then the new one that carries its values (it said "Rolling
    # back to revision 8" for a rollback to 6)
    page.get_by_role("heading", name=re.compile(rf"Rolling back to revision {before.revision}: applying revision "
                                                r"\d+")).wait_for()
    page.get_by_text(re.compile(r"Revision \d+ is ready after")).wait_for(timeout=COLD_START_S * 1000)
    assert engine.client.settings().values.cpu_kv_cache_gib == before.values.cpu_kv_cache_gib
    form_shows(page, engine.client.settings().values)
    no_error_on(page)
    shot(page, "journey-operator-rolled-back")
    assert external.urls == []


def test_on_call_checks_health_follows_a_restart_live_and_filters_the_log(browser: Any, console_url: str,
                                                                         engine: EngineHandle) -> None:
    name, password = user(engine, "viewer")
    context = browser.new_context(viewport={"width": 1280, "height": 900})
    pg = context.new_page()
    pg.set_default_timeout(30_000)
    external = External(pg)
    engine.client.wait_for({"ready"}, COLD_START_S)
    sign_in(pg, console_url, name, password)
    pg.get_by_text("Latest events").wait_for()
    open_page(pg, "GPU health")
    pg.get_by_text("No GPU: this host runs the CPU build of vLLM").wait_for()
    expect(pg.locator(".js-plotly-plot")).to_have_count(2)
    pg.get_by_role("radio", name="1 hour", exact=True).click()
    pg.get_by_text("4 s per point").wait_for()  # an hour in at most ~1,000 points
    for leave in (lambda: open_page(pg, "Overview"), pg.reload):  # the window is kept across both
        leave()
        open_page(pg, "GPU health")
        expect(pg.get_by_role("radio", name="1 hour", exact=True)).to_be_checked()
        pg.get_by_text("4 s per point").wait_for()
    open_page(pg, "Overview")
    marker = engine.client.events(limit=1, newest_first=True)[0].id

    def event(kind: str, since: int, restart: bool = False) -> EventOut | None:
        return next((e for e in engine.client.events(since=since, kinds=[kind])
                     if not restart or e.data.get("restart") is True), None)

    engine.client.engine_action("restart")  # another operator restarts vLLM: the on-call view follows it
    pg.get_by_text("restart requested by tests").first.wait_for()
    # A restart does not pause (blue/green): the new instance starts beside the one that serves, and the engine
    # stays READY throughout; the page shows the apply under way, then the new instance's ready event.
    plan = wait_until(lambda: event("apply_plan", marker, restart=True), COLD_START_S, every=0.5,
                      what="the restart's apply plan")
    pg.get_by_text(re.compile(r"Applying revision \d+")).first.wait_for()
    plan_kind = plan.data["plan"]["kind"] if isinstance(plan.data["plan"], dict) else None
    assert plan_kind not in ("soft", None), plan.message  # a restart starts new instances: never "in effect now"
    if plan_kind in ("blue_green", "bridge", "rolling"):  # something serves throughout (this host: blue/green)
        expect(pg.locator("body")).to_contain_text("READY")
    ready = wait_until(lambda: event("ready", plan.id), COLD_START_S, every=0.5,
                       what="the new instance's ready event")
    pg.get_by_text(ready.message).first.wait_for()  # live: no navigation, no reload
    done = wait_until(lambda: event("apply_done", plan.id), COLD_START_S, every=0.5, what="the end of the restart")
    assert done.data["outcome"] == "applied", done.message
    pg.get_by_text(done.message).first.wait_for()  # the old instance drained and stopped: the restart is over
    expect(pg.locator("body")).to_contain_text("READY")

    open_page(pg, "Events & logs")
    for ev in (plan, done):  # the apply's own events are in the default view, each message whole
        expect(pg.get_by_text(ev.message, exact=True).first).to_be_visible()
    code = pg.get_by_test_id("stCode").last
    choose(pg, "Level", "failures only")  # the planned swap stopped the old instance: its shutdown is no failure
    info_line = re.compile(r"^(\(\S+ pid=\d+\) )?INFO\b", re.MULTILINE)
    # the page ran again with the filter (no INFO line left), so its draft holds it before we leave
    eventually(lambda: (text := code.inner_text().strip()) != "" and not info_line.search(text))
    expect(code).not_to_contain_text("EngineDeadError")
    expect(code).not_to_contain_text("output_handler failed")
    shot(pg, "journey-on-call-failures-only")
    for leave in (lambda: open_page(pg, "Overview"), pg.reload):  # the filters are kept across both
        leave()
        open_page(pg, "Events & logs")
        expect(pg.get_by_role("combobox", name="Level")).to_have_value("failures only", timeout=20_000)
    choose(pg, "Level", "everything")
    eventually(lambda: "lines of leak reports at exit" in code.inner_text())  # ~30 lines each stop, folded
    expect(code).not_to_contain_text('"GET /health')  # polling is hidden by default
    choose(pg, "Level", "warnings and up")
    info = re.compile(r"^(\(\S+ pid=\d+\) )?INFO\b")

    def only_warnings() -> bool:
        lines = code.inner_text().splitlines()
        return bool(lines) and "WARNING" in lines[0] and not any(info.match(ln) for ln in lines)

    eventually(only_warnings)
    pg.get_by_label("Text").fill("KV cache")
    pg.get_by_label("Text").press("Enter")
    choose(pg, "Level", "everything")
    eventually(lambda: code.inner_text().splitlines() != [] and all(
        "kv cache" in ln.lower() for ln in code.inner_text().splitlines()) and "KV cache size" in code.inner_text())
    no_error_on(pg)
    shot(pg, "journey-on-call")
    assert external.urls == []
    context.close()


def test_product_team_chats_asks_for_json_saves_loads_and_compares(browser: Any, console_url: str,
                                                                   engine: EngineHandle) -> None:
    name, password = user(engine, "prompter")
    context = browser.new_context(viewport={"width": 1440, "height": 1000})
    pg = context.new_page()
    pg.set_default_timeout(60_000)
    external = External(pg)
    engine.client.wait_for({"ready"}, COLD_START_S)
    sign_in(pg, console_url, name, password)
    open_page(pg, "Playground")
    prompt = pg.get_by_label("Prompt", exact=True)
    for i, text in enumerate(("Describe what this module does.", "And what does it return?")):
        prompt.fill(text)
        prompt.press("Tab")
        pg.get_by_role("button", name="Run").click()
        expect(pg.get_by_test_id("stChatMessage")).to_have_count(2 * (i + 1))  # a multi-turn conversation
        expect(pg.get_by_test_id("stMetricLabel").filter(has_text="Finish")).to_be_visible()
    rate = pg.get_by_test_id("stMetric").filter(has_text="Tokens/s").get_by_test_id("stMetricValue").inner_text()
    assert rate == "n/a" or float(rate.replace(",", "")) < 20_000  # output tokens over the generation time

    # a draft half written: leaving the page and a reload (F5) keep all of it, not only the conversation
    tokens = pg.get_by_role("spinbutton", name="max_tokens")
    tokens.first.fill("64")
    tokens.first.press("Tab")
    prompt.fill("A draft I am still writing")
    prompt.press("Tab")
    choose(pg, "Output format", "JSON object")
    compare = pg.get_by_label("Compare two parameter sets side by side")
    pg.get_by_text("Compare two parameter sets side by side").click()
    pg.get_by_text(re.compile(r"^B · temperature")).first.wait_for()
    tokens.nth(1).fill("48")
    tokens.nth(1).press("Tab")
    pg.get_by_text(re.compile(r"^B · .*max_tokens 48")).first.wait_for()

    def draft_kept(after: str) -> None:
        expect(prompt, f"the prompt, {after}").to_have_value("A draft I am still writing")
        expect(tokens.first).to_have_value("64")
        expect(tokens.nth(1)).to_have_value("48")
        expect(pg.get_by_role("combobox", name="Output format")).to_have_value("JSON object")
        expect(compare).to_be_checked()
        expect(pg.get_by_test_id("stChatMessage")).to_have_count(4)  # and the conversation
        tokens.nth(1).scroll_into_view_if_needed()  # the page scrolls inside its own frame: A and B in view
        shot(pg, f"journey-product-team-draft-{after}")

    open_page(pg, "Overview")  # another page, and back
    open_page(pg, "Playground")
    draft_kept("page-switch")
    pg.reload()  # F5: the page is drawn again from the draft
    wait_rendered(pg, "Playground")
    draft_kept("reload")
    open_page(pg, "Playground")  # and it stays so
    draft_kept("reload-then-click")
    shot(pg, "journey-product-team-draft-kept")
    pg.get_by_text("Compare two parameter sets side by side").click()
    expect(compare).not_to_be_checked()

    choose(pg, "Output format", "JSON schema")
    pg.get_by_label("JSON schema").wait_for()
    pg.get_by_role("button", name="New conversation").click()
    prompt.fill("Answer as JSON: what is a module?")
    prompt.press("Tab")
    pg.get_by_role("button", name="Run").click()
    pg.get_by_text(re.compile(r"JSON check: ")).wait_for()  # checked against the schema it asked for
    pg.get_by_role("button", name="Run").scroll_into_view_if_needed()
    shot(pg, "journey-product-team-json-schema")  # one parameter set: A's fields alone, the schema beside the format

    pg.get_by_role("button", name="Save prompt").click()
    pg.get_by_label("Name", exact=True).fill("journey prompt")
    pg.get_by_label("Name", exact=True).press("Tab")
    pg.get_by_role("button", name="Save", exact=True).click()
    mine = f"journey prompt (chat) · by {name}"  # each saved prompt names its author
    expect(pg.get_by_role("combobox", name="Saved prompts")).to_have_value(mine)  # at once
    open_page(pg, "Overview")
    open_page(pg, "Playground")
    choose(pg, "Saved prompts", mine)
    prompt.fill("something else")
    prompt.press("Tab")
    pg.get_by_role("button", name="Load").click()
    expect(prompt).to_have_value("Answer as JSON: what is a module?")
    expect(pg.get_by_role("combobox", name="Output format")).to_have_value("JSON schema")
    no_error_on(pg)

    choose(pg, "Output format", "Text")
    pg.get_by_text("Compare two parameter sets side by side").click()
    pg.get_by_text(re.compile(r"^B · temperature")).first.wait_for()  # labelled before it runs
    pg.get_by_role("button", name="Run").click()
    expect(pg.get_by_test_id("stMetricLabel").filter(has_text="Finish")).to_have_count(2)
    expect(pg.get_by_text(re.compile(r"^A · temperature"))).not_to_have_count(0)
    assert cut_figures(pg) == []
    no_error_on(pg)
    shot(pg, "journey-product-team")

    # someone else's saved prompt: shown with its author, and not this prompter's to delete
    team = engine.client.save_prompt("team prompt", "chat", "", "Shared by an operator.", {})
    pg.reload()
    wait_rendered(pg, "Playground")
    theirs = f"team prompt (chat) · by {team.author}"
    choose(pg, "Saved prompts", theirs)
    expect(pg.get_by_role("button", name="Delete")).to_be_disabled()
    choose(pg, "Saved prompts", mine)
    pg.get_by_role("button", name="Delete").click()  # one's own: after a confirmation that names it
    dialog = pg.get_by_role("dialog")
    expect(dialog).to_contain_text(f"journey prompt (chat) by {name}")
    dialog.get_by_role("button", name="Delete").click()
    expect(pg.get_by_role("combobox", name="Saved prompts")).to_have_value("—")
    assert "journey prompt" not in [p.name for p in engine.client.prompts()]
    no_error_on(pg)
    assert external.urls == []
    engine.client.delete_prompt(team.id)
    context.close()


def test_a_viewer_follows_a_deep_link_reloads_and_signs_out(browser: Any, console_url: str,
                                                            engine: EngineHandle) -> None:
    name, password = user(engine, "viewer")
    context = browser.new_context(viewport={"width": 1280, "height": 900})
    pg = context.new_page()
    pg.set_default_timeout(30_000)
    t0 = time.monotonic()
    pg.goto(f"{console_url}/events")  # a deep link, signed out: the sign-in first, then the page asked for
    pg.get_by_role("heading", name="Sign in", level=1).wait_for()
    assert "next=%2Fevents" in pg.url
    pg.get_by_label("User").fill(name)
    pg.get_by_label("Password", exact=True).fill(password)
    pg.get_by_role("button", name="Sign in").click()
    wait_rendered(pg, "Events & logs")
    assert time.monotonic() - t0 < 30
    cookie = next(c for c in context.cookies() if c["name"] == "llmops_session")
    assert cookie["httpOnly"] and cookie["sameSite"] == "Strict"
    assert "llmops_" not in pg.evaluate("document.cookie")  # out of page scripts' reach
    pg.reload()  # F5: still signed in, still on the same page
    wait_rendered(pg, "Events & logs")
    pg.goto(f"{console_url}/settings")  # not a viewer's page: it says which role it needs, and shows nothing else
    wait_rendered(pg, "Engine settings")
    pg.get_by_text("needs the operator role").wait_for()
    pg.goto(f"{console_url}/engine_settings")  # the README's old deep link lands on the page, not "not found"
    wait_rendered(pg, "Engine settings")
    pg.get_by_text("needs the operator role").wait_for()
    expect(pg.locator("body")).not_to_contain_text("Page not found")
    eventually(lambda: pg.url.endswith("/settings"))
    assert pg.get_by_role("spinbutton").count() == 0
    assert pg.get_by_test_id("stSidebarNav").get_by_text("Engine settings", exact=True).count() == 0
    no_error_on(pg)
    shot(pg, "journey-viewer")
    pg.get_by_role("button", name="Sign out").click()
    pg.get_by_role("heading", name="Sign in", level=1).wait_for()
    pg.get_by_text("You are signed out.").wait_for()
    pg.goto(f"{console_url}/events")
    pg.get_by_role("heading", name="Sign in", level=1).wait_for()  # the session ended at the engine too
    assert engine.client.audit(action="auth.logout", actor=name)
    context.close()
