"""The Streamlit console's frame: the signed-in user, the pages their role may see, sign-out.

Nobody reaches a page anonymously. The sign-in happens on the console's server (console/server.py), which keeps the
engine's session token in an HttpOnly cookie; this script reads it from the request, asks the engine who it is,
and builds the navigation from the role. A reload or a deep link (``/settings``) keeps the session until it
expires or the user signs out. Single sign-on goes through Streamlit's st.login where an identity provider is
configured. Pages live in pages/ and reach the engine only through engine/client.py.
"""

from __future__ import annotations

import contextlib
import os
import sys
from pathlib import Path
from typing import NoReturn

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:  # streamlit puts console/ on the path, not the project root
    sys.path.insert(0, str(ROOT))

import pandas  # noqa: E402, F401 - imported whole before any page runs: plotly finds pandas in sys.modules, and a
import plotly.graph_objects  # noqa: E402, F401 - chart drawn in one thread met it half-imported by another (a fresh
import streamlit as st  # noqa: E402 - console's Engine settings page: "partially initialized module 'pandas'")

from console import drafts  # noqa: E402
from console.identity import sso_username  # noqa: E402
from console.session import COOKIE  # noqa: E402
from console.widgets import PAGES as PAGE_LINKS  # noqa: E402
from console.widgets import client, go_to, sign_in_url, sign_out, sign_out_form, switcher  # noqa: E402
from engine.client import ROLES, ApiError, ClientError, EngineClient  # noqa: E402
from engine.schemas import MeOut  # noqa: E402

# A local icon: a material one is fetched from fonts.gstatic.com, and the console fetches nothing from the internet.
st.set_page_config(page_title="llmops console", page_icon=str(ROOT / "console" / "assets" / "favicon.png"),
                   layout="wide")
PAGES = ROOT / "pages"


def sso_configured() -> bool:
    try:
        return "auth" in st.secrets
    except (FileNotFoundError, KeyError):
        return False


def to_sign_in(why: str | None = None) -> NoReturn:
    sign_out()
    go_to(sign_in_url(why), "Sign in to use the console.")
    st.stop()


def sso_sign_in() -> None:
    """Single sign-on: Streamlit's st.login, then the console's service token opens an engine session."""
    st.title("Sign in")
    if not st.user.is_logged_in:
        st.button("Sign in with single sign-on", on_click=st.login)
        return
    service = os.environ.get("LLMOPS_CONSOLE_TOKEN")
    username = sso_username(dict(st.user))
    if username is None:
        st.error("Your identity provider signed you in but did not verify your email address (email_verified), so "
                 "it cannot name a user of the console: ask your administrator.")
        return
    try:
        result = EngineClient(os.environ.get("LLMOPS_ENGINE_URL"), token=service or "").sso_session(username)
    except ClientError as exc:
        st.error(f"Signed in as {username}, but the engine opens no session for this user: {exc}")
        return
    st.session_state["token"] = result.token
    st.rerun()


def who(token: str) -> MeOut:
    """The engine's answer to who this token is, once per Streamlit session and token."""
    cached: tuple[str, MeOut] | None = st.session_state.get("_me")
    if cached is not None and cached[0] == token:
        return cached[1]
    me = client().me()
    st.session_state["_me"] = (token, me)
    st.session_state["username"], st.session_state["role"] = me.name, me.role
    return me


token = st.session_state.get("token") or st.context.cookies.get(COOKIE)
if not token:
    if sso_configured() and (st.query_params.get("sso") == "1" or st.user.is_logged_in):
        st.navigation([st.Page(sso_sign_in, title="Sign in", icon=":material/lock:")]).run()
        st.stop()
    to_sign_in()
st.session_state["token"] = token
try:
    me = who(token)
except ApiError as exc:
    if exc.status == 401:
        to_sign_in("expired")
    st.error(f"**The engine refused the sign-in.** {exc}", icon=":material/error:")
    st.stop()
except ClientError as exc:
    st.error(f"**The engine is unreachable.** {exc}\n\nStart it with `make run` (or `llmops engine`); this page "
             "retries when you reload it.", icon=":material/cloud_off:")
    st.stop()
role = me.role


def allowed(needed: str) -> bool:
    return ROLES.index(role) >= ROLES.index(needed)


# (section, page script, title, icon, the least role that sees it)
PAGE_TABLE = [
    ("Operate", "overview", "Overview", ":material/dashboard:", "viewer"),
    ("Operate", "deployments", "Deployments", ":material/stacks:", "viewer"),
    ("Operate", "gpu_health", "GPU health", ":material/memory:", "viewer"),
    ("Operate", "settings", "Engine settings", ":material/tune:", "operator"),
    ("Use", "playground", "Playground", ":material/chat:", "prompter"),
    ("Measure", "metrics", "Metrics", ":material/monitoring:", "viewer"),
    ("Measure", "benchmarks", "Benchmarks", ":material/speed:", "operator"),
    ("Measure", "usage", "Usage", ":material/receipt_long:", "viewer"),
    ("Investigate", "events", "Events & logs", ":material/history:", "viewer"),
    ("Investigate", "alerts", "Alerts", ":material/notifications:", "viewer"),
    ("Investigate", "audit", "Audit", ":material/policy:", "operator"),
    ("Administer", "access", "Access", ":material/group:", "admin"),
]


def forbidden(title: str, needed: str) -> st.Page:
    """A page the role may not see: hidden from the menu, and a deep link to it says why instead of 'not found'."""
    def explain() -> None:
        st.title(title)
        st.warning(f"**{title}** needs the {needed} role; you are signed in as {me.name} ({role}). An admin can "
                   "change your role on the Access page.", icon=":material/lock:")
    return st.Page(explain, title=title, url_path=script_of[title], visibility="hidden")


# Other paths people (and older links, like the README's /engine_settings) use for a page: each lands on it.
ALIASES = {"engine_settings": "settings", "engine-settings": "settings", "gpu": "gpu_health",
           "gpu-health": "gpu_health", "events_and_logs": "events", "events-and-logs": "events", "logs": "events",
           "home": "overview", "fleet": "gpu_health", "models": "deployments"}


def alias(path: str, target: st.Page) -> st.Page:
    """A hidden page at ``path`` that sends the browser on to ``target`` (its address becomes the page's own)."""
    def go() -> None:
        st.switch_page(target, query_params=st.query_params.to_dict())  # ?deployment= goes along
    return st.Page(go, title=target.title, url_path=path, visibility="hidden")


script_of = {title: script for _, script, title, _, _ in PAGE_TABLE}
sections: dict[str, list[st.Page]] = {}
by_script: dict[str, st.Page] = {}
for section, script, title, icon, needed in PAGE_TABLE:
    page = st.Page(PAGES / f"{script}.py", title=title, icon=icon, default=script == "overview") \
        if allowed(needed) else forbidden(title, needed)
    sections.setdefault(section, []).append(page)
    by_script[script] = page
for path, script in ALIASES.items():
    target = by_script[script]
    sections[next(s for s, sc, *_ in PAGE_TABLE if sc == script)].append(alias(path, target))
st.session_state[PAGE_LINKS] = by_script  # for links between pages (console/widgets.py open_link)
nav = st.navigation(sections)
drafts.arrive(nav.url_path)  # a page kept in drafts restores its fields when it is arrived at
with st.sidebar:
    switcher()  # the deployment every page acts on, carried in the address (?deployment=)
    st.caption(f"Signed in as **{me.name}** ({role})")
    if st.context.cookies.get(COOKIE):  # signed in at the console's server: it ends the session (console/server.py)
        sign_out_form()
    elif st.button("Sign out", icon=":material/logout:"):  # signed in here (single sign-on): end it here
        with contextlib.suppress(ClientError):  # already expired or revoked, or the engine is down
            client().logout()
        sign_out()
        st.rerun()
nav.run()
