"""The Access page and signing out, in Debian's Chromium, as an admin uses them (issue 17)."""

from __future__ import annotations

from typing import Any

import httpx
from playwright.sync_api import expect

from tests.browser.conftest import no_error_on, open_page, shot, wait_rendered
from tests.browser.test_journeys import choose
from tests.testkit.engine import EngineHandle
from tests.testkit.wait import wait_until


def test_an_admin_creates_a_user_and_the_form_forgets_the_password_then_deletes_them(
        page: Any, engine: EngineHandle) -> None:
    open_page(page, "Access")
    new_user = page.get_by_test_id("stForm").filter(has_text="New user")
    new_user.get_by_label("User name").fill("e2e-temp")
    new_user.get_by_label("Initial password (10+ characters)").fill("e2e-temp-password")
    new_user.get_by_role("button", name="Create").click()
    wait_until(lambda: "e2e-temp" in {u.username for u in engine.client.users()}, 30, what="the user created")
    # the form is empty for the next user: neither the name nor the password of this one is left in it
    expect(new_user.get_by_label("User name")).to_have_value("", timeout=30_000)
    expect(new_user.get_by_label("Initial password (10+ characters)")).to_have_value("", timeout=30_000)
    shot(page, "access-user-created")
    no_error_on(page)

    key = engine.client.create_token("e2e-temp-key", "prompter", "gateway")  # not theirs: stays
    choose(page, "Delete a user", "e2e-temp")  # (typed to filter, again if a rerun closed the list)
    page.get_by_role("button", name="Delete…").click()
    dialog = page.get_by_role("dialog")
    expect(dialog).to_contain_text("e2e-temp is deleted: they can no longer sign in")
    expect(dialog).to_contain_text("Their records in the audit stay. This cannot be undone.")
    shot(page, "access-delete-confirmation")
    dialog.get_by_role("button", name="Delete e2e-temp").click()
    wait_until(lambda: "e2e-temp" not in {u.username for u in engine.client.users()}, 30, what="the user deleted")
    expect(page.get_by_role("dialog")).to_have_count(0, timeout=30_000)
    wait_rendered(page, "Access")
    no_error_on(page)
    assert not next(t for t in engine.client.tokens() if t.id == key.id).revoked_at
    engine.client.revoke_token(key.id)


def test_sign_out_is_a_post_and_the_sidebar_button_still_signs_out(page: Any, console_url: str,
                                                                   engine: EngineHandle) -> None:
    assert httpx.get(f"{console_url}/signout", follow_redirects=False).status_code == 405
    wait_rendered(page, "Overview")
    page.get_by_role("button", name="Sign out").click()
    page.get_by_role("heading", name="Sign in", level=1).wait_for()
    page.get_by_text("You are signed out.").wait_for()
    page.goto(f"{console_url}/events")
    page.get_by_role("heading", name="Sign in", level=1).wait_for()  # the session ended at the engine too
    shot(page, "signed-out")
