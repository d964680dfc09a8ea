"""Events & logs: what the engine did and why (settings changes, applies and restarts, rollbacks, alerts,
diagnoses), live, with every message in full, and vLLM's own log filtered by what its lines mean (a failure, or the
shutdown of a planned stop), following as it grows. The filters are kept across pages and reloads."""

from __future__ import annotations

import time

import streamlit as st

from console import drafts, fmt
from console.widgets import SEVERITY_ICON, client, deployment_header, unreachable
from engine.client import ClientError
from engine.schemas import EventOut

st.title("Events & logs")
deployment_header("its events and its vLLM log")
GROUPS = {
    "Settings changes": ["settings_changed"],
    "Applies & restarts": ["apply_plan", "apply_done", "start_requested", "stop_requested", "restart_requested",
                           "starting", "ready", "drained", "stopped", "restart_scheduled", "engine_started",
                           "engine_stopped", "stray_killed", "sleeping", "woken", "demo_model_building",
                           "demo_model_built", "demo_model_failed"],
    "Rollbacks": ["rollback", "rejected", "crash_loop"],
    "Failures & diagnoses": ["failed", "diagnosis", "model_missing", "instance_failed", "replica_failed",
                             "bridge_failed", "sleep_failed"],
    "Alerts": ["alert_raised", "alert_cleared", "gpu_driver_error", "gpu_lost", "ray_unauthenticated"],
    "Benchmarks": ["benchmark_started", "benchmark_finished"],
    "Other": [],  # any kind not listed above: a new kind is shown, never filtered away unseen
}
SEVERITIES = ["info", "warning", "error", "critical"]
LOG_LEVELS = {"debug": "everything", "info": "info and up", "warning": "warnings and up",
              "error": "failures only"}
drafts.keep("events", ["ev_groups", "ev_severity", "ev_text", "ev_limit", "log_level", "log_tail", "log_text",
                       "log_hide_polling", "log_follow"],
            {"ev_groups": list(GROUPS), "ev_severity": SEVERITIES, "ev_limit": 200, "log_level": "debug",
             "log_tail": 200, "log_hide_polling": True, "log_follow": True})
c1, c2, c3, c4 = st.columns([3, 2, 2, 1])
groups = c1.multiselect("Show", list(GROUPS), key="ev_groups")
severities = c2.multiselect("Severity", SEVERITIES, key="ev_severity")
text = c3.text_input("Contains", key="ev_text", placeholder="e.g. max_num_seqs")
limit = c4.selectbox("Newest", [50, 200, 1000], key="ev_limit")
kinds = [k for g in groups for k in GROUPS[g]]


def group_of(kind: str) -> str:
    return next((g for g, ks in GROUPS.items() if kind in ks), "Other")


def cell(value: object) -> str:
    """A value as one cell of a markdown table: its text whole (it wraps), nothing in it read as markup."""
    out = " ".join(str(value).split())
    for ch in "\\`*_[]<>|#~":
        out = out.replace(ch, "\\" + ch)
    return out


def table(events: list[EventOut]) -> str:
    rows = [f"| {SEVERITY_ICON.get(e.severity, ':material/info:')} {e.severity} | {fmt.clock(e.ts)} | "
            f"**{cell(e.kind)}** | {e.revision or ''} | {cell(e.message)} |" for e in events]
    return "\n".join(["| severity | time | kind | revision | message |", "| --- | --- | --- | --- | --- |", *rows])


@st.fragment(run_every=2)
def timeline() -> None:
    try:  # "Other" holds kinds no group lists: those are found among all events
        events = client().events(kinds=None if "Other" in groups else kinds, limit=int(limit),
                                 newest_first=True) if groups else []
    except ClientError as exc:
        unreachable(exc)
    shown = [e for e in events if group_of(e.kind) in groups and e.severity in severities
             and (not text or text.lower() in e.message.lower() or text.lower() in e.kind)]
    st.caption(f"{len(shown)} events, newest first · live")
    if shown:
        with st.container(height=520):
            st.markdown(table(shown))
    else:
        st.caption("No events match the filters.")


timeline()

st.subheader("vLLM's log")
st.caption("The leak reports each stopping vLLM prints are folded into one line; the download has every line.")
c1, c2, c3, c4, c5 = st.columns([2, 2, 3, 2, 2], vertical_alignment="bottom")
level = c1.selectbox("Level", list(LOG_LEVELS), key="log_level", format_func=LOG_LEVELS.__getitem__,
                     help="by what a line means: a failure is a start or a crash that went wrong (a traceback, an "
                     "exception, an ERROR), tagged or not; what an instance prints while the engine stops it on "
                     "purpose (a planned swap) is information, whatever vLLM tags it")
tail = c2.number_input("Last lines", 20, 5000, step=100, key="log_tail")
contains = c3.text_input("Text", key="log_text", placeholder="e.g. KV cache")
hide_polling = c4.toggle("Hide polling", key="log_hide_polling",
                         help="leave out the /health and /metrics requests the engine itself makes")
follow = c5.toggle("Follow", key="log_follow", help="show new lines as vLLM writes them")


@st.fragment(run_every=2 if follow else None)
def log_tail() -> None:
    try:
        lines = client().logs(int(tail), hide_polling=hide_polling, level=level, contains=contains or None)
    except ClientError as exc:
        unreachable(exc)
    st.code("\n".join(lines) or "(no lines match)", language=None, height=480)
    if follow:  # keep the newest line in view, as `tail -f` does (the comment makes each render a new script)
        st.html(f"<script>/* {time.time()} */ for (const c of document.querySelectorAll("
                "'[data-testid=\"stCode\"] pre')) c.scrollTop = c.scrollHeight;</script>", unsafe_allow_javascript=True)


log_tail()
engine = client()  # the download is read when clicked (on another thread), not on every rerun
st.download_button("Download the log", lambda: engine.logs_download(), file_name="vllm.log", mime="text/plain",
                   icon=":material/download:")
drafts.settle()  # drawn whole from the draft: from now on the fields are the user's
