"""GPU health: per-GPU cards, history from 5 minutes to 7 days, balance across an engine's GPUs, alerts."""

from __future__ import annotations

import time

import streamlit as st

from console import charts, drafts, fmt
from console.client import ClientError
from console.widgets import client, gpu_card, host_card, unreachable

st.title("GPU health")
WINDOWS = {"5 min": "5m", "15 min": "15m", "1 hour": "1h", "6 hours": "6h", "24 hours": "24h", "7 days": "7d"}
drafts.keep("gpu_health", ["gpu_window"], {"gpu_window": "15 min"})  # kept across pages and reloads
window = st.segmented_control("Window", list(WINDOWS), key="gpu_window") or "15 min"


@st.fragment(run_every=2)
def health() -> None:
    try:
        gpu = client().gpu()
        history = client().gpu_history(WINDOWS[window])
        events = client().events(kinds=list(charts.MARKER_KINDS), limit=500, newest_first=True)
    except ClientError as exc:
        unreachable(exc)
    marks = charts.markers(events, time.time() - history.window_s)
    sampler = gpu.sampler
    st.caption(f"Driver {gpu.driver or 'n/a'} · sampled every {sampler.interval_s:.0f} s"
               f" ({sampler.samples_per_s or 'n/a'}/s held) · sampler CPU {fmt.pct(sampler.cpu_pct_of_core, 2)}"
               f" of a core · {history.source} history, {history.step_s:.0f} s per point")
    for alert in gpu.alerts:
        st.error(f"**{alert.alert}** on GPU {alert.gpu}: {alert.message} (since {fmt.clock(alert.since)})",
                 icon=":material/warning:")
    if not gpu.available:
        if gpu.host is not None:
            host_card(gpu.host, gpu.reason)
        c1, c2 = st.columns(2)
        c1.plotly_chart(charts.timeseries(history, "util_gpu", {"-1": "host CPU"}, marks).update_layout(
            title_text="Host CPU"), theme="streamlit")
        c2.plotly_chart(charts.timeseries(history, "mem_used", {"-1": "host"}, marks).update_layout(
            title_text="Host memory used"), theme="streamlit")
        st.caption("Dotted lines: settings changes, restarts, rollbacks, failures and alerts in this window.")
        return
    for g in gpu.gpus:
        gpu_card(g)
    balance = gpu.balance
    if balance:
        st.subheader("Balance" + (" of the engine's GPUs" if balance.scope == "engine" else ""))
        c = st.columns(3)
        c[0].metric("GPUs", ", ".join(map(str, balance.gpus)))
        c[1].metric("Memory spread", fmt.gib(balance.mem_spread_bytes, 2), help=f"{balance.mem_spread_pct} % "
                    "of the mean; tensor-parallel ranks should hold about the same")
        c[2].metric("Utilization spread", fmt.pct(balance.util_spread_pct))
    c1, c2 = st.columns(2)
    for col, metric in ((c1, "mem_used"), (c2, "util_gpu"), (c1, "power_w"), (c2, "temp_c")):
        col.plotly_chart(charts.timeseries(history, metric, marks=marks), theme="streamlit")
    st.caption("Dotted lines: settings changes, restarts, rollbacks, failures and alerts in this window; over long "
               "windows each point is a bucket's average within its min-max band.")


health()
drafts.settle()  # drawn whole from the draft: from now on the fields are the user's
