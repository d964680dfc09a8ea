"""The operator with two models, in Chromium: creates a second deployment on the Deployments page, opens it by
its deep link, reloads (still on it), goes to Settings (the form is the new deployment's, not the default's),
back to Overview, and compares the two deployments' answers to one prompt in the Playground."""

from __future__ import annotations

import re
from collections.abc import Iterator
from typing import Any

import pytest
from playwright.sync_api import expect

from tests.browser.conftest import no_error_on, open_page, shot, wait_rendered
from tests.testkit.engine import COLD_START_S, EngineHandle
from tests.testkit.wait import wait_until

B = "journey-b"


@pytest.fixture
def no_b(engine: EngineHandle) -> Iterator[None]:
    """Deployment B does not exist before the journey, and is removed after it (its vLLM stopped)."""
    def drop() -> None:
        if B in {d.name for d in engine.client.deployments()}:
            engine.client.delete_deployment(B, confirm=B)
    drop()
    yield
    drop()


def on_deployment(pg: Any, name: str) -> None:
    """The page says which deployment it is of, and its address carries it (a reload keeps it)."""
    pg.get_by_text(re.compile(rf"^Deployment {re.escape(name)}( ·|$)")).first.wait_for()
    assert f"deployment={name}" in pg.url, pg.url


def test_operator_creates_a_second_deployment_opens_it_by_link_and_compares_the_two(
        page: Any, console_url: str, engine: EngineHandle, no_b: None) -> None:
    pg = page
    default = engine.client.settings()
    a = next(d.name for d in engine.client.deployments() if d.default)
    seqs = 3 if default.values.max_num_seqs != 3 else 2

    open_page(pg, "Deployments")
    pg.get_by_role("textbox", name="Name (the model clients send)", exact=True).fill(B)
    seqs_field = pg.get_by_role("spinbutton", name="max_num_seqs", exact=True)
    seqs_field.fill(str(seqs))
    seqs_field.press("Tab")
    pg.get_by_role("button", name="Create").click()
    pg.get_by_text(f"Created {B}").wait_for()
    table = pg.get_by_test_id("stDataFrame").first
    expect(table).to_contain_text(B)  # listed at once
    no_error_on(pg)
    shot(pg, "journey-deployments-created")
    wait_until(lambda: engine.client.of(B).status().state == "ready", COLD_START_S, every=1,
               what=f"deployment {B} ready")
    # the page follows it without a reload (it said "starting" until someone reloaded, issue 31)
    expect(pg.get_by_test_id("stDataFrame").first).not_to_contain_text("starting", timeout=20_000)
    expect(pg.get_by_test_id("stDataFrame").first).not_to_contain_text("0 serving of", timeout=20_000)

    link = pg.locator(f'a[href*="deployment={B}"]').filter(has_text="Open").first
    link.click()
    wait_rendered(pg, "Overview")
    on_deployment(pg, B)
    deep = pg.url
    pg.reload()  # F5: still on B
    wait_rendered(pg, "Overview")
    on_deployment(pg, B)
    assert pg.url == deep
    expect(pg.get_by_text(re.compile(rf"model\s+{re.escape(B)}"))).not_to_have_count(0)  # "Use the model" card
    no_error_on(pg)
    shot(pg, "journey-deployments-overview-b")

    open_page(pg, "Engine settings")  # through the sidebar: the choice follows
    on_deployment(pg, B)
    expect(pg.get_by_role("spinbutton", name="max_num_seqs", exact=True)).to_have_value(str(seqs))
    expect(pg.get_by_role("spinbutton", name="cpu_kv_cache_gib (memory for the KV cache)", exact=True)
           ).to_have_value("0.250")
    assert str(seqs) != str(default.values.max_num_seqs)
    no_error_on(pg)
    shot(pg, "journey-deployments-settings-b")

    open_page(pg, "Overview")
    on_deployment(pg, B)
    expect(pg.get_by_test_id("stMetric").filter(has_text="Deployments")).to_contain_text("2 of 2 ready")

    open_page(pg, "Playground")
    pg.get_by_text("Compare two models side by side").click()
    box_a = pg.get_by_role("combobox", name="Model A")
    box_b = pg.get_by_role("combobox", name="Model B")
    box_a.wait_for()
    expect(box_a).to_have_value(B)  # the deployment chosen, and the other one
    expect(box_b).to_have_value(a)
    prompt = pg.get_by_label("Prompt", exact=True)
    prompt.fill("Describe what this module does.")
    prompt.press("Tab")
    tokens = pg.get_by_role("spinbutton", name="max_tokens")
    tokens.first.fill("12")
    tokens.first.press("Tab")
    pg.get_by_role("button", name="Run").click()
    expect(pg.get_by_test_id("stMetricLabel").filter(has_text="Finish")).to_have_count(2)
    expect(pg.get_by_text(re.compile(rf"^A · model {re.escape(B)} · temperature"))).not_to_have_count(0)
    expect(pg.get_by_text(re.compile(rf"^B · model {re.escape(a)} · temperature"))).not_to_have_count(0)
    expect(pg.get_by_text(re.compile(rf"model {re.escape(B)}$"))).not_to_have_count(0)
    expect(pg.get_by_text(re.compile(rf"model {re.escape(a)}$"))).not_to_have_count(0)
    outputs = pg.get_by_test_id("stMetric").filter(has_text="Output tokens").get_by_test_id("stMetricValue")
    assert [v for v in outputs.all_inner_texts() if v not in ("n/a", "0")], outputs.all_inner_texts()
    no_error_on(pg)
    pg.get_by_text(re.compile(rf"^A · model {re.escape(B)}")).last.scroll_into_view_if_needed()
    shot(pg, "journey-deployments-playground-compare")

    open_page(pg, "GPU health")  # the fleet: this host, no GPU (said so), both deployments' instances on it
    pg.get_by_text(re.compile(r"the engine's host · alive")).first.wait_for()
    pg.get_by_text("No GPU on any node: the CPU build of vLLM, host figures only.", exact=False).wait_for()
    instances = pg.get_by_test_id("stDataFrame").first
    expect(instances).to_contain_text(B)
    expect(instances).to_contain_text(a)
    pg.get_by_text(re.compile(r"^Resident memory by deployment: ")).first.wait_for()
    no_error_on(pg)
    shot(pg, "journey-deployments-fleet")
