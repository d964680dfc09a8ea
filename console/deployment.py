"""The deployment the console's pages act on: chosen in the sidebar's switcher and carried in the address as
``?deployment=<name>``, so a deep link, a reload and a return from another page keep it.

The default deployment (the one today's /api routes act on) needs no parameter: a single-model console looks and
behaves as it always did. A name the engine does not know is said to be unknown, once per page, and the pages
act on the default deployment instead (never a traceback). The choice is resolved once per change of the address
(and again every few seconds, so a deployment deleted meanwhile falls back too), not on every call.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import streamlit as st

from engine.client import ClientError, EngineClient
from engine.schemas import DeploymentOut

PARAM = "deployment"  # the address's parameter
CHOSEN = "_deployment"  # Session State: the name chosen (absent: the default), put back where a page switch cleared it
RESOLVED = "_deployment_resolved"
FRESH_S = 5.0  # how long a resolution is trusted before the list is read again


@dataclass(frozen=True)
class Choice:
    """What the address asks for and what the pages act on."""

    asked: str | None  # the ?deployment= value (None: none given)
    name: str | None  # the deployment acted on: None is the default one
    default_name: str  # the default deployment's name
    unknown: str | None  # a name asked for that the engine does not know
    at: float
    rows: tuple[DeploymentOut, ...] = ()  # the deployments as they were read then

    @property
    def shown(self) -> str:
        return self.name or self.default_name


def listed(base: EngineClient) -> list[DeploymentOut]:
    """The engine's deployments (an empty list when it cannot be asked: the page says why where it calls it)."""
    try:
        return base.deployments()
    except ClientError:
        return []


def _asked() -> str | None:
    """The address's ?deployment=, or the one chosen earlier in this session when a page switch dropped it (it is
    put back in the address, so that a reload keeps it)."""
    value = st.query_params.get(PARAM)
    if value:
        return value[:200]
    kept = st.session_state.get(CHOSEN)
    if isinstance(kept, str) and kept:
        st.query_params[PARAM] = kept
        return kept
    return None


def resolve(base: EngineClient) -> Choice:
    """The deployment this run acts on (cached in Session State until the address changes, or FRESH_S passes)."""
    asked = _asked()
    cached = st.session_state.get(RESOLVED)
    if isinstance(cached, Choice) and cached.asked == asked and time.monotonic() - cached.at < FRESH_S:
        return cached
    rows = listed(base)
    default = next((r.name for r in rows if r.default), "demo")
    name: str | None = None
    unknown: str | None = None
    if asked is not None:
        row = next((r for r in rows if r.name == asked), None)
        if row is None and rows:  # no list (the engine is down): the page says so itself
            unknown = asked
            st.session_state.pop(CHOSEN, None)
        elif row is not None and not row.default:
            name = row.name
            st.session_state[CHOSEN] = row.name
        else:
            st.session_state.pop(CHOSEN, None)
    choice = Choice(asked=asked, name=name, default_name=default, unknown=unknown, at=time.monotonic(),
                    rows=tuple(rows))
    st.session_state[RESOLVED] = choice
    return choice


def choose(name: str | None) -> None:
    """Act on ``name`` from now on (None or the default's name: the default, and no parameter in the address)."""
    cached = st.session_state.get(RESOLVED)
    default = cached.default_name if isinstance(cached, Choice) else None
    if name is None or name == default:
        st.session_state.pop(CHOSEN, None)
        st.query_params.pop(PARAM, None)
    else:
        st.session_state[CHOSEN] = name
        st.query_params[PARAM] = name
    st.session_state.pop(RESOLVED, None)


def scope() -> str:
    """A suffix for what is kept per deployment (drafts, a form's widget keys): '' for the default one."""
    cached = st.session_state.get(RESOLVED)
    return f"@{cached.name}" if isinstance(cached, Choice) and cached.name else ""
