"""A page's draft (its fields, filters and the playground's conversation), kept per signed-in browser session on
the console's server, so that leaving the page and coming back, or a reload (F5), finds it as it was.

Streamlit forgets the state of a page's widgets when another page is shown, and a reload starts a new session with
none at all. The console's server process outlives both, and the sign-in cookie is the same after a reload: the
drafts live here, keyed by a digest of the session token (never the token itself), until the session signs out,
the console restarts, or the store is full and this session is the one least recently used. Bounded: at most
MAX_SESSIONS sessions, each at most MAX_SESSION_CHARS of draft (a field that would pass it is not kept).
"""

from __future__ import annotations

import functools
import hashlib
import json
import logging
import threading
from collections import OrderedDict
from collections.abc import Iterable
from typing import Any

import streamlit as st
from streamlit.runtime.scriptrunner import get_script_run_ctx
from streamlit.runtime.state.common import is_keyed_element_id, user_key_from_element_id

log = logging.getLogger("llmops.console")
MAX_SESSIONS = 200
MAX_SESSION_CHARS = 2_000_000


def _size(value: Any) -> int:
    return len(json.dumps(value, default=repr))


class Drafts:
    """Drafts per session and page; safe to use from Streamlit's script threads at once."""

    def __init__(self, max_sessions: int = MAX_SESSIONS, max_chars: int = MAX_SESSION_CHARS) -> None:
        self.max_sessions = max_sessions
        self.max_chars = max_chars
        self._by_session: OrderedDict[str, dict[str, dict[str, Any]]] = OrderedDict()
        self._lock = threading.Lock()

    def get(self, session: str, page: str) -> dict[str, Any]:
        with self._lock:
            pages = self._by_session.get(session)
            if pages is None:
                return {}
            self._by_session.move_to_end(session)
            return dict(pages.get(page, {}))

    def put(self, session: str, page: str, values: dict[str, Any]) -> None:
        """Keep ``values`` as the page's draft; a field that would take the session past its bound keeps its
        earlier value (or none)."""
        with self._lock:
            pages = self._by_session.setdefault(session, {})
            self._by_session.move_to_end(session)
            before = pages.get(page, {})
            others = sum(_size(v) for p, d in pages.items() if p != page for v in d.values())
            kept: dict[str, Any] = {}
            used = others
            for key, value in values.items():
                size = _size(value)
                if used + size > self.max_chars:
                    if key in before:
                        kept[key] = before[key]
                        used += _size(before[key])
                    continue
                kept[key] = value
                used += size
            pages[page] = kept
            while len(self._by_session) > self.max_sessions:
                self._by_session.popitem(last=False)

    def forget(self, session: str) -> None:
        with self._lock:
            self._by_session.pop(session, None)


STORE = Drafts()
ARRIVED = "_arrived"  # True from the arrival on a page (console/app.py) until a run of it has ended (settle)


def arrive(page: str) -> None:
    """Called by the console's frame on every run, with the page about to run: notes an arrival on it."""
    if st.session_state.get("_page") != page:
        st.session_state[ARRIVED] = True
    st.session_state["_page"] = page


def settle() -> None:
    """At the end of a kept page: its fields are drawn from the draft; from now on they are the user's. A run cut
    short (a click while the page was still being drawn after a reload) leaves the arrival standing, and the next
    run restores again, but for the field that click changed (``keep``)."""
    st.session_state[ARRIVED] = False


def session_key(token: str | None = None) -> str | None:
    """A browser session's key in the store: a digest of its sign-in token (this session's when none is given;
    None before the sign-in)."""
    value = token if token is not None else st.session_state.get("token")
    return hashlib.sha256(value.encode()).hexdigest() if isinstance(value, str) and value else None


def _sent_by_browser() -> dict[str, str]:
    """The widgets whose values came with this run's request, key to element id (at the top of a page: nothing of
    this run is drawn yet, so the widget states are the browser's)."""
    ctx = get_script_run_ctx()
    if ctx is None:
        return {}
    return {key: w.id for w in ctx.session_state.get_widget_states()
            if is_keyed_element_id(w.id) and (key := user_key_from_element_id(w.id)) is not None}


@functools.cache
def _warn_no_widget_changed() -> None:
    log.warning("this Streamlit has no SessionState._widget_changed: a click during a page's first run after "
                "arriving on it may be undone by its draft")


def _edited_now(keys: list[str], sent: dict[str, str]) -> set[str]:
    """Of ``keys``, those this run's request changes: a widget's value the user changed (of those ``sent``;
    Streamlit's own test for on_change, against the values of the run before), or a value a callback set (a Load
    button's)."""
    ctx = get_script_run_ctx()
    if ctx is None:
        return set()
    try:  # Streamlit's internals (1.67): SafeSessionState's SessionState, and its test for on_change
        changed_since = ctx.session_state._state._widget_changed
    except AttributeError:  # another Streamlit: the draft is restored over such a click, as before
        _warn_no_widget_changed()
        changed_since = None
    return {key for key in keys if (changed_since is not None and key in sent and changed_since(sent[key]))
            or ctx.session_state.is_new_state_value(key)}


def keep(page: str, keys: Iterable[str], defaults: dict[str, Any] | None = None, *,
         per_deployment: bool = True) -> None:
    """At the top of a page, before its widgets: put back the fields Streamlit dropped (a page switch, a reload)
    from the page's draft, give the ones still missing their ``defaults``, then record the fields as they are now.
    Widgets of kept keys take their value from Session State only (no ``value=``, ``index=`` or ``default=``
    argument: the first value comes from ``defaults``). ``per_deployment``: a draft for each deployment the
    switcher picks (console/deployment.py), so that one deployment's fields never show on another's page."""
    keys = list(keys)
    if per_deployment:
        from console.widgets import chosen  # here: console.widgets imports this module

        name = chosen().name
        page = f"{page}@{name}" if name else page
    session = session_key()
    draft = STORE.get(session, page) if session is not None else {}
    # Arriving from another page, a field's value in Session State may be stale: one first set through Session
    # State before its widget existed lingers under its key after the widget is gone, with that first value.
    # Until the page has been drawn whole once (settle), the draft wins.
    arrived = bool(st.session_state.get(ARRIVED))
    base = page.split("@", 1)[0]
    switched = st.session_state.get(f"_draft_of_{base}", page) != page  # another deployment on the same page
    st.session_state[f"_draft_of_{base}"] = page
    # A field the user or a callback changed in this very request (a click while the page was still drawn after
    # the arrival) is theirs, not the draft's: restored, the click was undone (compare switched on, and back off;
    # a prompt loaded, and the one typed before back).
    sent = _sent_by_browser()
    edited = _edited_now(keys, sent) if arrived else set()
    for key in keys:
        if key in draft and ((arrived and key not in edited) or switched or key not in st.session_state):
            st.session_state[key] = draft[key]
        elif switched:  # the other deployment's value is not this one's: its default, or none
            st.session_state.pop(key, None)
    for key, value in (defaults or {}).items():
        st.session_state.setdefault(key, value)
    # A field the browser sent no value of this run is one it does not show with its value: the delta that drew it
    # may never have reached the browser. A run that starts drops what the last one had queued and not yet sent
    # (Streamlit's AppSession clears the browser queue on SCRIPT_STARTED), so a run cut short by the next click, or
    # one that ended just before it, can leave fields undrawn although they are in Session State; drawn again
    # without being told their value, they show their own first value (a number_input its min, a toggle off) and
    # the browser sends that back with the next click. Set through Session State, the widget carries the value.
    for key in keys:
        if key not in sent and key in st.session_state:
            st.session_state[key] = st.session_state[key]
    if session is not None:
        STORE.put(session, page, {k: st.session_state[k] for k in keys if k in st.session_state})


def forget(token: str | None = None) -> None:
    """Drop the drafts of this session, or of the session of ``token`` (at sign-out: the next user of the browser
    starts from nothing)."""
    session = session_key(token)
    if session is not None:
        STORE.forget(session)
