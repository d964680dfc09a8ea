"""Usage you can bill: tokens in and out per key, team, deployment and day, their cost by each deployment's price,
the budgets of teams and keys, and the export. Operators see every key's; anyone else their own and their team's."""

from __future__ import annotations

from datetime import UTC, datetime

import streamlit as st

from console import charts, drafts, usage
from console.widgets import client, me, unreachable
from engine.client import ROLES, ClientError

st.title("Usage")
drafts.keep("usage", ["usage_window", "usage_group"], {"usage_window": "30 days", "usage_group": "key"},
            per_deployment=False)  # (kept across pages and reloads; not one deployment's)
c1, c2 = st.columns([3, 2])
choice = c1.segmented_control("Window (UTC days)", usage.WINDOWS, key="usage_window") or "30 days"
group = c2.segmented_control("By", ["key", "team", "deployment", "model", "day"], key="usage_group") or "key"
today = datetime.now(UTC).date()
custom = None
if choice == "Custom":
    picked = st.date_input("From – to", (today.replace(day=1), today), max_value=today, key="usage_custom")
    if isinstance(picked, tuple) and len(picked) == 2:
        custom = (picked[0], picked[1])
first, last = usage.window(choice, today, custom)
try:
    grouped = client().usage(group, first.isoformat(), last.isoformat())
    daily = grouped if group == "day" else client().usage("day", first.isoformat(), last.isoformat())
except ClientError as exc:
    unreachable(exc)

role = me().role
st.caption(f"{first:%d %b %Y} – {last:%d %b %Y} (UTC). " + (
    "Every key's usage." if grouped.scope == "all" else
    "The usage of the keys you own and of your team's (operators see every key's)."))
total = grouped.total
m = st.columns(5)
m[0].metric("Requests", f"{total.requests:,}")
m[1].metric("Failed", f"{total.failed:,}", help="answered 4xx or 5xx (limits' 429 included), or cut")
m[2].metric("Prompt tokens", f"{total.input_tokens:,}")
m[3].metric("Completion tokens", f"{total.output_tokens:,}")
m[4].metric("Cost", f"{total.cost:,.2f}" if total.cost is not None else "—",
            help="by each deployment's price per 1,000 tokens (Deployments page); — where none is set")
left, right = st.columns(2)
left.plotly_chart(charts.usage_by_day(daily), width="stretch")
if group != "day":
    right.plotly_chart(charts.usage_shares(grouped), width="stretch")
st.dataframe(usage.table(grouped), hide_index=True, width="stretch")
with st.container(horizontal=True):
    try:
        csv = client().usage_csv(group, first.isoformat(), last.isoformat())
    except ClientError as exc:
        unreachable(exc)
    st.download_button("Download CSV", csv, file_name=f"usage-{group}-{first}-{last}.csv", mime="text/csv",
                       icon=":material/download:")
    st.download_button("Download JSON", grouped.model_dump_json(indent=1), icon=":material/download:",
                       file_name=f"usage-{group}-{first}-{last}.json", mime="application/json")

if ROLES.index(role) >= ROLES.index("operator"):
    st.subheader("Budgets")
    try:
        teams = client().teams()
        keys = client().tokens() if role == "admin" else []
    except ClientError as exc:
        unreachable(exc)
    budgets = [(f"team {t.name}", t.budget) for t in teams if t.budget is not None] + [
        (f"key {k.name}", k.budget) for k in keys if k.budget is not None and k.state == "active"]
    if not budgets:
        st.caption("No team or key has a token budget. An admin sets them on the Access page.")
    for name, budget in budgets:
        assert budget is not None
        st.progress(min(1.0, budget.used / budget.limit),
                    text=f"**{name}**: {usage.budget_text(budget)}; resets "
                    f"{datetime.fromtimestamp(budget.resets_at, UTC):%d %b %H:%M} UTC")

drafts.settle()
