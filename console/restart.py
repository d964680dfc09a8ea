"""A vLLM restart as a person watches it: the phases of the start as they happen, with elapsed times and the ETA
from this engine's earlier starts, and the events around it (drained, stopped, failed, rolled back)."""

from __future__ import annotations

import time
from typing import Any

import streamlit as st

from console import fmt
from console.widgets import client
from engine.schemas import EventOut, StartupView, StatusOut

PROGRESS_KINDS = ["settings_changed", "drained", "stopped", "starting", "ready", "failed", "diagnosis", "rollback",
                  "restart_scheduled", "crash_loop", "model_missing", "demo_model_building", "demo_model_built"]
EVENT_ICON = {"ready": ":material/check_circle:", "failed": ":material/error:", "rollback": ":material/undo:",
              "diagnosis": ":material/troubleshoot:", "crash_loop": ":material/dangerous:"}


def phases(view: StartupView) -> None:
    """The start's phases, one line each: done (with its time), running now (with its time so far), ETA."""
    for phase in view.phases:
        icon = ":material/check:" if phase.done else ":material/progress_activity:"
        st.markdown(f"{icon} **{phase.title}** · +{phase.started_s:.0f} s · {fmt.seconds(phase.seconds)}"
                    + ("" if phase.done else " so far"))
    if view.ready_s is not None:
        error = f", expected {fmt.seconds(view.eta_s)}: off by {view.error_s:+.0f} s" if view.eta_s is not None \
            and view.error_s is not None else ""
        st.caption(f"Ready after {fmt.seconds(view.ready_s)}{error}.")
    elif view.failed:
        st.caption(f"The start failed after {fmt.seconds(view.elapsed_s)}: {view.failed}")
    elif view.eta_s is not None:
        left = f"; about {fmt.seconds(view.remaining_s)} left" if view.remaining_s is not None else ""
        st.caption(f"{fmt.seconds(view.elapsed_s)} so far; expected {view.eta_basis}{left}.")
    else:
        st.caption(f"{fmt.seconds(view.elapsed_s)} so far; no earlier start of this engine to estimate from.")


def timeline(events: list[EventOut], t0: float) -> list[str]:
    return [f"+{max(0.0, e.ts.timestamp() - t0):.0f} s **{e.kind}** {e.message}" for e in events]


def watch(revision: int, what: str) -> None:
    """Follow the restart that applies ``revision`` (an apply or a rollback): its events from now on, timed from
    now; the page reruns to show it."""
    marker = client().events(limit=1, newest_first=True)
    st.session_state["applying"] = {"revision": revision, "since": marker[0].id if marker else 0,
                                    "t0": time.time(), "what": what}
    st.session_state.pop("apply_outcome", None)
    st.rerun()


def outcome(applying: dict[str, Any], now: StatusOut, events: list[EventOut]) -> tuple[str, str] | None:
    """How an apply ended, once it has: ("success" | "error", message); None while it goes on."""
    rev_id = applying["revision"]
    view = now.startup
    if now.state == "ready" and now.running_revision == rev_id:
        took = time.time() - applying["t0"]
        eta = ""
        if view is not None and view.revision == rev_id and view.ready_s is not None and view.eta_s is not None:
            eta = f" vLLM's start took {fmt.seconds(view.ready_s)} against {fmt.seconds(view.eta_s)} expected " \
                  f"({view.error_s:+.0f} s)." if view.error_s is not None else ""
        return "success", f"Revision {rev_id} is ready after {took:.0f} s.{eta}"
    rolled_back = any(e.kind == "rollback" and e.revision == rev_id for e in events)
    if rolled_back and now.state == "ready":
        diagnosis = next((e for e in events if e.kind == "diagnosis" and e.revision == rev_id), None)
        return "error", (f"Revision {rev_id} did not start and was rolled back to revision {now.running_revision}."
                         + (f"  \n**{diagnosis.data.get('kind')}**: {diagnosis.data.get('explanation')}  \nFix: "
                            f"{diagnosis.data.get('fix')}" if diagnosis else ""))
    if now.halted:
        return "error", f"Restarts are halted: {now.halted}"
    return None


@st.fragment(run_every=1)
def progress() -> None:
    """While this session applies a revision (or vLLM is starting for any reason): the start, live."""
    applying = st.session_state.get("applying")
    now = client().status()
    if not applying:
        if now.state in ("starting", "draining", "stopping") and now.startup is not None:
            st.subheader(f"vLLM is {now.state}")
            st.info(now.reason, icon=":material/autorenew:")
            if now.state == "starting":
                phases(now.startup)
        return
    events = client().events(since=applying["since"], kinds=PROGRESS_KINDS, limit=200)
    st.subheader(f"{applying.get('what', 'Applying')} revision {applying['revision']}")
    lines = timeline(events, applying["t0"])
    for ev, line in zip(events, lines, strict=True):
        st.markdown(f"{EVENT_ICON.get(ev.kind, ':material/arrow_right:')} {line}")
    if now.startup is not None and now.state == "starting":
        with st.container(border=True):
            st.markdown(f"**Starting revision {now.startup.revision}**")
            phases(now.startup)
    ended = outcome(applying, now, events)
    if ended is None:
        if now.state != "starting":
            st.info(f"vLLM is {now.state}: {now.reason}", icon=":material/autorenew:")
        return
    st.session_state.pop("applying")
    view = now.startup if now.startup is not None and now.startup.revision == applying["revision"] else None
    st.session_state["apply_outcome"] = (*ended, lines, view)
    st.session_state["clear_note"] = True
    st.rerun(scope="app")  # the whole page: state banner, form and history follow the new revision


def last_outcome() -> None:
    """How the latest apply of this session ended, with its timeline and the start's phases."""
    ended = st.session_state.get("apply_outcome")
    if not ended:
        return
    kind, message, lines, view = ended
    (st.success if kind == "success" else st.error)(message, icon=":material/check:" if kind == "success"
                                                     else ":material/undo:")
    with st.expander("Timeline of the restart"):
        st.markdown("\n".join(f"- {line}" for line in lines))
        if view is not None:
            phases(view)
