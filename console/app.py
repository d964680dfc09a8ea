"""Entry of the Streamlit console: `streamlit run console/app.py` (or `llmops console`).

Nobody reaches a page anonymously: a sign-in against the engine comes first (local users, or single sign-on
through Streamlit's st.login where an identity provider is configured), and the pages shown follow the user's
role. Pages live in pages/ and reach the engine only through console/client.py.
"""

from __future__ import annotations

import contextlib
import os
import sys
from pathlib import Path
from typing import Any, NoReturn

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:  # streamlit puts console/ on the path, not the project root
    sys.path.insert(0, str(ROOT))

import streamlit as st  # noqa: E402

from console.client import ROLES, ApiError, ClientError, EngineClient  # noqa: E402
from console.widgets import client, sign_out  # noqa: E402

st.set_page_config(page_title="llmops console", page_icon=":material/memory:", layout="wide")
PAGES = ROOT / "pages"


def sso_configured() -> bool:
    try:
        return "auth" in st.secrets
    except (FileNotFoundError, KeyError):
        return False


def start_session(session: dict[str, Any]) -> NoReturn:
    """Keep the engine's session (token, user, role, expiry) in this browser session and open the console."""
    st.session_state.update({k: session[k] for k in ("token", "username", "role", "expires_at")})
    st.rerun()


def sign_in() -> None:
    st.title("Sign in")
    st.caption("llmops console: operations for a vLLM server. Ask an admin for an account.")
    with st.form("login"):
        username = st.text_input("User")
        password = st.text_input("Password", type="password")
        submitted = st.form_submit_button("Sign in", type="primary")
    if submitted:
        try:
            result = EngineClient(os.environ.get("LLMOPS_ENGINE_URL"), token="").login(username, password)
        except ApiError as exc:
            st.error("Locked out for a while after repeated failures." if exc.status == 423
                     else "Unknown user or wrong password." if exc.status == 401 else str(exc))
        except ClientError as exc:
            st.error(str(exc))
        else:
            start_session(result)
    if sso_configured():
        st.divider()
        if not st.user.is_logged_in:
            st.button("Sign in with single sign-on", on_click=st.login)
        else:
            service = os.environ.get("LLMOPS_CONSOLE_TOKEN")
            try:
                result = EngineClient(os.environ.get("LLMOPS_ENGINE_URL"), token=service or "").sso_session(
                    str(st.user.get("email") or st.user.get("preferred_username") or ""))
            except ClientError as exc:
                st.error(f"Signed in as {st.user.get('email')}, but the engine has no such user: {exc}")
            else:
                start_session(result)


if not st.session_state.get("token"):
    st.navigation([st.Page(sign_in, title="Sign in", icon=":material/lock:")]).run()
    st.stop()

role = st.session_state.get("role", "viewer")


def allowed(needed: str) -> bool:
    return ROLES.index(role) >= ROLES.index(needed)


sections: dict[str, list[st.Page]] = {
    "Operate": [st.Page(PAGES / "overview.py", title="Overview", icon=":material/dashboard:", default=True),
                st.Page(PAGES / "gpu_health.py", title="GPU health", icon=":material/memory:")]
                + ([st.Page(PAGES / "settings.py", title="Engine settings", icon=":material/tune:")]
                   if allowed("operator") else []),
    "Use": [st.Page(PAGES / "playground.py", title="Playground", icon=":material/chat:")]
    if allowed("prompter") else [],
    "Measure": [st.Page(PAGES / "metrics.py", title="Metrics", icon=":material/monitoring:")]
               + ([st.Page(PAGES / "benchmarks.py", title="Benchmarks", icon=":material/speed:")]
                  if allowed("operator") else []),
    "Investigate": [st.Page(PAGES / "events.py", title="Events & logs", icon=":material/history:")]
                   + ([st.Page(PAGES / "audit.py", title="Audit", icon=":material/policy:")]
                      if allowed("operator") else []),
    "Administer": [st.Page(PAGES / "access.py", title="Access", icon=":material/group:")]
    if allowed("admin") else [],
}
nav = st.navigation({name: pages for name, pages in sections.items() if pages})
with st.sidebar:
    st.caption(f"Signed in as **{st.session_state.get('username')}** ({role})")
    if st.button("Sign out", icon=":material/logout:"):
        with contextlib.suppress(ClientError):
            client().logout()
        sign_out()
        st.rerun()
nav.run()
