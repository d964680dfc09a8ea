"""Benchmarks: vLLM's own serving benchmark against the gateway, per revision; a comparison of two runs; and a
guided search for max_num_seqs under a latency target."""

from __future__ import annotations

import streamlit as st

from console import charts, fmt
from console.restart import plan_box
from console.widgets import client, deployment_header, engine_status, own_rerun, restart_banner, unreachable
from engine.client import ApiError, ClientError
from engine.schemas import BenchmarkRunOut

st.title("Benchmarks")
deployment_header("runs against it, through the gateway, and its results")
status = engine_status()
restart_banner(status)
try:
    presets = client().presets()
    runs = client().benchmarks()
except ClientError as exc:
    unreachable(exc)
running = next((r for r in runs if r.status == "running"), None)

tab_run, tab_compare, tab_search = st.tabs(["Run", "Compare", "Guided search"])
with tab_run:
    c1, c2, c3 = st.columns([2, 2, 1])
    preset = c1.selectbox("Preset", list(presets), format_func=lambda p: presets[p].title, key="bm_preset")
    levels = c2.multiselect("Concurrency sweep", [1, 2, 4, 8, 16, 32, 64, 128, 256], default=[1, 4, 16],
                            key="bm_levels")
    prompts = c3.number_input("Prompts per level", 1, 100_000, presets[preset].num_prompts, key="bm_num")
    st.caption(f"Random prompts of {presets[preset].input_len} tokens, {presets[preset].output_len} out "
               "(shrunk to fit max_model_len), through the gateway, on the running revision "
               f"{status.running_revision}.")
    if st.button("Run benchmark", type="primary", disabled=running is not None or not levels or
                 status.state != "ready", icon=":material/speed:"):
        try:
            client().start_sweep(preset, sorted(levels), int(prompts))
        except ApiError as exc:
            st.error(str(exc))
        st.rerun()


@st.fragment(run_every=2)
def progress() -> None:
    live = next((r for r in client().benchmarks() if r.status == "running"), None)
    if live is None:
        if own_rerun() and st.session_state.pop("bm_watching", None) is not None:
            st.rerun(scope="app")  # a run just ended: the whole page shows its results
        return
    st.session_state["bm_watching"] = live.id
    p = live.progress
    level = (p.level_done or 0) / max(1, p.level_total or 1)
    st.progress(min(1.0, (p.done + min(1.0, level)) / max(1, p.total)),
                text=f"{live.kind} {live.id}: {p.stage} ({p.level_done or 0}/{p.level_total or '?'} requests of this "
                     "level)")
    if st.button("Cancel", key=f"cancel_{live.id}"):
        client().cancel_benchmark(live.id)
        st.rerun(scope="app")


progress()


def label(run: BenchmarkRunOut) -> str:
    title = presets[run.preset].title if run.preset in presets else run.preset
    return f"#{run.id} {run.kind} · {title} · revision {run.revision_id} · {run.status} · {fmt.clock(run.started_at)}"


def seconds_of_ms(value: float | None) -> str | None:
    return fmt.seconds(value / 1000) if value else None


def results_table(run: BenchmarkRunOut) -> None:
    """The run's levels, each with the seed of its prompts and how much of them the prefix cache served; below
    it, what makes a level's figures doubtful (prompts served from the cache: a cache test)."""
    rows = [{"max_num_seqs": r.max_num_seqs, "concurrency": r.concurrency,
             "output tokens/s": round(r.output_throughput, 1) if r.output_throughput else None,
             "P50 latency": seconds_of_ms(r.p50_e2el_ms), "P95 latency": seconds_of_ms(r.p95_e2el_ms),
             "P95 TTFT": seconds_of_ms(r.p95_ttft_ms), "P95 ITL": seconds_of_ms(r.p95_itl_ms),
             "tokens/J": r.tokens_per_joule, "completed": r.completed,
             "prefix cache hits": fmt.pct(r.prefix_cache_hit_pct, 1) if r.prefix_cache_hit_pct is not None else None,
             "seed": str(r.seed) if r.seed is not None else None, "error": r.error}
            for r in run.results]
    columns = [k for k in rows[0] if any(row[k] is not None for row in rows)] if rows else []
    st.dataframe([{k: row[k] for k in columns} for row in rows], hide_index=True, width="stretch")
    for r in run.results:
        where = f"max_num_seqs {r.max_num_seqs}" if r.max_num_seqs is not None else f"concurrency {r.concurrency}"
        for warning in r.warnings:
            st.warning(f"{where}: {warning}", icon=":material/cached:")
    if run.params.get("seed") is not None:
        st.caption(f"Seed {run.params['seed']} was asked for: every level sent the same prompts.")
    elif any(r.seed is not None for r in run.results):
        st.caption("Each level sent fresh prompts (a new seed each); the prefix cache hits are vLLM's own "
                   "counters over the level.")


with tab_run:
    done = [r for r in runs if r.kind == "sweep"]
    for run in done[:10]:
        with st.expander(label(run), expanded=run is done[0]):
            if run.error:
                st.error(run.error)
            if run.results:
                results_table(run)
                if len([r for r in run.results if r.output_throughput]) >= 2:
                    c1, c2 = st.columns(2)
                    c1.plotly_chart(charts.sweep_throughput(run.results), theme="streamlit",
                                    key=f"tput_{run.id}")
                    c2.plotly_chart(charts.sweep_latency(run.results), theme="streamlit", key=f"lat_{run.id}")
                if any(r.tokens_per_joule is None for r in run.results):
                    st.caption("Tokens per joule need a GPU's energy counter; this host has none.")

with tab_compare:
    sweeps = [r for r in runs if r.kind == "sweep" and r.status == "done"]
    if len(sweeps) < 2:
        st.caption("Run at least two sweeps (for example before and after a settings change) to compare them.")
    else:
        c1, c2 = st.columns(2)
        a = c1.selectbox("A", sweeps, format_func=label, index=min(1, len(sweeps) - 1), key="cmp_a")
        b = c2.selectbox("B", sweeps, format_func=label, index=0, key="cmp_b")
        cmp = client().compare_benchmarks(a.id, b.id)
        if not cmp.levels:
            st.warning("The two runs share no concurrency level.")
        metrics = [("output_throughput", "Output tokens/s"), ("p95_ttft_ms", "P95 TTFT (ms)"),
                   ("p95_itl_ms", "P95 inter-token latency (ms)"), ("p95_e2el_ms", "P95 latency (ms)")]
        cols = st.columns(2)
        for i, (key, title) in enumerate(metrics):
            names = (f"A #{a.id}", f"B #{b.id}")
            cols[i % 2].plotly_chart(charts.compare_bars(cmp.levels, key, title, names), theme="streamlit")
        st.dataframe([{"concurrency": lv.concurrency,
                       **{f"{title} change": fmt.pct(getattr(lv, key).change_pct, 1) for key, title in metrics}}
                      for lv in cmp.levels], hide_index=True, width="stretch")

with tab_search:
    st.markdown("Tries each `max_num_seqs` as a revision (an apply each time, by the plan the engine picks), "
                "benchmarks it at twice that many clients, restores the current settings, and proposes the value "
                "with the best throughput whose P95 latency meets the target.")
    c1, c2, c3 = st.columns(3)
    target = c1.number_input("P95 end-to-end target (s)", 0.1, 3600.0, 10.0, step=0.5, key="srch_target")
    candidates = c2.multiselect("max_num_seqs to try", [1, 2, 4, 8, 16, 32, 64, 128, 256, 512],
                                default=[1, 4, 16], key="srch_cands")
    s_preset = c3.selectbox("Preset", list(presets), format_func=lambda p: presets[p].title, key="srch_preset")
    if st.button("Start guided search", disabled=running is not None or not candidates or status.state != "ready"):
        try:
            client().start_search(s_preset, float(target), sorted(candidates))
        except ApiError as exc:
            st.error(str(exc))
        st.rerun()

    @st.dialog("Apply the proposal?")
    def confirm_proposal(run_id: int, seqs: int) -> None:
        """The plan the apply will run, with its ETA and what clients should expect, before anything is written."""
        try:
            current = client().settings()
            cap = client().capacity({"max_num_seqs": seqs})
        except ClientError as exc:
            st.error(str(exc))
            return
        st.markdown(f"A new revision with **max_num_seqs = {seqs}** (now {current.values.max_num_seqs}); vLLM "
                    "restarts with it, by this plan:")
        if cap.plan is not None:
            plan_box(cap.plan)
        for f in cap.errors:
            st.error(f"**{f.field}**: {f.message}", icon=":material/block:")
        if st.button("Apply & restart", type="primary", disabled=bool(cap.errors)):
            try:
                rev = client().put_settings(current.revision, {"max_num_seqs": seqs},
                                            f"guided search {run_id} proposal")
            except ClientError as exc:
                st.error(str(exc))
                return
            st.session_state["bm_flash"] = f"Revision {rev.revision} written; follow the restart on Engine settings."
            st.rerun()

    if flash := st.session_state.pop("bm_flash", None):
        st.toast(flash)
    for run in [r for r in runs if r.kind == "search"][:5]:
        with st.expander(label(run), expanded=run.status != "running"):
            if run.error:
                st.error(run.error)
            if run.results:
                results_table(run)
            proposal = run.proposal
            if proposal:
                gain = proposal.gain_over_max_num_seqs_1
                st.success(f"Proposal: **max_num_seqs = {proposal.max_num_seqs}**: "
                           f"{proposal.output_throughput:,.0f} output tokens/s at P95 {proposal.p95_e2e_s} s "
                           f"(target {proposal.target_p95_s} s)" + (f", {gain}x max_num_seqs 1" if gain else ""))
                if st.button(f"Apply max_num_seqs = {proposal.max_num_seqs}", key=f"apply_{run.id}"):
                    confirm_proposal(run.id, proposal.max_num_seqs)
            elif run.status == "done":
                st.warning("No candidate met the target: raise the target or try smaller max_num_seqs.")
