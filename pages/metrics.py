"""Metrics: vLLM's serving figures live and over time, and the KPI table per settings revision."""

from __future__ import annotations

import streamlit as st

from console import charts, drafts, fmt
from console.widgets import client, deployment_header, engine_status, restart_banner, unreachable
from engine.client import ClientError

st.title("Metrics")
deployment_header("the figures below are its own")
WINDOWS = {"15 min": "15m", "1 hour": "1h", "6 hours": "6h", "24 hours": "24h", "7 days": "7d"}
CHARTS = [("generation_tokens_per_s", "Generation", "tokens/s", 1.0),
          ("e2e_seconds_p95", "End-to-end latency P95", "s", 1.0),
          ("ttft_seconds_p95", "Time to first token P95", "s", 1.0),
          ("kv_cache_usage", "KV-cache use", "%", 100.0),
          ("requests_running", "Requests running", "", 1.0),
          ("requests_waiting", "Requests waiting", "", 1.0)]
INSTANCE_CHARTS = [("requests_per_s", "Requests routed to each instance", "req/s", 1.0),
                   ("prefix_routed_share", "Share routed by prefix", "%", 100.0),
                   ("prefix_cache_hit_pct", "vLLM's prefix-cache hit rate", "%", 1.0),
                   ("kv_cache_usage", "KV-cache use per instance", "%", 100.0)]

restart_banner(engine_status())
drafts.keep("metrics", ["metrics_window"], {"metrics_window": "1 hour"})  # kept across pages and reloads
window = st.segmented_control("Window", list(WINDOWS), key="metrics_window") or "1 hour"


@st.fragment(run_every=5)
def live() -> None:
    try:
        now = client().serving()
        history = client().serving_history(WINDOWS[window], [m for m, *_ in CHARTS])
    except ClientError as exc:
        unreachable(exc)
    if now.available:
        c = st.columns(4)
        c[0].metric("Generation tokens/s", fmt.figure(now.generation_tokens_per_s))
        c[1].metric("Prompt tokens/s", fmt.figure(now.prompt_tokens_per_s))
        c[2].metric("P95 inter-token latency", fmt.seconds(now.itl_seconds_p95))
        c[3].metric("Preemptions /s", fmt.figure(now.preemptions_per_s),
                    help="requests evicted from the KV cache and recomputed: a sign of too little KV cache")
    cols = st.columns(2)
    for i, (metric, title, unit, scale) in enumerate(CHARTS):
        cols[i % 2].plotly_chart(charts.by_revision(history, metric, title, unit, scale), theme="streamlit")
    st.caption(f"vLLM's /metrics every {now.interval_s:.0f} s; {history.source} history, "
               f"{history.step_s:.0f} s per point; one line per revision that served.")
    scaled()
    instances()


def scaled() -> None:
    """Replicas against load over time, where the deployment autoscales or scales to zero."""
    try:
        status = client().status()
        a = status.autoscale
        if a is None or not (a.autoscaled or a.scale_to_zero_after_s is not None):
            return
        history = client().scaling_history(WINDOWS[window])
    except ClientError as exc:
        unreachable(exc)
    st.plotly_chart(charts.scaling(history), theme="streamlit", key="scaling")
    st.caption(f"Autoscaling: replicas {a.min_replicas}–{a.max_replicas}, target {a.target_in_flight:g} in flight "
               "per replica. Replicas serving are the most in each point, the load its mean; each decision is an "
               "`autoscale` event (Events page).")


def instances() -> None:
    """Each instance that serves: how the gateway routed to it and what its prefix cache found (2+ instances)."""
    try:
        status = client().status()
    except ClientError as exc:
        unreachable(exc)
    serving = [i for i in status.instances if i.serving and i.routing is not None]
    if len(serving) < 2:
        return
    st.markdown("**Instances: routing and prefix cache**")
    rows = []
    for i in serving:
        r = i.routing
        assert r is not None
        total = r.prefix + r.home + r.load
        rows.append({"instance": i.name, "revision": str(i.revision), "in flight": i.outstanding, "routed": total,
                     "by prefix": fmt.pct(100 * r.prefix / total if total else None, 0),
                     "home": fmt.pct(100 * r.home / total if total else None, 0),
                     "by load": fmt.pct(100 * r.load / total if total else None, 0),
                     "prefix-cache hits": fmt.pct(r.prefix_cache_hit_pct, 0),
                     "KV-cache use": fmt.pct(None if r.kv_cache_usage is None else 100 * r.kv_cache_usage, 0)})
    st.dataframe(rows, hide_index=True, width="stretch")
    try:
        history = client().instance_history(WINDOWS[window], [m for m, *_ in INSTANCE_CHARTS])
    except ClientError as exc:
        unreachable(exc)
    cols = st.columns(2)
    for n, (metric, title, unit, scale) in enumerate(INSTANCE_CHARTS):
        cols[n % 2].plotly_chart(charts.by_instance(history, metric, title, unit, scale), theme="streamlit",
                                 key=f"instance_{metric}")
    policy = status.gateway.routing
    st.caption(f"Routing: **{policy.replace('_', ' ')}** (the revision's `routing`). By prefix: sent where the "
               "start of its prompt was sent before; home: a prompt seen nowhere, placed by hashing; by load: the "
               "instance with the fewest requests in flight. Prefix-cache hits: vLLM's own, between its last two "
               f"scrapes. Charts: {history.source} history, {history.step_s:.0f} s per point, one line per "
               "instance.")


live()

st.subheader("KPIs per revision")
try:
    rows = client().kpis(WINDOWS[window])
except ClientError as exc:
    unreachable(exc)
if not rows:
    st.caption("No requests through the gateway in this window yet.")
else:
    small = st.column_config.TextColumn(width="small")
    st.dataframe([{  # requests refused before any revision served them (stopped, queue full) are a row of their own
        "revision": str(r.revision) if r.revision is not None else "none: refused", "requests": r.requests,
        "avg in": r.avg_input_tokens, "avg out": r.avg_output_tokens, "P50": fmt.seconds(r.latency_p50_s),
        "P95": fmt.seconds(r.latency_p95_s), "P99": fmt.seconds(r.latency_p99_s),
        "P95 TTFT": fmt.seconds(r.ttft_p95_s), "tokens/s": r.output_tokens_per_s,
        "errors": fmt.pct(None if r.error_rate is None else 100 * r.error_rate, 1),
        "OOMs": r.oom_failures, "OOM/h": r.oom_per_hour} for r in rows],
        hide_index=True, width="stretch",
        column_config={"revision": st.column_config.TextColumn(width="medium"),
                       "requests": st.column_config.NumberColumn(width="small"),
                       "avg in": st.column_config.NumberColumn("avg input tokens", width="small"),
                       "avg out": st.column_config.NumberColumn("avg output tokens", width="small"),
                       "P50": small, "P95": small, "P99": small, "P95 TTFT": small,
                       "tokens/s": st.column_config.NumberColumn(width="small", format="%.1f"),
                       "errors": small, "OOMs": st.column_config.NumberColumn(width="small"),
                       "OOM/h": st.column_config.NumberColumn(width="small", format="%.3f")})
    st.caption("From the gateway's request ledger: latency (P50, P95, P99 end-to-end) includes time queued in the "
               "gateway during restarts. \"none: refused\": requests no revision served (vLLM stopped, the queue "
               "full, a model no deployment serves).")
drafts.settle()  # drawn whole from the draft: from now on the fields are the user's
