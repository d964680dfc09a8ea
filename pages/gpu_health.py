"""GPU health as a fleet view: each node (the engine's host, or every node of the Ray cluster, the lost ones
marked) → its GPUs (or its host, where it has none) → the instances on it, and which deployment holds what memory
where; then history from 5 minutes to 7 days, balance across an engine's GPUs, alerts."""

from __future__ import annotations

import time

import streamlit as st

from console import charts, drafts, fmt
from console.widgets import base_client, client, gpu_card, host_card, unreachable
from engine.client import ClientError
from engine.schemas import FleetOut, GpuView, NodeOut

st.title("GPU health")
WINDOWS = {"5 min": "5m", "15 min": "15m", "1 hour": "1h", "6 hours": "6h", "24 hours": "24h", "7 days": "7d"}
# kept across pages and reloads, one for the whole fleet
drafts.keep("gpu_health", ["gpu_window"], {"gpu_window": "15 min"}, per_deployment=False)
window = st.segmented_control("Window", list(WINDOWS), key="gpu_window") or "15 min"


def held_by(g: GpuView) -> str:
    """Which deployment holds what memory on a GPU (NVML's processes), others' processes summed."""
    mine: dict[str, int] = {}
    others = 0
    for proc in g.processes:
        if proc.ours and proc.deployment:
            mine[proc.deployment] = mine.get(proc.deployment, 0) + (proc.used_memory or 0)
        else:
            others += proc.used_memory or 0
    parts = [f"**{name}** {fmt.gib(used, 2)}" for name, used in sorted(mine.items())]
    if others:
        parts.append(f"other processes {fmt.gib(others, 2)}")
    return ", ".join(parts) or "no process"


def node_card(node: NodeOut, placement: str, reason: str | None) -> None:
    where = "the engine's host" if placement == "local" else ("head node" if node.head else "node")
    title = f"**{node.address or node.id}** · {where}"
    with st.container(border=True):
        if not node.alive:
            st.error(f"{title} · **lost**: Ray lists it dead. Its instances are started again on a node with room "
                     "(see where below and on the Events page).", icon=":material/cloud_off:")
        elif node.suspect:
            st.warning(f"{title} · **suspect**: an instance on it was lost lately, so nothing new is placed there for "
                       "a while (Ray may still list it alive).", icon=":material/help:")
        elif not node.telemetry:
            st.warning(f"{title} · **no figures**: its sampler did not answer this round (none are made up); it is "
                       "tried again at the next sample.", icon=":material/help:")
        else:
            ray_memory = f" · {fmt.gib(node.memory_bytes)} for Ray" if node.memory_bytes and placement == "ray" else ""
            st.markdown(f"{title} · alive · {node.cpus:g} CPUs · " + (f"{node.gpus:g} GPUs" if node.gpus else "no GPU")
                        + ray_memory)
        for g in node.gpu_readings:
            gpu_card(g)
            st.caption(f"GPU {g.index} held by: {held_by(g)}")
        if not node.gpu_readings and node.host is not None:
            host_card(node.host, reason)
            by = node.host.vllm_rss_by_deployment
            if by:
                st.caption("Resident memory by deployment: " + ", ".join(
                    f"**{name}** {fmt.gib(rss, 2)}" for name, rss in sorted(by.items())))
        if node.instances:
            st.dataframe([{"deployment": i.deployment, "instance": i.name, "role": i.role, "revision": i.revision,
                           "serving": i.serving, "address": i.address or "starting"} for i in node.instances],
                         hide_index=True, width="stretch")
        elif node.alive:
            st.caption("No instance runs on this node.")


def fleet_view(fleet: FleetOut, reason: str | None) -> None:
    alive = sum(1 for n in fleet.nodes if n.alive)
    gpus = sum(len(n.gpu_readings) for n in fleet.nodes)
    st.subheader("Fleet")
    st.caption(("Local placement: every instance is a child process of the engine on this host." if
                fleet.placement == "local" else f"Ray cluster: {alive} of {len(fleet.nodes)} node(s) alive.")
               + (f" {gpus} GPU(s)." if gpus else " No GPU on any node: the CPU build of vLLM, host figures only."))
    for node in fleet.nodes:
        node_card(node, fleet.placement, reason)


@st.fragment(run_every=2)
def health() -> None:
    try:
        fleet = base_client().fleet()
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
    fleet_view(fleet, gpu.reason)
    st.subheader("History" + (" of the engine's host" if fleet.placement != "local" else ""))
    if not gpu.available:
        c1, c2 = st.columns(2)
        c1.plotly_chart(charts.timeseries(history, "util_gpu", {"-1": "host CPU"}, marks).update_layout(
            title_text="Host CPU"), theme="streamlit")
        c2.plotly_chart(charts.timeseries(history, "mem_used", {"-1": "host"}, marks).update_layout(
            title_text="Host memory used"), theme="streamlit")
        st.caption("Dotted lines: settings changes, restarts, rollbacks, failures and alerts in this window.")
        return
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
