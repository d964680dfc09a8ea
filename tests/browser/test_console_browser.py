"""End to end in headless Chromium: every page, a change applied at once, a prompt streamed."""

from __future__ import annotations

import re
from typing import Any

import pytest
from playwright.sync_api import expect

from tests.browser.conftest import cut_figures, no_error_on, open_page, shot, sign_in, wait_rendered
from tests.testkit.engine import ADMIN_PASSWORD, COLD_START_S, EngineHandle

# title, screenshot name, a text that is there once the page (and its live fragment) has rendered
PAGES = [("Overview", "overview", "Requests running"), ("Deployments", "deployments", "Create a deployment"),
         ("GPU health", "gpu-health", "NVML says"),
         ("Engine settings", "engine-settings", "Capacity preview"), ("Playground", "playground", "Saved prompts"),
         ("Metrics", "metrics", "KPIs per revision"), ("Benchmarks", "benchmarks", "Concurrency sweep"),
         ("Events & logs", "events", "vLLM's log"), ("Audit", "audit", "What happened next"),
         ("Access", "access", "Tokens and gateway keys"), ("Usage", "usage", "Window (UTC days)"),
         ("Alerts", "alerts", "What fired")]
SEES = {  # what each role finds in the sidebar
    "viewer": {"Overview", "Deployments", "GPU health", "Metrics", "Usage", "Events & logs", "Alerts"},
    "prompter": {"Overview", "Deployments", "GPU health", "Playground", "Metrics", "Usage", "Events & logs", "Alerts"},
    "operator": {"Overview", "Deployments", "GPU health", "Engine settings", "Playground", "Metrics", "Benchmarks",
                 "Usage", "Events & logs", "Alerts", "Audit"},
    "admin": {title for title, _, _ in PAGES},
}


def test_every_page_opens_from_the_sidebar(page: Any, console_url: str) -> None:
    wait_rendered(page, "Overview")
    for title, slug, marker in PAGES:
        open_page(page, title)
        page.get_by_text(marker).first.wait_for()
        no_error_on(page)
        shot(page, f"page-{slug}")
    open_page(page, "Overview")
    expect(page.locator("body")).to_contain_text("READY")  # the state badge is in a live fragment: retry


def test_sign_in_is_required_and_each_role_sees_its_pages(browser: Any, console_url: str,
                                                         engine: EngineHandle) -> None:
    existing = {u.username for u in engine.client.users()}
    for role in ("viewer", "prompter", "operator"):
        if f"{role}-user" not in existing:
            engine.client.create_user(f"{role}-user", f"{role}-password-123", role)
    for role, expected in SEES.items():
        context = browser.new_context(viewport={"width": 1280, "height": 800})
        pg = context.new_page()
        pg.goto(console_url)
        pg.get_by_role("heading", name="Sign in", level=1).wait_for()
        assert pg.get_by_test_id("stSidebarNav").count() == 0  # nothing before signing in
        if role == "viewer":
            pg.get_by_label("User").fill("viewer-user")
            pg.get_by_label("Password", exact=True).fill("wrong password")
            pg.get_by_role("button", name="Sign in").click()
            pg.get_by_text("Unknown user or wrong password").wait_for()
        user, password = ("admin", ADMIN_PASSWORD) if role == "admin" else (f"{role}-user", f"{role}-password-123")
        sign_in(pg, console_url, user, password)
        expect(pg.get_by_test_id("stSidebarNav").locator("a")).to_have_count(len(expected))  # then read once
        links = set(pg.get_by_test_id("stSidebarNav").locator("a").all_inner_texts())
        assert {link.strip().splitlines()[-1] for link in links} == expected, role  # text after the icon
        shot(pg, f"sidebar-{role}")
        context.close()


def test_dark_theme_at_laptop_width(browser: Any, console_url: str, engine: EngineHandle) -> None:
    context = browser.new_context(viewport={"width": 1280, "height": 800}, color_scheme="dark")
    pg = context.new_page()
    sign_in(pg, console_url, "admin", ADMIN_PASSWORD)
    wait_rendered(pg, "Overview")
    pg.get_by_text("Requests running").wait_for()
    # the latest events are listed (the newest of them: the suite's earlier tests pushed the engine's start out
    # of the ten shown)
    newest = engine.client.events(limit=1, newest_first=True)[0]
    pg.get_by_text(newest.kind, exact=True).first.wait_for()
    no_error_on(pg)
    background = pg.evaluate("() => getComputedStyle(document.querySelector('.stApp')).backgroundColor")
    assert background != "rgb(255, 255, 255)"  # Streamlit followed the browser's dark preference
    shot(pg, "overview-dark-1280")
    context.close()


@pytest.mark.parametrize(("width", "height"), [(1366, 768), (1280, 800)])
def test_every_figure_fits_its_box_at_laptop_widths(browser: Any, console_url: str, width: int,
                                                     height: int) -> None:
    """The Overview's and the Metrics page's live figures (Generation, KV-cache use, ...) at common laptop sizes:
    none cut off with an ellipsis."""
    context = browser.new_context(viewport={"width": width, "height": height})
    pg = context.new_page()
    pg.set_default_timeout(30_000)
    sign_in(pg, console_url, "admin", ADMIN_PASSWORD)
    for title, last in (("Overview", "Context length"), ("Metrics", "Preemptions")):
        open_page(pg, title)
        expect(pg.get_by_test_id("stMetricLabel").filter(has_text="Generation")).to_be_visible()
        expect(pg.get_by_test_id("stMetricLabel").filter(has_text=last)).to_be_visible()
        assert cut_figures(pg) == [], title
        shot(pg, f"{title.lower()}-{width}x{height}")
    context.close()


def test_a_max_num_seqs_within_its_ceiling_is_applied_at_once_without_a_restart(page: Any, console_url: str,
                                                                              engine: EngineHandle) -> None:
    """The system tier left the session's vLLM running with a max_num_seqs ceiling: a max_num_seqs below it is in
    effect at once, and the confirmation says so (not "vLLM restarts"). A change that restarts: the operator's
    journey (tests/browser/test_journeys.py)."""
    before = engine.client.settings()
    ceiling = before.values.max_num_seqs_ceiling
    if ceiling is None or before.values.max_num_seqs + 1 > ceiling:  # this tier alone: one restart to set it up
        rev = engine.client.put_settings(before.revision, {"max_num_seqs": 2, "max_num_seqs_ceiling": 8},
                                         "e2e: headroom for max_num_seqs")
        engine.client.wait_for({"ready"}, COLD_START_S, revision=rev.revision)
        before = engine.client.settings()
    pid = engine.client.status().pid
    open_page(page, "Engine settings")
    seqs = page.get_by_label("max_num_seqs", exact=True)
    seqs.fill(str(before.values.max_num_seqs + 1))
    seqs.press("Tab")
    page.get_by_text("Capacity preview").wait_for()
    page.get_by_test_id("stDataFrame").wait_for()
    page.get_by_label("Note (why)").fill("e2e: one more sequence")
    page.get_by_label("Note (why)").press("Tab")
    page.get_by_role("button", name="Apply now").first.click()
    dialog = page.get_by_role("dialog")
    dialog.get_by_text("without a restart").wait_for()
    expect(dialog).not_to_contain_text("vLLM restarts")
    dialog.get_by_text(re.compile(r"^In effect now — ")).wait_for()
    shot(page, "apply-soft-confirm")
    dialog.get_by_role("button", name="Apply now").click()
    # in effect at once: the "Applying revision N" heading may last less than one rerun, so the outcome is what
    # the operator is sure to see
    page.get_by_text(re.compile(r"Revision \d+ is ready after")).wait_for(timeout=60_000)
    shot(page, "apply-soft-done")
    no_error_on(page)
    after = engine.client.status()
    # the next revision id (ids are never reused, so a deleted deployment's may have been skipped)
    assert after.state == "ready" and after.running_revision == engine.client.settings().revision > before.revision
    assert after.pid == pid  # the same vLLM process: nothing restarted
    assert engine.client.settings().values.max_num_seqs == before.values.max_num_seqs + 1


def test_run_a_prompt_and_see_it_stream(page: Any, console_url: str) -> None:
    open_page(page, "Playground")
    page.get_by_label("System prompt template").click()
    page.get_by_role("option", name="Concise JSON (under ~100 tokens)").click()
    expect(page.get_by_label("System prompt", exact=True)).to_have_value(re.compile("compact JSON"))
    page.get_by_label("Prompt", exact=True).fill("Describe what this module does.")
    page.get_by_role("button", name="Run").click()
    page.get_by_text("Time to first token").wait_for(timeout=120_000)
    # the five figures render one element at a time: wait for the last ones rather than read the body once
    expect(page.get_by_test_id("stMetricLabel").filter(has_text="Output tokens")).to_be_visible()
    expect(page.get_by_test_id("stMetricLabel").filter(has_text="Finish")).to_be_visible()
    no_error_on(page)
    shot(page, "playground-run")


def test_a_page_opened_during_someone_else_s_apply_follows_it_to_the_end(page: Any, console_url: str,
                                                                         engine: EngineHandle) -> None:
    """After a reload during an apply (or in a second tab, or for a colleague) the settings page kept "revision N
    is being applied" 50 s and more after the apply had ended, until another reload (issue 31): every view of an
    apply follows the engine's state, whoever started it. A history entry opened meanwhile stays open when the page
    draws itself again (it closed under the operator: CI's rollback journey clicked an entry, then its button was
    gone)."""
    before = engine.client.settings()
    rev = engine.client.put_settings(before.revision, {"cpu_kv_cache_gib": before.values.cpu_kv_cache_gib + 0.05},
                                     "e2e: an apply this browser did not start")  # a restart (blue/green)
    open_page(page, "Engine settings")
    caption = page.get_by_text(re.compile(rf"revision {rev.revision} is being applied"))
    caption.wait_for(timeout=60_000)
    entry = page.get_by_test_id("stExpander").filter(has=page.get_by_text(re.compile(rf"^{before.revision} · ")))
    entry.get_by_text(re.compile(rf"^{before.revision} · ")).click()
    expect(entry.get_by_role("button", name=f"Roll back to revision {before.revision}")).to_be_visible()
    shot(page, "apply-followed-during")
    page.get_by_text(re.compile(rf"vLLM runs revision \*?\*?{rev.revision}")).first.wait_for(
        timeout=COLD_START_S * 1000)  # no reload: the page drew itself again when the apply ended
    expect(caption).to_have_count(0)
    expect(entry.get_by_role("button", name=f"Roll back to revision {before.revision}")).to_be_visible()
    no_error_on(page)
    shot(page, "apply-followed-after")
    assert engine.client.status().running_revision == rev.revision


def test_a_value_typed_in_a_section_just_opened_is_kept_while_the_page_answers_slowly(page: Any,
                                                                                      console_url: str) -> None:
    """An operator opens "Replicas, autoscaling and scale to zero" and types at once, while the console (loaded,
    or far away) has not yet answered the click. The answer drew the section anew, so what had been typed went
    back to the revision's value unseen, and the refusal the operator waited for never came (a browser journey on
    CI). The console's answers are held back here, as a slow one would be, until the value is typed."""
    held: list[Any] = []
    state: dict[str, Any] = {"hold": False, "page_ws": None}

    def relay(ws: Any) -> None:
        server = ws.connect_to_server()
        state["page_ws"] = ws

        def from_server(message: Any) -> None:
            if state["hold"]:
                held.append(message)
            else:
                ws.send(message)

        server.on_message(from_server)
        ws.on_message(server.send)

    page.route_web_socket(re.compile(r"/_stcore/stream"), relay)
    page.reload()  # (a new connection: through the relay from now on)
    wait_rendered(page, "Overview")
    open_page(page, "Engine settings")
    section = page.get_by_text("Replicas, autoscaling and scale to zero")
    section.wait_for()
    page.get_by_text("Capacity preview").wait_for()
    state["hold"] = True
    section.click()
    idle = page.get_by_role("spinbutton", name="scale_to_zero_after_s (0 = never)", exact=True)
    idle.fill("3")
    state["hold"] = False
    for message in held:  # the console's answer to the click, late
        state["page_ws"].send(message)
    held.clear()
    page.wait_for_function("() => !document.querySelector('[data-testid=\"stStatusWidget\"]')", timeout=30_000)
    expect(idle).to_have_value("3")  # still what was typed
    idle.press("Tab")
    page.get_by_text(re.compile(r"scale_to_zero_after_s: .*greater than or equal to 5")).wait_for()
    expect(page.get_by_role("button", name="Apply & restart")).to_be_disabled()
    no_error_on(page)


def test_on_call_finds_the_data_port_and_its_workers_on_the_overview_after_leaving_and_a_reload(
        page: Any, console_url: str, engine: EngineHandle) -> None:
    """The address clients use (the workers' data port) and how many workers serve it, as on-call reads them: on
    the Overview, again after another page and after a reload; with steering off (the default) nothing says some
    workers take no connections."""
    info = engine.client.gateway()
    assert info.data_base_url is not None and len(info.workers) == 1
    for step in ("open", "back", "reload"):
        if step == "back":
            open_page(page, "Metrics")
            open_page(page, "Overview")
        elif step == "reload":
            page.reload()
        wait_rendered(page, "Overview")
        caption = page.get_by_text("Served by 1 of 1 gateway workers")
        caption.wait_for()
        caption.scroll_into_view_if_needed()
        expect(page.locator("body")).to_contain_text(info.data_base_url)
        assert "take new connections now" not in caption.inner_text()
        no_error_on(page)
    shot(page, "overview-data-port-workers")
