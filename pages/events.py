"""Events & logs: what the engine did and why (settings changes, restarts, rollbacks, alerts, diagnoses), live,
and vLLM's own log with level and text filters, following as it grows."""

from __future__ import annotations

import time

import streamlit as st

from console import fmt
from console.client import ClientError
from console.widgets import client, unreachable

st.title("Events & logs")
GROUPS = {
    "Settings changes": ["settings_changed"],
    "Restarts": ["start_requested", "stop_requested", "restart_requested", "starting", "ready", "drained", "stopped",
                 "restart_scheduled", "engine_started", "engine_stopped", "stray_killed", "demo_model_building",
                 "demo_model_built", "demo_model_failed"],
    "Rollbacks": ["rollback", "crash_loop"],
    "Failures & diagnoses": ["failed", "diagnosis", "model_missing"],
    "Alerts": ["alert_raised", "alert_cleared", "gpu_driver_error"],
    "Benchmarks": ["benchmark_started", "benchmark_finished"],
}
c1, c2, c3 = st.columns([3, 2, 2])
groups = c1.multiselect("Show", list(GROUPS), default=list(GROUPS), key="ev_groups")
severities = c2.multiselect("Severity", ["info", "warning", "error", "critical"],
                            default=["info", "warning", "error", "critical"], key="ev_severity")
text = c3.text_input("Contains", key="ev_text", placeholder="e.g. max_num_seqs")
kinds = [k for g in groups for k in GROUPS[g]]


@st.fragment(run_every=2)
def timeline() -> None:
    try:
        events = client().events(kinds=kinds, limit=500, newest_first=True) if kinds else []
    except ClientError as exc:
        unreachable(exc)
    rows = [{"time": fmt.clock(e.ts), "kind": e.kind, "severity": e.severity, "revision": e.revision,
             "message": e.message} for e in events
            if e.severity in severities and (not text or text.lower() in e.message.lower())]
    st.caption(f"{len(rows)} events, newest first · live")
    st.dataframe(rows, hide_index=True, width="stretch",
                 column_config={"time": st.column_config.TextColumn(width="medium"),
                                "message": st.column_config.TextColumn(width="large")})


timeline()

st.subheader("vLLM's log")
c1, c2, c3, c4, c5 = st.columns([2, 2, 3, 2, 2], vertical_alignment="bottom")
level = c1.selectbox("Level", ["debug", "info", "warning", "error"], index=0, key="log_level",
                     format_func=lambda v: {"debug": "everything", "info": "info and up", "warning": "warnings and up",
                                            "error": "errors only"}[v])
tail = c2.number_input("Last lines", 20, 5000, 200, step=100, key="log_tail")
contains = c3.text_input("Text", key="log_text", placeholder="e.g. KV cache")
hide_polling = c4.toggle("Hide polling", value=True, key="log_hide_polling",
                         help="leave out the /health and /metrics requests the engine itself makes")
follow = c5.toggle("Follow", value=True, key="log_follow", help="show new lines as vLLM writes them")


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
