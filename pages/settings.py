"""Engine settings: change the three memory knobs (and the rest), see the capacity before applying, apply with a
safe restart and watch it, and browse or roll back the history of revisions."""

from __future__ import annotations

import time
from typing import Any

import streamlit as st

from console import charts, fmt
from console.client import ClientError, RevisionInfo, SettingsRejectedError, StaleRevisionError
from console.widgets import client, engine_status, restart_banner, unreachable

st.title("Engine settings")
PRIMARY = ("gpu_memory_utilization", "max_model_len", "max_num_seqs")
CHOICES = {"dtype": ["auto", "bfloat16", "float16", "float32"],
           "kv_cache_dtype": ["auto", "float16", "bfloat16", "fp8", "fp8_e4m3", "fp8_e5m2"],
           "load_format": ["auto", "safetensors", "pt", "dummy", "gguf", "bitsandbytes", "fastsafetensors",
                           "sharded_state", "runai_streamer"]}
PROGRESS_KINDS = ["settings_changed", "drained", "stopped", "starting", "ready", "failed", "diagnosis", "rollback",
                  "restart_scheduled", "crash_loop"]

try:
    status = engine_status()
    desired = client().settings()
    schema = client().settings_schema()["properties"]
except ClientError as exc:
    unreachable(exc)
restart_banner(status)


def help_of(name: str) -> str:
    return str(schema.get(name, {}).get("description", ""))


# Widgets start from the desired revision; when it changes (an apply, a rollback, another operator), they reset.
if st.session_state.get("form_revision") != desired.revision:
    for name, value in desired.values.items():
        st.session_state[f"f_{name}"] = "\n".join(value) if name == "extra_args" else (
            0 if value is None and name in ("max_model_len", "max_num_batched_tokens") else value)
    st.session_state["form_revision"] = desired.revision


def edited_values() -> dict[str, Any]:
    values: dict[str, Any] = {}
    for name in desired.values:
        value = st.session_state.get(f"f_{name}")
        if name == "extra_args":
            value = [a.strip() for a in str(value or "").splitlines() if a.strip()]
        elif name in ("max_model_len", "max_num_batched_tokens") and not value:
            value = None
        values[name] = value
    return values


left, right = st.columns([3, 2], gap="large")
with left:
    st.caption(f"Desired revision **{desired.revision}** ({desired.status}) by {desired.author}, "
               f"{fmt.since(desired.created_at)}; running revision **{status.running_revision or '—'}**.")
    cpu = status.vllm_build == "cpu"
    if cpu:
        st.number_input("cpu_kv_cache_gib (memory for the KV cache)", 0.001, 4096.0, step=0.25, format="%.3f",
                        key="f_cpu_kv_cache_gib", help=help_of("cpu_kv_cache_gib"))
    st.slider("gpu_memory_utilization", 0.05, 1.0, step=0.01, key="f_gpu_memory_utilization",
              help=help_of("gpu_memory_utilization"), disabled=cpu)
    if cpu:
        st.caption("This engine runs the CPU build of vLLM: gpu_memory_utilization applies on GPU hosts only.")
    c1, c2 = st.columns(2)
    c1.number_input("max_model_len (0 = the model's maximum)", 0, 10_000_000, step=256, key="f_max_model_len",
                    help=help_of("max_model_len"))
    c2.number_input("max_num_seqs", 1, 4096, step=1, key="f_max_num_seqs", help=help_of("max_num_seqs"))
    with st.expander("Advanced"):
        st.text_input("model", key="f_model", help=help_of("model"))
        st.text_input("served_model_name", key="f_served_model_name", help=help_of("served_model_name"))
        c1, c2 = st.columns(2)
        c1.number_input("tensor_parallel_size", 1, 64, key="f_tensor_parallel_size",
                        help=help_of("tensor_parallel_size"))
        c2.number_input("max_num_batched_tokens (0 = vLLM's default)", 0, 10_000_000, step=1024,
                        key="f_max_num_batched_tokens", help=help_of("max_num_batched_tokens"))
        for name, options in CHOICES.items():
            st.selectbox(name, options, key=f"f_{name}", help=help_of(name))
        c1, c2, c3 = st.columns(3)
        c1.toggle("enforce_eager", key="f_enforce_eager", help=help_of("enforce_eager"))
        c2.toggle("enable_prefix_caching", key="f_enable_prefix_caching", help=help_of("enable_prefix_caching"))
        c3.toggle("trust_remote_code", key="f_trust_remote_code", help=help_of("trust_remote_code"))
        if not cpu:
            st.number_input("cpu_kv_cache_gib", 0.001, 4096.0, step=0.25, format="%.3f", key="f_cpu_kv_cache_gib",
                            help=help_of("cpu_kv_cache_gib"))
        st.text_area("extra_args (one flag per line)", key="f_extra_args", help=help_of("extra_args"), height=80)

values = edited_values()
changes = {k: v for k, v in values.items() if v != desired.values.get(k)}

capacity: dict[str, Any] | None
with right:
    st.subheader("Capacity preview")
    try:
        capacity = client().capacity(changes)
    except SettingsRejectedError as exc:
        capacity = None
        for field, reason in exc.fields:
            st.error(f"**{field}**: {reason}")
    except ClientError as exc:
        unreachable(exc)
    if capacity is not None:
        pred = capacity["prediction"]
        if pred:
            device_total = (capacity.get("device") or {}).get("total_bytes")
            st.plotly_chart(charts.memory_budget(pred, device_total), theme="streamlit")
            c = st.columns(3)
            c[0].metric("KV tokens", fmt.count(pred["kv_tokens"]),
                        help=f"{pred['kv_tokens']:,} tokens in {fmt.size(pred['kv_bytes'])}, "
                        f"{pred['kv_bytes_per_token']:,} bytes per token")
            c[1].metric("Concurrency", f"{pred['max_concurrency']:.1f}x",
                        help=f"requests of max_model_len ({pred['max_model_len']:,} tokens) that fit in the KV "
                        "cache at once")
            c[2].metric("Weights", fmt.size(pred["weight_bytes"]))
            st.caption(("calibrated from earlier starts on this host" if pred["calibrated"] else
                        "estimated (the first start on this host calibrates it)") if pred["device"] == "cuda" else
                       "CPU build: the KV cache is cpu_kv_cache_gib")
        for finding in capacity["errors"]:
            fit = ", ".join(f"{k} = {v}" for k, v in finding["fit"].items())
            st.error(f"**{finding['field']}**: {finding['message']}" + (f"  \nWould fit: **{fit}**" if fit else ""),
                     icon=":material/block:")
        for finding in capacity["warnings"]:
            fit = ", ".join(f"{k} = {v}" for k, v in finding["fit"].items())
            st.warning(f"**{finding['field']}**: {finding['message']}" + (f"  \nSuggested: {fit}" if fit else ""),
                       icon=":material/warning:")

st.subheader("Changes")
running_values = client().revision(status.running_revision).values if status.running_revision else {}
diff = [{"field": k, "running": running_values.get(k), "new": v} for k, v in values.items()
        if v != running_values.get(k)]
if diff:
    st.dataframe([{k: str(v) for k, v in row.items()} for row in diff], hide_index=True)
else:
    st.caption("Same values as the running revision.")
note = st.text_input("Note (why)", key="apply_note", placeholder="e.g. fewer OOMs under long prompts")


def watch(revision: int) -> None:
    """Follow the restart that applies ``revision``: its events from now on, timed from now."""
    marker = client().events(limit=1, newest_first=True)
    st.session_state["applying"] = {"revision": revision, "since": marker[0].id - 1 if marker else 0,
                                    "t0": time.time()}
    st.session_state.pop("apply_outcome", None)
    st.rerun()


def expected_downtime() -> float | None:
    ready = [e for e in client().events(kinds=["ready"], limit=1, newest_first=True) if e.data.get("startup_s")]
    return float(ready[0].data["startup_s"]) if ready else None


@st.dialog("Apply and restart vLLM?")
def confirm(changes: dict[str, Any], errors: list[dict[str, Any]]) -> None:
    downtime = expected_downtime()
    st.markdown("vLLM restarts with the new values: in-flight requests finish first, new ones wait in the "
                f"gateway's queue and are served when it is ready, in about **{fmt.seconds(downtime)}** (the last "
                "start). If it cannot start, the engine rolls back to the last revision that was ready.")
    st.json(changes)
    force = False
    if errors:
        st.error(f"Pre-flight found {len(errors)} error(s): this revision is unlikely to start.")
        force = st.checkbox("Force it anyway (recorded as forced; the rollback still applies)")
    if st.button("Apply & restart", type="primary", disabled=bool(errors) and not force):
        try:
            rev = client().put_settings(desired.revision, changes, note, force=force)
        except StaleRevisionError:
            st.error("Someone else changed the settings meanwhile: the form now shows their revision.")
            st.session_state.pop("form_revision", None)
            return
        except SettingsRejectedError as exc:
            st.error(str(exc))
            return
        watch(rev.revision)


c1, c2 = st.columns([1, 3])
if c1.button("Apply & restart", type="primary", disabled=not changes, icon=":material/restart_alt:"):
    confirm(changes, capacity["errors"] if capacity else [])
if changes and c2.button("Discard changes"):
    st.session_state.pop("form_revision", None)
    st.rerun()


@st.fragment(run_every=1)
def progress() -> None:
    applying = st.session_state.get("applying")
    if not applying:
        return
    rev_id = applying["revision"]
    events = client().events(since=applying["since"], kinds=PROGRESS_KINDS, limit=100)
    now = client().status()
    st.subheader(f"Applying revision {rev_id}")
    timeline = [f"+{max(0.0, e.ts.timestamp() - applying['t0']):.0f} s **{e.kind}** {e.message}" for e in events]
    for ev, line in zip(events, timeline, strict=True):
        icon = {"ready": ":material/check_circle:", "failed": ":material/error:", "rollback": ":material/undo:",
                "diagnosis": ":material/troubleshoot:"}.get(ev.kind, ":material/arrow_right:")
        st.markdown(f"{icon} {line}")
    rolled_back = any(e.kind == "rollback" and e.revision == rev_id for e in events)
    if now.state == "ready" and now.running_revision == rev_id:
        outcome = ("success", f"Revision {rev_id} is ready after {time.time() - applying['t0']:.0f} s.")
    elif rolled_back and now.state == "ready":
        diagnosis = next((e for e in events if e.kind == "diagnosis" and e.revision == rev_id), None)
        outcome = ("error", f"Revision {rev_id} did not start and was rolled back to revision "
                   f"{now.running_revision}." + (f"  \n**{diagnosis.data.get('kind')}**: "
                                                  f"{diagnosis.data.get('explanation')}  \nFix: "
                                                  f"{diagnosis.data.get('fix')}" if diagnosis else ""))
    else:
        st.info(f"vLLM is {now.state}: {now.reason}", icon=":material/autorenew:")
        return
    st.session_state.pop("applying")
    st.session_state["apply_outcome"] = (*outcome, timeline)
    st.rerun(scope="app")  # the whole page: state banner, form and history follow the new revision


progress()
if outcome := st.session_state.get("apply_outcome"):
    kind, message, timeline = outcome
    (st.success if kind == "success" else st.error)(message, icon=":material/check:" if kind == "success"
                                                     else ":material/undo:")
    with st.expander("Timeline of the restart"):
        st.markdown("\n".join(f"- {line}" for line in timeline))

st.subheader("History")


def diff_text(rev: RevisionInfo, parent: RevisionInfo | None) -> str:
    if parent is None:
        return "initial values"
    changed = [f"{k}: {parent.values.get(k)} → {v}" for k, v in rev.values.items() if parent.values.get(k) != v]
    return "; ".join(changed) or "same values"


history = client().history(limit=30)
by_id = {r.revision: r for r in history}
for rev in history:
    parent = by_id.get(rev.parent_revision) if rev.parent_revision else None
    if parent is None and rev.parent_revision:
        parent = client().revision(rev.parent_revision)
    label = (f"**{rev.revision}** · {rev.status} · {rev.author} · {fmt.clock(rev.created_at)}"
             + (f" · {rev.note}" if rev.note else "") + (" · forced" if rev.forced else "")
             + (f" · {rev.oom_count} OOM" if rev.oom_count else ""))
    with st.expander(label, expanded=False):
        st.markdown(f"Changes: {diff_text(rev, parent)}")
        if rev.status_reason:
            st.caption(f"Status: {rev.status_reason}")
        for w in rev.warnings:
            st.caption(f"{w.get('severity', 'warning')}: {w.get('message')}")
        if rev.revision != desired.revision and st.button(f"Roll back to revision {rev.revision}",
                                                          key=f"rollback_{rev.revision}"):
            try:
                new = client().rollback(rev.revision, f"rollback to revision {rev.revision} from the console")
            except ClientError as exc:
                st.error(str(exc))
            else:
                watch(new.revision)
