"""The console in a real browser: Streamlit serving console/app.py against the session's engine, driven by
Playwright in Debian's headless Chromium (Playwright's own browser download does not work here)."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from engine.vllm import free_port
from tests.testkit.engine import ADMIN_PASSWORD, COLD_START_S, REPO, EngineHandle

CHROMIUM = "/usr/bin/chromium"
ARTIFACTS = REPO / "tests" / "artifacts"
CHROMIUM_ARGS = ["--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run", "--disable-sync",
                 "--disable-background-networking", "--disable-component-update"]


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    if Path(CHROMIUM).exists() or os.environ.get("LLMOPS_REQUIRE_BROWSER") == "1":
        return
    skip = pytest.mark.skip(reason=f"no {CHROMIUM}: `apt-get install chromium` to run the browser tests")
    for item in items:
        if "tests/browser/" in str(item.fspath):
            item.add_marker(skip)


@pytest.fixture(scope="session")
def console_url(engine: EngineHandle) -> Iterator[str]:
    port = free_port()
    log = open(engine.data_dir / "console.log", "wb")  # noqa: SIM115 - lives as long as the console
    proc = subprocess.Popen([sys.executable, "-m", "engine.cli", "console", "--console-port", str(port),
                             "--engine-url", engine.url, "--data-dir", str(engine.data_dir)],  # its console key
                            stdout=log, stderr=subprocess.STDOUT, cwd=REPO)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 60
    while True:
        try:
            if httpx.get(f"{url}/_stcore/health", timeout=2).status_code == 200:
                break
        except httpx.HTTPError:
            pass
        assert proc.poll() is None and time.monotonic() < deadline, (engine.data_dir / "console.log").read_text()
        time.sleep(0.3)
    engine.client.wait_for({"ready"}, COLD_START_S)
    yield url
    proc.terminate()
    proc.wait(timeout=30)
    log.close()


@pytest.fixture(scope="module")
def browser() -> Iterator[object]:
    """Module-scoped: Playwright's sync API keeps an event loop running in this thread while it is open."""
    from playwright.sync_api import sync_playwright

    with sync_playwright() as p:
        b = p.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
        yield b
        b.close()


def sign_in(pg: Any, console_url: str, user: str, password: str) -> None:
    pg.goto(console_url)
    pg.get_by_label("User").fill(user)
    pg.get_by_label("Password", exact=True).fill(password)
    pg.get_by_role("button", name="Sign in").click()
    pg.get_by_role("heading", name="Overview", level=1).wait_for()


@pytest.fixture
def page(browser: object, console_url: str) -> Iterator[object]:
    """A browser page signed in as admin."""
    context = browser.new_context(viewport={"width": 1440, "height": 1000})  # type: ignore[attr-defined]
    pg = context.new_page()
    pg.set_default_timeout(30_000)
    sign_in(pg, console_url, "admin", ADMIN_PASSWORD)
    yield pg
    context.close()


# The page's own text, without what it quotes: vLLM's log on the Events page holds vLLM's tracebacks (it prints
# one at every shutdown), which are content, not a failure of the page.
_PAGE_TEXT = """() => { const body = document.body.cloneNode(true);
  body.querySelectorAll('pre, code, [data-testid="stCode"]').forEach(e => e.remove()); return body.innerText; }"""


def no_error_on(pg: Any) -> None:
    assert pg.locator('[data-testid="stException"]').count() == 0
    assert "Traceback" not in pg.evaluate(_PAGE_TEXT)


def wait_rendered(pg: Any, title: str) -> None:
    pg.get_by_role("heading", name=title, level=1).wait_for()
    pg.wait_for_function("() => !document.querySelector('[data-testid=\"stStatusWidget\"]')", timeout=30_000)


def open_page(pg: Any, title: str) -> None:
    """Through the sidebar, as a person does."""
    pg.get_by_test_id("stSidebarNav").get_by_text(title, exact=True).click()
    wait_rendered(pg, title)


def cut_figures(pg: Any) -> list[str]:
    """The figures (st.metric values) that do not fit their box and show an ellipsis instead of the number."""
    return list(pg.evaluate("""() => [...document.querySelectorAll('[data-testid="stMetricValue"]')]
        .filter(el => { const t = el.querySelector('div') || el; return t.scrollWidth > t.clientWidth + 1; })
        .map(el => el.innerText)"""))


def eventually(check: Callable[[], bool], timeout: float = 30.0, every: float = 0.25) -> None:
    """Poll ``check`` until it holds, or fail after ``timeout`` seconds (a page renders in steps)."""
    deadline = time.monotonic() + timeout
    while not check():
        assert time.monotonic() < deadline, f"{getattr(check, '__name__', 'check')} did not hold in {timeout:.0f} s"
        time.sleep(every)


class External:
    """Requests a page makes beyond this machine (the console fetches nothing from the internet)."""

    def __init__(self, pg: Any) -> None:
        self.urls: list[str] = []
        pg.on("request", self._seen)

    def _seen(self, request: Any) -> None:
        url = str(request.url)
        if not url.startswith(("http://127.0.0.1", "ws://127.0.0.1", "http://localhost", "data:", "blob:")):
            self.urls.append(url)


def shot(pg: object, name: str) -> Path:
    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    path = ARTIFACTS / f"{name}.png"
    pg.screenshot(path=str(path), full_page=True)  # type: ignore[attr-defined]
    return path
