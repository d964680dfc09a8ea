"""Events & logs: what the engine did and why (settings changes, restarts, rollbacks, alerts, diagnoses), and
the tail of vLLM's own log."""

from __future__ import annotations

import streamlit as st

from console import fmt
from console.client import ClientError
from console.widgets import client, unreachable

st.title("Events & logs")
GROUPS = {
    "Settings changes": ["settings_changed"],
    "Restarts": ["start_requested", "stop_requested", "restart_requested", "starting", "ready", "drained", "stopped",
                 "restart_scheduled", "engine_started", "engine_stopped", "stray_killed"],
    "Rollbacks": ["rollback", "crash_loop"],
    "Failures & diagnoses": ["failed", "diagnosis"],
    "Alerts": ["alert_raised", "alert_cleared", "gpu_driver_error"],
    "Benchmarks": ["benchmark_started", "benchmark_finished"],
}
c1, c2, c3 = st.columns([3, 2, 2])
groups = c1.multiselect("Show", list(GROUPS), default=list(GROUPS), key="ev_groups")
severities = c2.multiselect("Severity", ["info", "warning", "error", "critical"],
                            default=["info", "warning", "error", "critical"], key="ev_severity")
text = c3.text_input("Contains", key="ev_text", placeholder="e.g. max_num_seqs")
kinds = [k for g in groups for k in GROUPS[g]]

try:
    events = client().events(kinds=kinds, limit=500, newest_first=True) if kinds else []
except ClientError as exc:
    unreachable(exc)
rows = [{"time": fmt.clock(e.ts), "kind": e.kind, "severity": e.severity, "revision": e.revision,
         "message": e.message} for e in events
        if e.severity in severities and (not text or text.lower() in e.message.lower())]
st.caption(f"{len(rows)} events, newest first")
st.dataframe(rows, hide_index=True, width="stretch",
             column_config={"message": st.column_config.TextColumn(width="large")})

st.subheader("vLLM's log")
tail = st.number_input("Last lines", 20, 5000, 200, step=100, key="log_tail")
try:
    lines = client().logs(int(tail))
except ClientError as exc:
    unreachable(exc)
st.code("\n".join(lines) or "(no output yet)", language=None)
