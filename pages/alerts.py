"""Alerts: what fired and when, the rules that watch GPU health, serving and budgets, and the channels (webhooks)
they are sent to, with a test message. Everyone sees what fired and the rules; operators change rules and test
channels; admins add and remove channels."""

from __future__ import annotations

import streamlit as st

from console import fmt
from console.widgets import client, me, unreachable
from engine.client import ROLES, ApiError, ClientError
from engine.schemas import FiredOut

st.title("Alerts")
role = me().role
operator = ROLES.index(role) >= ROLES.index("operator")
admin = role == "admin"
try:
    fired = client().alerts_fired(limit=500)
    rules = client().alert_rules()
    channels = client().alert_channels() if operator else []
except ClientError as exc:
    unreachable(exc)

firing = [f for f in fired if f.state == "firing"]
c = st.columns(3)
c[0].metric("Firing now", len(firing))
c[1].metric("Rules on", sum(1 for r in rules if r.enabled))
c[2].metric("Channels", len([ch for ch in channels if ch.enabled]) if operator else "—",
            help="webhooks the alerts are sent to" if operator else "operators see the channels")
if operator and not channels:
    st.info("No channel yet: alerts are recorded here but reach no one. An admin adds a webhook (Slack, or any "
            "that takes JSON) below.", icon=":material/notifications_off:")

st.subheader("What fired")
if not fired:
    st.caption("Nothing has fired.")
else:
    def delivered(f: FiredOut) -> str:
        out = f.deliveries
        if not out:
            return "—"
        return ", ".join(f"{d.channel}: {'sent' if d.ok else f'failed ({d.status or d.detail})'}" for d in out[-4:])

    st.dataframe([{"state": f.state, "rule": f.rule, "about": f.subject, "fired": fmt.clock(f.fired_at),
                   "resolved": fmt.clock(f.resolved_at) if f.resolved_at else "—",
                   "value": f.value, "what happened": f.message, "sent to": delivered(f)} for f in fired],
                 hide_index=True, width="stretch")

st.subheader("Rules")
st.caption("A level (a figure against its threshold) fires once it has held for its time, and resolves once it "
           "has been back under 90 % of the threshold as long; an event fires at once and resolves when the "
           "deployment serves again. Each is sent once when it fires and once when it resolves.")
names = {ch.id: ch.name for ch in channels}
st.dataframe([{"rule": r.name, "watches": r.title, "threshold": (f"{r.threshold:g} {r.unit}".strip()
                                                                if r.threshold is not None else "—"),
               "for": fmt.seconds(r.for_s), "deployment": r.deployment or "every",
               "sent to": "every channel" if r.channels is None else
               ", ".join(names.get(i, f"#{i}") for i in r.channels) or "none",
               "on": r.enabled, "firing": r.firing} for r in rules], hide_index=True, width="stretch")
if operator:
    st.markdown("**Change a rule**")
    # (outside the form: choosing a rule fills the form with its values at once)
    rule = st.selectbox("Rule", rules, format_func=lambda r: r.name, key="rule_pick")
    with st.form("edit_rule"):
        r1, r2, r3 = st.columns(3)
        threshold = r1.number_input("Threshold (level rules)", 0.0, 1e9, float(rule.threshold or 0.0) if rule else
                                    0.0, key=f"rule_threshold_{rule.id if rule else 0}", format="%g")
        for_s = r2.number_input("Held for (s)", 0.0, 86400.0, float(rule.for_s) if rule else 60.0,
                                key=f"rule_for_{rule.id if rule else 0}")
        enabled = r3.toggle("On", value=rule.enabled if rule else True, key=f"rule_on_{rule.id if rule else 0}")
        if st.form_submit_button("Save rule") and rule is not None:
            changes: dict[str, object] = {"for_s": for_s, "enabled": enabled}
            if rule.level:
                changes["threshold"] = threshold
            try:
                client().update_alert_rule(rule.id, **changes)
            except ApiError as exc:
                st.error(f"The rule was not saved: {exc}")
            else:
                st.toast(f"Rule {rule.name} saved")
                st.rerun()

    st.subheader("Channels")
    if channels:
        st.dataframe([{"id": ch.id, "name": ch.name, "kind": ch.kind, "address": ch.url, "on": ch.enabled,
                       "added by": ch.created_by} for ch in channels], hide_index=True, width="stretch")
        with st.container(horizontal=True, vertical_alignment="bottom"):
            picked = st.selectbox("Channel", channels, format_func=lambda ch: ch.name, key="channel_pick")
            if st.button("Send a test message", icon=":material/send:") and picked is not None:
                try:
                    answer = client().test_alert_channel(picked.id)
                except ClientError as exc:
                    st.error(f"The test was not sent: {exc}")
                else:
                    if answer.ok:
                        st.success(f"{picked.name} answered {answer.status}: it receives the alerts.")
                    else:
                        st.error(f"{picked.name} did not take it: {answer.status or ''} {answer.detail or ''}")
            if admin and st.button("Remove", icon=":material/delete:") and picked is not None:
                client().delete_alert_channel(picked.id)
                st.toast(f"Channel {picked.name} removed")
                st.rerun()
    if admin:
        if added := st.session_state.pop("ch_clear", None):  # added: the webhook's address (its secret) leaves
            st.session_state.update(ch_name="", ch_url="")  # the page
            st.toast(added)
        with st.form("new_channel"):
            st.markdown("**Add a channel**")
            n1, n2 = st.columns([1, 1])
            ch_name = n1.text_input("Name", key="ch_name")
            ch_kind = n2.selectbox("Kind", ["slack", "webhook"], key="ch_kind",
                                   help='slack: {"text": …} (Slack, Mattermost, Rocket.Chat); webhook: the alert '
                                   "as JSON")
            ch_url = st.text_input("Webhook address", key="ch_url", type="password",
                                   help="never shown again whole: its path holds its secret")
            if st.form_submit_button("Add channel"):
                try:
                    client().create_alert_channel(ch_name, ch_kind, ch_url)
                except ApiError as exc:
                    st.error(f"The channel was not added: {exc}")
                else:
                    st.session_state["ch_clear"] = f"Channel {ch_name} added"  # (said after the rerun)
                    st.rerun()
