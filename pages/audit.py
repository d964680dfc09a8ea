"""Audit: who changed what, when, from where, and what happened next (append-only; CSV and JSON export). Each
record reads as a sentence; sign-ins and sign-outs are counted apart unless asked for."""

from __future__ import annotations

from datetime import UTC, date, datetime, timedelta
from typing import Any

import streamlit as st

from console import drafts, fmt
from console.widgets import client, unreachable
from engine.client import ClientError, NotFoundError
from engine.schemas import AuditOut, EventOut

st.title("Audit")
st.caption("Every mutating action: settings writes and rollbacks, restarts, users, tokens, benchmarks, sign-ins, "
           "and the engine's own automatic rollbacks. Nobody can edit or delete it.")
SIGN_INS = ("auth.login", "auth.logout", "auth.sso")
VERBS = {"engine.start": "asked to start vLLM", "engine.stop": "asked to stop vLLM",
         "engine.restart": "asked to restart vLLM", "prompts.save": "saved a prompt",
         "prompts.delete": "deleted saved prompt", "benchmarks.sweep": "started a benchmark sweep",
         "benchmarks.search": "started a guided search", "benchmarks.cancel": "cancelled benchmark",
         "users.delete": "deleted"}


def _changes(r: AuditOut) -> str:
    before, after = r.before or {}, r.after or {}
    parts = [f"{k} {before.get(k)} → {v}" if k in before else f"{k} {v}" for k, v in after.items()
             if before.get(k) != v]
    return ", ".join(parts)


def sentence(r: AuditOut) -> str:
    """An audit record as a sentence: "admin created user ops-1 (operator)", "revision 4: max_num_seqs 16 → 8"."""
    actor, action, target, status = r.actor, r.action, r.target or "", int(r.result or 0)
    after = r.after or {}
    name = target.removeprefix("user ").removeprefix("token ")
    if action == "auth.login":
        return {200: f"{actor} signed in", 423: f"sign-in as {actor} refused: locked out"}.get(
            status, f"failed sign-in as {actor}")
    if action == "auth.logout":
        return f"{actor} signed out"
    if action == "auth.sso":
        return f"{name} signed in through single sign-on"
    if action == "users.create":
        text = f"{actor} created user {name}" + (f" ({after['role']})" if after.get("role") else "")
    elif action == "users.update":
        changed = _changes(r)
        if after.get("password_changed"):
            changed = ", ".join(x for x in (changed.replace("password_changed True", "").strip(", "),
                                            "a new password") if x)
        text = f"{actor} changed user {name}: {changed or 'nothing'}"
    elif action == "tokens.create":
        text = f"{actor} created token {name}" + (f" ({after.get('role')}, {after.get('kind')})" if after else "")
    elif action == "tokens.revoke":
        text = f"{actor} revoked token {name}"
    elif action in ("settings.write", "settings.rollback"):
        verb = "wrote" if action == "settings.write" else "rolled back, writing"
        text = f"{actor} {verb} {target}" + (f": {_changes(r)}" if _changes(r) else "")
    elif action == "settings.auto_rollback":
        text = f"the engine rolled {target} back to revision {after.get('revision')}"
    elif action == "engine.halt":
        text = f"the engine halted restarts ({target})"
    else:
        text = f"{actor} {VERBS.get(action, action)}" + (f" {target}" if target else "")
    return text + (f" — refused ({status})" if status >= 400 else "")


drafts.keep("audit", ["au_actor", "au_action", "au_day", "au_text"],  # the filters, kept across pages and reloads
            per_deployment=False)
c1, c2, c3, c4, c5 = st.columns([2, 2, 2, 3, 2], vertical_alignment="bottom")
actor = c1.text_input("Actor", key="au_actor") or None
action = c2.selectbox("Action", ["all", "settings", "engine", "benchmarks", "users", "tokens", "prompts", "auth"],
                      key="au_action")
day = c3.date_input("Day (UTC)", value=None, key="au_day")
contains = c4.text_input("Changed field or text", key="au_text", placeholder="e.g. max_num_seqs") or None
show_sign_ins = c5.toggle("Sign-ins", value=action == "auth", key="au_sign_ins",
                          help="show sign-ins and sign-outs (counted apart otherwise)")
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
sign_ins = [r for r in rows if r.action in SIGN_INS]
shown = rows if show_sign_ins else [r for r in rows if r.action not in SIGN_INS]
failed = sum(1 for r in sign_ins if r.action == "auth.login" and (r.result or 0) >= 400)
if sign_ins and not show_sign_ins:
    st.caption(f"{len(sign_ins)} sign-ins and sign-outs in this selection ({failed} failed) are not listed: turn on "
               "*Sign-ins* to see them.")
st.dataframe([{"time": fmt.clock(r.ts), "what": sentence(r), "actor": r.actor, "role": r.role or "—",
               "action": r.action, "deployment": r.deployment or "—",
               "result": str(r.result) if r.result else "—", "from": r.source or "—",
               "detail": r.detail} for r in shown],
             hide_index=True, width="stretch",
             column_config={"what": st.column_config.TextColumn(width="large"),
                            "time": st.column_config.TextColumn(width="medium")})
c1, c2, _ = st.columns([1, 1, 4])
engine = client()  # the exports are fetched when clicked (on another thread), not on every rerun
c1.download_button("Export CSV", lambda: engine.audit_export("csv", **filters), file_name="audit.csv",
                   mime="text/csv")
c2.download_button("Export JSON", lambda: engine.audit_export("json", **filters), file_name="audit.json",
                   mime="application/json")

with st.expander("Refused requests without a valid credential (counted, not listed one by one)"):
    try:
        counted = client().audit_tallies(since=since, until=until, limit=500)
    except ClientError as exc:
        unreachable(exc)
    st.caption(f"{sum(t.count for t in counted):,} refused in this selection (failed sign-ins, calls without a "
               "token or with a bad one, unknown routes), per minute and source." if counted else
               "None in this selection.")
    if counted:
        st.dataframe([{"minute": fmt.clock(t.minute), "from": t.source, "action": t.action, "target": t.target,
                       "result": t.result, "count": t.count} for t in counted], hide_index=True, width="stretch")

st.subheader("What happened next")
writes = [r for r in rows if r.action in ("settings.write", "settings.rollback") and r.target]
if not writes:
    st.caption("No settings change in this selection.")
events_of: dict[str | None, list[EventOut]] = {}  # per deployment: a revision is (deployment, number)


def events_for(deployment: str | None) -> list[EventOut]:
    """The deployment's newest events, in time order (the oldest 200 of a long-lived engine say nothing of recent
    writes); fetched once per deployment."""
    if deployment not in events_of:
        events_of[deployment] = sorted(client().of(deployment).events(limit=1000, newest_first=True),
                                       key=lambda e: e.ts)
    return events_of[deployment]


for r in writes[:10]:
    revision = int(r.target.split()[-1])
    where = f" of {r.deployment}" if r.deployment else ""
    with st.expander(f"{fmt.clock(r.ts)} · {r.actor} · {r.action} → revision {revision}{where}"):
        try:
            rev = client().of(r.deployment).revision(revision)
            events = events_for(r.deployment)
        except NotFoundError as exc:  # deleted since: its revisions and events went with it
            gone = f"deployment {r.deployment}" if r.deployment else "the deployment"
            st.caption(f"Not there any more ({exc}): {gone} or this revision has been deleted since.")
            continue
        except ClientError as exc:
            st.caption(str(exc))
            continue
        st.markdown(f"Revision **{revision}** is now **{rev.status}**"
                    + (f": {rev.status_reason}" if rev.status_reason else "")
                    + (f" · {rev.oom_count} OOM failure(s)" if rev.oom_count else ""))
        later = [e for e in events if e.revision == revision and e.ts.timestamp() >= r.ts - 1]
        for e in later[:15]:
            st.markdown(f"- `{e.ts:%H:%M:%S}` **{e.kind}** {e.message}")
drafts.settle()  # drawn whole from the draft: from now on the fields are the user's
