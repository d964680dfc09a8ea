"""Overview: is the engine serving, what, since when, how busy; the GPUs at a glance; what happened lately (live);
and how a client reaches the served model."""

from __future__ import annotations

import json

import streamlit as st

from console import fmt
from console.restart import instances, plan_text
from console.widgets import (
    STATE_BADGE,
    autoscale_card,
    base_client,
    chosen,
    client,
    deployment_header,
    engine_status,
    event_line,
    gpu_card,
    host_card,
    open_link,
    restart_banner,
    state_badge,
    unreachable,
)
from engine.client import ClientError
from engine.schemas import SNIPPET_MAX_TOKENS, GatewayInfo

st.title("Overview")


@st.fragment(run_every=5)
def fleet() -> None:
    """The fleet at a glance: the deployments and their states, the nodes, the GPUs (or the host's CPU build)."""
    try:
        rows = base_client().deployments()
        view = base_client().fleet()
    except ClientError as exc:
        unreachable(exc)
    alive = [n for n in view.nodes if n.alive]
    gpus = sum(len(n.gpu_readings) for n in view.nodes)
    ready = sum(1 for r in rows if r.state == "ready")
    c = st.columns(4)
    c[0].metric("Deployments", f"{ready} of {len(rows)} ready",
                help=", ".join(f"{r.name}: {r.state}" for r in rows))
    c[1].metric("Nodes", f"{len(alive)} of {len(view.nodes)} alive",
                help="the engine's host (local placement)" if view.placement == "local" else "the Ray cluster's")
    c[2].metric("GPUs", str(gpus) if gpus else "none",
                help="no GPU on any node: the CPU build of vLLM runs on the hosts" if not gpus else None)
    c[3].metric("Placement", "this host" if view.placement == "local" else "Ray cluster")
    lost = [n for n in view.nodes if not n.alive]
    for n in lost:
        st.error(f"Node **{n.address or n.id}** is lost: its instances are started again where there is room.",
                 icon=":material/cloud_off:")
    if len(rows) > 1:
        shown = chosen().shown
        with st.container(horizontal=True, vertical_alignment="center"):
            for r in rows:
                color, icon = STATE_BADGE.get(r.state, ("gray", ":material/help:"))
                st.badge(f"{r.name} · {r.state}" + ("" if r.enabled else " (disabled)"), color=color,  # type: ignore[arg-type]
                         icon=icon)
                if r.name != shown:
                    open_link("overview", f"open {r.name}", r.name)


fleet()
deployment_header("its details below")


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

    autoscale_card(status)
    if len(status.instances) > 1 or (status.apply is not None and status.apply.outcome == "running"):
        st.subheader("Instances")
        if status.apply is not None and status.apply.outcome == "running":
            st.info(f"Applying revision {status.apply.revision}: {plan_text(status.apply.plan)}  \nNow: "
                    f"{status.apply.step}", icon=":material/route:")
        instances(status)

    st.subheader("Serving")
    try:
        s = client().serving()
        gpu = client().gpu()
        events = client().events(limit=10, newest_first=True)
    except ClientError as exc:
        unreachable(exc)
    if not s.available:
        st.caption(s.error or "No live figures while vLLM is not ready.")
    else:
        sc = st.columns(5)
        sc[0].metric("Requests running", f"{s.requests_running or 0:.0f}")
        sc[1].metric("Requests waiting", f"{s.requests_waiting or 0:.0f}")
        sc[2].metric("Generation tokens/s", fmt.figure(s.generation_tokens_per_s),
                     help=f"prompt: {fmt.rate(s.prompt_tokens_per_s)}")
        usage = s.kv_cache_usage
        sc[3].metric("KV-cache use", fmt.pct(None if usage is None else 100 * usage, 1))
        sc[4].metric("P95 latency", fmt.seconds(s.e2e_seconds_p95),
                     help=f"time to first token P95: {fmt.seconds(s.ttft_seconds_p95)} (since last scrape)")

    st.subheader("GPUs")
    if not gpu.available and gpu.host is not None:
        host_card(gpu.host, gpu.reason)
        if len(gpu.host.vllm_rss_by_deployment) > 1:
            st.caption("vLLM's resident memory by deployment: " + ", ".join(
                f"**{name}** {fmt.gib(rss, 2)}" for name, rss in sorted(gpu.host.vllm_rss_by_deployment.items())))
    for g in gpu.gpus:
        gpu_card(g)
    for alert in gpu.alerts:
        st.warning(f"{alert.alert}: {alert.message}", icon=":material/warning:")

    st.subheader("Latest events")
    for ev in events:
        st.markdown(event_line(ev))
    st.caption("All events, filters and vLLM's log: **Events & logs**.")


def snippets(info: GatewayInfo) -> tuple[str, str]:
    base, model = info.data_base_url or info.base_url, info.served_model or "demo"
    body = json.dumps({"model": model, "messages": [{"role": "user", "content": "Hello!"}],
                       "max_tokens": SNIPPET_MAX_TOKENS})
    key = ' \\\n     -H "Authorization: Bearer $LLMOPS_API_KEY"' if info.keys_required else ""
    curl = f"curl {base}/chat/completions -H 'content-type: application/json'{key} \\\n     -d '{body}'"
    api_key = 'os.environ["LLMOPS_API_KEY"]' if info.keys_required else '"not-needed"'
    sdk = (f"import os\n\nfrom openai import OpenAI\n\nclient = OpenAI(base_url=\"{base}\", api_key={api_key})\n"
           f"reply = client.chat.completions.create(\n    model=\"{model}\",\n"
           "    messages=[{\"role\": \"user\", \"content\": \"Hello!\"}],\n"
           f"    max_tokens={SNIPPET_MAX_TOKENS},\n)\n"
           "print(reply.choices[0].message.content)")
    return curl, sdk


def gateway_card() -> None:
    try:
        info = client().gateway()
    except ClientError as exc:
        unreachable(exc)
    st.subheader("Use the model")
    left, right = st.columns([3, 2], gap="large")
    with left:
        st.markdown(f"OpenAI-compatible API at **`{info.data_base_url or info.base_url}`**, model "
                    f"**`{info.served_model}`**. The address stays the same across restarts and settings changes.")
        if info.data_base_url:
            alive = sum(w.alive for w in info.workers)
            taking = sum(w.alive and w.accepting for w in info.workers)
            steered = (f"; {taking} of them take{'s' if taking == 1 else ''} new connections now, as many as the "
                       "load needs (gateway_worker_busy_share)") if taking < alive else ""
            st.caption(f"Served by {alive} of {len(info.workers)} gateway workers, each relaying on a core of its "
                       f"own (gateway_workers){steered}. `{info.base_url}`, the engine's own port, serves /v1 too.")
        if info.keys_required:
            st.caption("This gateway needs an API key (`Authorization: Bearer …`): an admin creates one on the "
                       "Access page (kind *gateway*). Set it as `LLMOPS_API_KEY`.")
        curl, sdk = snippets(info)
        tab_curl, tab_sdk = st.tabs(["curl", "OpenAI SDK (Python)"])
        tab_curl.code(curl, language="bash", wrap_lines=True)
        tab_sdk.code(sdk, language="python", wrap_lines=True)
    with right, st.container(border=True):
        card = info.model
        st.markdown("**Model card**")
        if not card:
            st.caption("The model's config.json is not on this host yet (a hub model is read once downloaded).")
            return
        c = st.columns(2)
        c[0].metric("Architecture", card.architecture.removesuffix("ForCausalLM") or card.architecture,
                    help=card.architecture)
        c[1].metric("Parameters", fmt.count(card.parameters))
        c = st.columns(2)
        c[0].metric("Context length", f"{card.context_length:,}",
                    help=f"max_model_len; the model allows {card.model_max_length:,} tokens")
        c[1].metric("Dtype", card.dtype)
        st.metric("KV cache per token", fmt.size(card.kv_bytes_per_token),
                  help=f"{card.kv_bytes_per_token:,} bytes per token ({card.layers} layers)")


live()
gateway_card()
