"""Engine settings: change the three memory knobs (and the rest), see the capacity before applying, apply with a
safe restart and watch it, and browse or roll back the history of revisions.

The form always starts from the desired revision: on the first visit, on every return to the page (Streamlit
drops a page's widget state when another page is shown) and whenever the desired revision changes. "Changes"
lists only what the user edited in it."""

from __future__ import annotations

from typing import Any

import streamlit as st

from console import charts, fmt
from console.deployment import scope
from console.restart import last_outcome, plan_box, plan_eta_text, progress, watch
from console.widgets import client, deployment_header, engine_status, kept_expander, restart_banner, unreachable
from engine.client import ClientError, SettingsRejectedError, StaleRevisionError
from engine.schemas import CapacityOut, Finding, FitValue, RestartEta, RevisionOut

st.title("Engine settings")
here = deployment_header("the form, the apply and the history are its own").name or ""
CHOICES = {"dtype": ["auto", "bfloat16", "float16", "float32"],
           "kv_cache_dtype": ["auto", "float16", "bfloat16", "fp8", "fp8_e4m3", "fp8_e5m2"],
           "load_format": ["auto", "safetensors", "pt", "dummy", "gguf", "bitsandbytes", "fastsafetensors",
                           "sharded_state", "runai_streamer"]}
OPTIONAL = ("max_model_len", "max_num_batched_tokens", "max_num_seqs_ceiling", "max_replicas")  # empty (None) is 0
OPTIONAL_FLOATS = ("target_in_flight", "target_queue_wait_s", "scale_to_zero_after_s")  # empty (None): 0.0

try:
    status = engine_status()
    desired = client().settings()
    desired_values = desired.values.model_dump()
    schema = client().settings_schema()["properties"]
except ClientError as exc:
    unreachable(exc)
restart_banner(status)


def help_of(name: str) -> str:
    return str(schema.get(name, {}).get("description", ""))


FLOATS = ("gpu_memory_utilization", "cpu_kv_cache_gib", "scale_up_delay_s", "scale_down_delay_s")  # a widget wants
INTS = ("max_num_seqs", "tensor_parallel_size", "replicas", "min_replicas")  # its bounds' type (JSON: 1 for 1.0)


def to_widget(name: str, value: Any) -> Any:
    if name == "extra_args":
        return "\n".join(value or [])
    if name in OPTIONAL:
        return int(value or 0)
    if name in OPTIONAL_FLOATS:
        return float(value or 0.0)
    if name in FLOATS:
        return float(value)
    return int(value) if name in INTS else value


def from_widget(name: str, value: Any) -> Any:
    if name == "extra_args":
        return [a.strip() for a in str(value or "").splitlines() if a.strip()]
    if name in OPTIONAL:
        return int(value) if value else None
    if name in OPTIONAL_FLOATS:
        return float(value) if value else None
    if isinstance(value, float):
        return round(value, 6)  # a slider's step arithmetic (0.05 + 80 x 0.01) is not an edit
    return value


# Each widget is created with its starting value as its default (no flash of a widget's minimum before the value
# arrives, as seeding Session State gives). Its key names the desired revision and a per-field generation: a new
# revision, "use this value" or "discard" makes a new widget, so the form starts from the desired revision again.
# One form per deployment: another deployment's edits or suggestions never show in this one's fields.
form = st.session_state.setdefault(f"settings_form@{here}", {"revision": None, "gens": {}, "overrides": {},
                                                               "edits": {}})
if form["revision"] != desired.revision:
    # a new desired revision: the form starts from it. Edits not yet applied were made on the revision before; when
    # someone else wrote this one, they are kept aside and offered back, not wiped unseen (issue 31)
    if form["revision"] is not None and form.get("edits") and not st.session_state.get(f"applying{scope()}"):
        st.session_state[f"settings_lost@{here}"] = (form["revision"], dict(form["edits"]))
    form.update(revision=desired.revision, gens={}, overrides={}, edits={})
if st.session_state.get("apply_note_of") != here:  # a note written for another deployment is not this one's
    st.session_state["apply_note_of"] = here
    st.session_state["clear_note"] = True
if st.session_state.pop("clear_note", False):
    st.session_state["apply_note"] = ""


def key(name: str) -> str:
    return f"f_{name}_{here}_{form['revision']}_{form['gens'].get(name, 0)}"


def start(name: str) -> Any:
    """The value a field's widget starts from: the desired revision's, or a suggestion the user took."""
    return to_widget(name, form["overrides"].get(name, desired_values.get(name)))


def use_value(field: str, value: FitValue) -> None:
    """A suggestion's "use this value": that field's widget is made again, starting from it."""
    form["overrides"][field] = value
    form["gens"][field] = form["gens"].get(field, 0) + 1


def discard() -> None:
    form["overrides"] = {}
    form["gens"] = {name: form["gens"].get(name, 0) + 1 for name in desired_values}


left, right = st.columns([3, 2], gap="large")
cpu = status.vllm_build == "cpu"
with left:
    st.caption(f"Desired revision **{desired.revision}** ({desired.status}) by {desired.author}, "
               f"{fmt.since(desired.created_at)}; vLLM runs revision **{status.running_revision or '—'}**.")
    if cpu:
        st.number_input("cpu_kv_cache_gib (memory for the KV cache)", 0.001, 4096.0, start("cpu_kv_cache_gib"),
                        step=0.25, format="%.3f", key=key("cpu_kv_cache_gib"), help=help_of("cpu_kv_cache_gib"))
    st.slider("gpu_memory_utilization", 0.05, 1.0, start("gpu_memory_utilization"), step=0.01,
              key=key("gpu_memory_utilization"), help=help_of("gpu_memory_utilization"), disabled=cpu)
    if cpu:
        st.caption("This engine runs the CPU build of vLLM: gpu_memory_utilization applies on GPU hosts only.")
    c1, c2 = st.columns(2)
    c1.number_input("max_model_len (0 = the model's maximum)", 0, 10_000_000, start("max_model_len"), step=256,
                    key=key("max_model_len"), help=help_of("max_model_len"))
    c2.number_input("max_num_seqs", 1, 4096, start("max_num_seqs"), step=1, key=key("max_num_seqs"),
                    help=help_of("max_num_seqs"))
    c1, c2 = st.columns(2)
    routes = ["prefix", "least_outstanding"]
    c1.selectbox("routing (among instances)", routes, routes.index(start("routing")) if start("routing") in routes
                 else 0, key=key("routing"), help=help_of("routing"))
    c2.number_input("max_num_seqs_ceiling (0 = max_num_seqs: no headroom)", 0, 4096, start("max_num_seqs_ceiling"),
                    step=1, key=key("max_num_seqs_ceiling"), help=help_of("max_num_seqs_ceiling"))
    with kept_expander("Replicas, autoscaling and scale to zero", f"replicas_{here}"):
        c1, c2, c3 = st.columns(3)
        c1.number_input("replicas (at start, when autoscaled)", 1, 16, start("replicas"), key=key("replicas"),
                        help=help_of("replicas"))
        c2.number_input("min_replicas", 1, 16, start("min_replicas"), key=key("min_replicas"),
                        help=help_of("min_replicas"))
        c3.number_input("max_replicas (0 = no autoscaling)", 0, 16, start("max_replicas"), key=key("max_replicas"),
                        help=help_of("max_replicas"))
        c1, c2, c3 = st.columns(3)
        c1.number_input("target_in_flight (0 = 0.75 x max_num_seqs)", 0.0, 4096.0, start("target_in_flight"),
                        step=1.0, key=key("target_in_flight"), help=help_of("target_in_flight"))
        c2.number_input("scale_up_delay_s", 0.0, 3600.0, start("scale_up_delay_s"), step=5.0,
                        key=key("scale_up_delay_s"), help=help_of("scale_up_delay_s"))
        c3.number_input("scale_down_delay_s", 0.0, 86_400.0, start("scale_down_delay_s"), step=10.0,
                        key=key("scale_down_delay_s"), help=help_of("scale_down_delay_s"))
        c1, c2 = st.columns(2)
        c1.number_input("target_queue_wait_s (0 = scale on in-flight)", 0.0, 3600.0, start("target_queue_wait_s"),
                        step=0.5, key=key("target_queue_wait_s"), help=help_of("target_queue_wait_s"))
        c2.number_input("scale_to_zero_after_s (0 = never)", 0.0, 604_800.0, start("scale_to_zero_after_s"),
                        step=60.0, key=key("scale_to_zero_after_s"), help=help_of("scale_to_zero_after_s"))
        if cpu:
            st.caption("On the CPU build an idle deployment scaled to zero stops: its next request waits for a cold "
                       "start (the status says how long one takes here). With CUDA and sleep mode it sleeps, and "
                       "wakes in about a second.")
    with kept_expander("Advanced", f"advanced_{here}"):
        st.text_input("model", start("model"), key=key("model"), help=help_of("model"))
        st.text_input("served_model_name", start("served_model_name"), key=key("served_model_name"),
                      help=help_of("served_model_name"))
        c1, c2 = st.columns(2)
        c1.number_input("tensor_parallel_size", 1, 64, start("tensor_parallel_size"),
                        key=key("tensor_parallel_size"), help=help_of("tensor_parallel_size"))
        c2.number_input("max_num_batched_tokens (0 = vLLM's default)", 0, 10_000_000,
                        start("max_num_batched_tokens"), step=1024, key=key("max_num_batched_tokens"),
                        help=help_of("max_num_batched_tokens"))
        for name, options in CHOICES.items():
            value = start(name)
            st.selectbox(name, options, options.index(value) if value in options else 0, key=key(name),
                         help=help_of(name))
        c1, c2, c3 = st.columns(3)
        for col, name in zip((c1, c2, c3), ("enforce_eager", "enable_prefix_caching", "trust_remote_code"),
                             strict=True):
            col.toggle(name, bool(start(name)), key=key(name), help=help_of(name))
        if not cpu:
            st.number_input("cpu_kv_cache_gib", 0.001, 4096.0, start("cpu_kv_cache_gib"), step=0.25, format="%.3f",
                            key=key("cpu_kv_cache_gib"), help=help_of("cpu_kv_cache_gib"))
        st.text_area("extra_args (one flag per line)", start("extra_args"), key=key("extra_args"),
                     help=help_of("extra_args"), height=80)

values = {name: from_widget(name, st.session_state.get(key(name), start(name))) for name in desired_values}
changes = {k: v for k, v in values.items() if v != desired_values.get(k)}
form["edits"] = changes  # what would be offered back if someone else's revision replaced the one they were made on


def take_back(edits: dict[str, Any]) -> None:
    """The edits kept aside, back in the form (each field's widget made again from it)."""
    for field_name, value in edits.items():
        use_value(field_name, value)
    st.session_state.pop(f"settings_lost@{here}", None)


if lost := st.session_state.get(f"settings_lost@{here}"):
    based_on, edits = lost
    st.warning(f"Revision **{desired.revision}** by {desired.author} replaced revision {based_on}, on which you had "
               "edits not applied: " + ", ".join(f"{k} = {v}" for k, v in edits.items()) + ". The form shows "
               f"revision {desired.revision} now.", icon=":material/group:")
    k1, k2 = st.columns([1, 4])
    k1.button("Put my edits back", on_click=take_back, args=(edits,), icon=":material/undo:")
    if k2.button("Dismiss"):
        st.session_state.pop(f"settings_lost@{here}", None)
        st.rerun()


def finding(kind: str, i: int, f: Finding) -> None:
    box = st.error if kind == "errors" else st.warning
    box(f"**{f.field}**: {f.message}", icon=":material/block:" if kind == "errors" else ":material/warning:")
    for field, value in f.fit.items():
        if field in values and values[field] != value:
            st.button(f"Use {field} = {value}", key=f"use_{kind}_{i}_{field}", on_click=use_value,
                      args=(field, value), icon=":material/auto_fix_high:")


def fixes_for(field: str, values: dict[str, Any]) -> dict[str, Any]:
    """The values that would make a refused field valid, where the engine's rule is known here: a max_num_seqs
    above its ceiling raises the ceiling to it (headroom kept) — or, for the ceiling itself, the same."""
    seqs, ceiling = values.get("max_num_seqs"), values.get("max_num_seqs_ceiling")
    if field == "max_num_seqs_ceiling" and isinstance(seqs, int) and isinstance(ceiling, int) and ceiling < seqs:
        return {"max_num_seqs_ceiling": seqs}
    return {}


rejected: list[str] = []  # fields the engine refused: nothing can be applied until they are fixed
capacity: CapacityOut | None = None
with right:
    st.subheader("Capacity preview")
    try:
        capacity = client().capacity(changes)
    except SettingsRejectedError as exc:
        rejected = [field for field, _ in exc.fields]
        for i, (field, reason) in enumerate(exc.fields):
            st.error(f"**{field}**: {reason}", icon=":material/block:")
            for fix_field, fix in fixes_for(field, values).items():  # the fix, as a button (not a dead end)
                st.button(f"Use {fix_field} = {fix}", key=f"fix_{i}_{fix_field}", on_click=use_value,
                          args=(fix_field, fix), icon=":material/auto_fix_high:")
        st.caption("No figures: these values cannot be saved, so nothing is computed from them.")
    except ClientError as exc:
        unreachable(exc)
    if capacity is not None:
        pred = capacity.prediction
        if pred:
            device_total = capacity.device.total_bytes if capacity.device else None
            st.plotly_chart(charts.memory_budget(pred, device_total), theme="streamlit")
            c = st.columns(3)
            c[0].metric("KV tokens", fmt.count(pred.kv_tokens),
                        help=f"{pred.kv_tokens:,} tokens in {fmt.size(pred.kv_bytes)}, "
                        f"{pred.kv_bytes_per_token:,} bytes per token")
            seqs = values.get("max_num_seqs")
            held = isinstance(seqs, int) and seqs < pred.max_concurrency
            c[1].metric("Concurrency", str(seqs) if held else fmt.times(pred.max_concurrency),  # (a longer label
                        # is cut in its column at laptop widths: the help says which bound it is)
                        help=(f"requests that run at once: at most max_num_seqs ({seqs}); the KV cache would hold "
                              f"{fmt.times(pred.max_concurrency)} requests of max_model_len ({pred.max_model_len:,} "
                              "tokens)") if held else
                        f"requests of max_model_len ({pred.max_model_len:,} tokens) that fit in the KV cache at once "
                        f"(max_num_seqs, {seqs}, allows more)")
            c[2].metric("Weights", fmt.size(pred.weight_bytes))
            st.caption(("calibrated from earlier starts on this host" if pred.calibrated else
                        "estimated (the first start on this host calibrates it)") if pred.device == "cuda" else
                       "CPU build: the KV cache is cpu_kv_cache_gib")
        elif capacity.errors:
            st.caption("No figures until the errors below are fixed: they would describe settings that cannot "
                       "start.")
        for kind, findings in (("errors", capacity.errors), ("warnings", capacity.warnings)):
            for i, f in enumerate(findings):
                finding(kind, i, f)

st.subheader("Changes")
if changes:
    st.dataframe([{"field": k, f"revision {desired.revision}": str(desired_values.get(k)), "new": str(v)}
                  for k, v in changes.items()], hide_index=True)
else:
    st.caption(f"No edits: the form shows desired revision {desired.revision}.")
if status.running_revision and status.running_revision != desired.revision:
    st.caption(f"vLLM still runs revision {status.running_revision}; revision {desired.revision} is being applied.")
note = st.text_input("Note (why)", key="apply_note", placeholder="e.g. fewer OOMs under long prompts")
eta = capacity.restart_eta if capacity else None


def eta_text(eta: RestartEta | None = eta) -> str:
    return f"about **{fmt.seconds(eta.seconds)}**" if eta else "an unknown time (no earlier start to go by)"


def plan_and_eta(cap: CapacityOut | None) -> None:
    """The plan an apply of these values will run (from the engine's pre-flight of them), with its ETA and what
    clients should expect; what follows a failed start."""
    plan = cap.plan if cap is not None else None
    if plan is None:
        if rejected:  # the values themselves were refused: that is the reason, not the device or the model
            st.error(f"The engine refuses these values ({', '.join(rejected)}): fix them in the form first.",
                     icon=":material/block:")
            return
        st.warning("The engine gave no plan for these values (it could not read the device or the model): vLLM "
                   f"restarts with them, in {eta_text(cap.restart_eta if cap else None)}.", icon=":material/help:")
        return
    if plan.kind == "soft":
        st.markdown("The instances that serve take the new values on now, **without a restart**, by this plan:")
        plan_box(plan)
        return
    st.markdown("vLLM restarts with the new values, by this plan:")
    plan_box(plan)
    if "max_num_seqs" in changes and set(changes) <= {"max_num_seqs", "max_num_seqs_ceiling"}:
        st.caption("A max_num_seqs within max_num_seqs_ceiling takes effect without a restart: set a ceiling (one "
                   "restart now) and later changes below it are in effect at once.")
    st.caption("If the new revision cannot start, it is rejected and diagnosed"
               + (", and traffic stays on what serves now." if plan.kind not in ("pause", "start") else
                  "; the engine goes back to the last revision that was ready."))


@st.dialog("Apply these settings?")
def confirm_apply(changes: dict[str, Any], cap: CapacityOut | None) -> None:
    plan_and_eta(cap)
    st.dataframe([{"field": k, "now": str(desired_values.get(k)), "new": str(v)} for k, v in changes.items()],
                 hide_index=True)
    errors = cap.errors if cap else []
    force = False
    if errors:
        st.error(f"Pre-flight found {len(errors)} error(s): this revision is unlikely to start.")
        force = st.checkbox("Force it anyway (recorded as forced; the rollback still applies)")
    soft = cap is not None and cap.plan is not None and cap.plan.kind == "soft"
    if st.button("Apply now" if soft else "Apply & restart", type="primary", disabled=bool(errors) and not force):
        try:
            rev = client().put_settings(desired.revision, changes, note, force=force)
        except StaleRevisionError:
            st.error("Someone else changed the settings meanwhile: close this and review their revision first.")
            return
        except SettingsRejectedError as exc:
            st.error(str(exc))
            return
        watch(rev.revision, "Applying")


def preflight_of(rev: RevisionOut) -> CapacityOut | None:
    """Pre-flight of an earlier revision's values against this device now (None when the engine refuses to
    compute it: the values do not validate any more); kept for this desired revision."""
    cache: dict[tuple[int, int], CapacityOut | None] = st.session_state.setdefault(f"rollback_checks@{here}", {})
    key = (rev.revision, desired.revision)
    if key not in cache:
        try:
            cache[key] = client().capacity(rev.values.model_dump())
        except SettingsRejectedError:
            cache[key] = None
        except ClientError as exc:
            unreachable(exc)
    return cache[key]


def refusal(rev: RevisionOut) -> str | None:
    """Why the engine would refuse a rollback to ``rev`` (pre-flight errors on its values now), or None."""
    cap = preflight_of(rev)
    if cap is None:
        return "its values are no longer valid settings"
    return "; ".join(f"{e.field}: {e.message}" for e in cap.errors) or None


@st.dialog("Roll back?")
def confirm_rollback(target: RevisionOut) -> None:
    diff = [{"field": k, "now": str(desired_values.get(k)), "after": str(v)}
            for k, v in target.values.model_dump().items() if desired_values.get(k) != v]
    st.markdown(f"A new revision with the values of revision **{target.revision}** becomes the desired one.")
    if target.status == "rejected":
        st.warning(f"Revision {target.revision} was rejected: {target.status_reason or 'it did not start'}. "
                   "Rolling back to it runs the same values again.", icon=":material/warning:")
    cap = preflight_of(target)
    plan_and_eta(cap)
    if diff:
        st.dataframe(diff, hide_index=True)
    else:
        st.caption(f"Revision {target.revision} has the same values as desired revision {desired.revision}.")
    errors = cap.errors if cap is not None else []
    force = False
    for f in errors:
        st.error(f"**{f.field}**: {f.message}", icon=":material/block:")
    if errors:  # the engine refuses these values unless forced: said before the confirmation, not after
        force = st.checkbox("Force it anyway (recorded as forced; the rollback still applies)", key="rb_force")
    if st.button(f"Roll back to revision {target.revision}", type="primary",
                 disabled=cap is None or (bool(errors) and not force)):
        try:
            new = client().rollback(target.revision, f"rollback to revision {target.revision} from the console",
                                    force=force)
        except ClientError as exc:
            st.error(str(exc))
            return
        watch(new.revision, f"Rolling back to revision {target.revision}: applying")


c1, c2, c3 = st.columns([1, 1, 3], vertical_alignment="center")
soft_now = bool(changes) and capacity is not None and capacity.plan is not None and capacity.plan.kind == "soft"
if c1.button("Apply now" if soft_now else "Apply & restart", type="primary", disabled=not changes or bool(rejected),
             icon=":material/restart_alt:", help="Fix the refused fields first (see the capacity preview)"
             if rejected else None):
    confirm_apply(changes, capacity)
c2.button("Discard changes", disabled=not changes, on_click=discard)
plan_now = capacity.plan if capacity else None
c3.caption((f"By plan {plan_now.kind.replace('_', '/')}: {plan_eta_text(plan_now)}" if plan_now is not None else
            f"A restart with these values takes {eta_text()}.") if changes else "")

progress((status.running_revision, str(status.state)))
last_outcome()

st.subheader("History")


def diff_text(rev: RevisionOut, parent: RevisionOut | None) -> str:
    if parent is None:
        return "initial values"
    before = parent.values.model_dump()
    changed = [f"{k}: {before.get(k)} → {v}" for k, v in rev.values.model_dump().items() if before.get(k) != v]
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
    with kept_expander(label, f"history_{here}_{rev.revision}"):
        st.markdown(f"Changes: {diff_text(rev, parent)}")
        if rev.status_reason:
            st.caption(f"Status: {rev.status_reason}")
        for w in rev.warnings:
            st.caption(f"{w.severity or 'warning'}: {w.message}")
        if rev.revision == desired.revision:
            continue
        refused = refusal(rev) if rev.status == "rejected" or rev.forced else None
        if refused:  # the engine would refuse it after the confirmation: not offered
            st.caption(f"No rollback to revision {rev.revision}: pre-flight refuses its values now ({refused}). "
                       "Edit the form above instead, or force it with `llmops settings rollback "
                       f"{rev.revision} --force`.")
        elif st.button(f"Roll back to revision {rev.revision}", key=f"rollback_{rev.revision}"):
            confirm_rollback(rev)
