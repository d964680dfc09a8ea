"""Overview: is the engine serving, what, since when, how busy; the GPUs at a glance; what happened lately."""

from __future__ import annotations

import streamlit as st

from console import fmt
from console.client import ClientError
from console.widgets import client, engine_status, gpu_card, host_card, restart_banner, state_badge, unreachable

st.title("Overview")


@st.fragment(run_every=2)
def live() -> None:
    status = engine_status()
    top = st.container(horizontal=True, vertical_alignment="center")
    with top:
        state_badge(status)
        st.markdown(f"**{status.model or 'no model'}** · revision {status.running_revision or '—'}"
                    + (f" (desired {status.desired_revision})" if status.desired_revision != status.running_revision
                       else "") + f" · vLLM {status.vllm_version} ({status.vllm_build})")
    restart_banner(status)
    c = st.columns(4)
    c[0].metric("State", status.state, help=status.reason)
    c[1].metric("Uptime", fmt.since(status.ready_since).removesuffix(" ago") if status.ready_since else "—")
    c[2].metric("Restarts", status.restarts, help="vLLM starts since the engine started, beyond the first")
    c[3].metric("Gateway", f"{status.gateway.in_flight} in flight",
                help=f"{status.gateway.waiting} waiting, {status.gateway.rejected} refused since start")

    st.subheader("Serving")
    try:
        s = client().serving()
    except ClientError as exc:
        unreachable(exc)
    if not s["available"]:
        st.caption("No live figures while vLLM is not ready." if not s.get("error") else s["error"])
    else:
        sc = st.columns(5)
        sc[0].metric("Requests running", f"{s.get('requests_running', 0):.0f}")
        sc[1].metric("Requests waiting", f"{s.get('requests_waiting', 0):.0f}")
        sc[2].metric("Generation", fmt.rate(s.get("generation_tokens_per_s")),
                    help=f"prompt: {fmt.rate(s.get('prompt_tokens_per_s'))}")
        usage = s.get("kv_cache_usage")
        sc[3].metric("KV-cache use", fmt.pct(None if usage is None else 100 * usage, 1))
        sc[4].metric("P95 latency", fmt.seconds(s.get("e2e_seconds_p95")),
                    help=f"time to first token P95: {fmt.seconds(s.get('ttft_seconds_p95'))} (since last scrape)")

    st.subheader("GPUs")
    gpu = client().gpu()
    if not gpu["available"]:
        host_card(gpu["host"], gpu["reason"])
    for g in gpu["gpus"]:
        gpu_card(g)
    for alert in gpu["alerts"]:
        st.warning(f"{alert['alert']}: {alert['message']}", icon=":material/warning:")


live()

st.subheader("Latest events")
try:
    events = client().events(limit=10, newest_first=True)
except ClientError as exc:
    unreachable(exc)
for ev in events:
    icon = {"error": ":material/error:", "critical": ":material/dangerous:",
            "warning": ":material/warning:"}.get(ev.severity, ":material/info:")
    st.markdown(f"{icon} `{ev.ts:%H:%M:%S}` **{ev.kind}** {ev.message}")
st.caption("All events, filters and vLLM's log: **Events & logs**.")
