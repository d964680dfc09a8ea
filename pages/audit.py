"""Audit: who changed what, when, from where, and what happened next (append-only; CSV and JSON export)."""

from __future__ import annotations

from datetime import UTC, date, datetime, timedelta
from typing import Any

import streamlit as st

from console import fmt
from console.client import ClientError
from console.widgets import client, unreachable

st.title("Audit")
st.caption("Every mutating action: settings writes and rollbacks, restarts, users, tokens, benchmarks, sign-ins, "
           "and the engine's own automatic rollbacks. Nobody can edit or delete it.")
c1, c2, c3, c4 = st.columns(4)
actor = c1.text_input("Actor", key="au_actor") or None
action = c2.selectbox("Action", ["all", "settings", "engine", "benchmarks", "users", "tokens", "prompts", "auth"],
                      key="au_action")
day = c3.date_input("Day (UTC)", value=None, key="au_day")
contains = c4.text_input("Changed field or text", key="au_text", placeholder="e.g. max_num_seqs") or None
since = until = None
if isinstance(day, date):
    start = datetime(day.year, day.month, day.day, tzinfo=UTC)
    since, until = start.timestamp(), (start + timedelta(days=1)).timestamp()
filters: dict[str, Any] = {"actor": actor, "action": None if action == "all" else action, "since": since,
                           "until": until, "contains": contains}
try:
    rows = client().audit(**filters, limit=500)
except ClientError as exc:
    unreachable(exc)

st.dataframe([{"time": fmt.clock(r["ts"]), "actor": r["actor"], "role": r["role"], "action": r["action"],
               "target": r["target"], "change": ", ".join(f"{k}: {(r['before'] or {}).get(k)} → {v}"
                                                          for k, v in (r["after"] or {}).items())[:200],
               "result": r["result"] or "—", "from": r["source"], "detail": r["detail"]} for r in rows],
             hide_index=True, width="stretch")
c1, c2, _ = st.columns([1, 1, 4])
engine = client()  # the exports are fetched when clicked (on another thread), not on every rerun
c1.download_button("Export CSV", lambda: engine.audit_export("csv", **filters), file_name="audit.csv",
                   mime="text/csv")
c2.download_button("Export JSON", lambda: engine.audit_export("json", **filters), file_name="audit.json",
                   mime="application/json")

st.subheader("What happened next")
writes = [r for r in rows if r["action"] in ("settings.write", "settings.rollback") and r["target"]]
if not writes:
    st.caption("No settings change in this selection.")
try:
    # the newest events, in time order (the oldest 200 of a long-lived engine say nothing of recent writes)
    events = sorted(client().events(limit=1000, newest_first=True), key=lambda e: e.ts) if writes else []
except ClientError as exc:
    unreachable(exc)
for r in writes[:10]:
    revision = int(r["target"].split()[-1])
    with st.expander(f"{fmt.clock(r['ts'])} · {r['actor']} · {r['action']} → revision {revision}"):
        try:
            rev = client().revision(revision)
        except ClientError as exc:
            st.caption(str(exc))
            continue
        st.markdown(f"Revision **{revision}** is now **{rev.status}**"
                    + (f": {rev.status_reason}" if rev.status_reason else "")
                    + (f" · {rev.oom_count} OOM failure(s)" if rev.oom_count else ""))
        later = [e for e in events if e.revision == revision and e.ts.timestamp() >= r["ts"] - 1]
        for e in later[:15]:
            st.markdown(f"- `{e.ts:%H:%M:%S}` **{e.kind}** {e.message}")
