"""Deployments: the models this engine serves, each under its own name (the ``model`` clients send): their state,
replicas, placement and the memory they hold; their LoRA adapters (registered, loaded where, their requests); create
one from a model the engine finds; enable, disable, delete (saying first what a delete removes, and asking for the
name); open one in the other pages."""

from __future__ import annotations

import time
from typing import Any

import streamlit as st

from console import deployment, fmt
from console.widgets import (
    base_client,
    deployment_label,
    engine_status,
    kept_expander,
    me,
    open_link,
    own_rerun,
    unreachable,
)
from engine.client import ApiError, ClientError, InvalidRequestError
from engine.schemas import ROLES, DeploymentOut

st.title("Deployments")
base = base_client()
try:
    rows = base.deployments()
    found = base.models()
except ClientError as exc:
    unreachable(exc)
# deleted from this page: the engine's list may show one for a second more, while its registry stops it
deleted: dict[str, float] = st.session_state.setdefault("dep_deleted", {})
rows = [r for r in rows if time.monotonic() - deleted.get(r.name, -60.0) > 10]
who = me()
operator = ROLES.index(who.role) >= ROLES.index("operator")
cpu = engine_status().vllm_build == "cpu"
if flash := st.session_state.pop("dep_flash", None):
    st.success(flash, icon=":material/check_circle:")


def placement(row: DeploymentOut) -> str:
    if row.gpus:
        return "GPU " + ", ".join(map(str, row.gpus))
    return "the host (CPU build)" if cpu else "any GPU (placed by the capacity model)"


def memory(row: DeploymentOut) -> str:
    if not row.memory:
        return "—"
    return ", ".join(f"{'host' if m.device == 'host' else 'GPU ' + m.device}: {fmt.gib(m.bytes, 2)}"
                     for m in row.memory)


def drawn_as(listed: list[DeploymentOut]) -> tuple[tuple[str, str, bool, int], ...]:
    return tuple((r.name, str(r.state), r.enabled, r.serving) for r in listed
                 if time.monotonic() - deleted.get(r.name, -60.0) > 10)


@st.fragment(run_every=2)
def follow(drawn: tuple[tuple[str, str, bool, int], ...]) -> None:
    """The page as drawn against the engine's list now: a deployment that became ready, stopped, or went is
    drawn again without a reload (a new one showed "starting" until someone reloaded, issue 31)."""
    if not own_rerun():
        return
    try:
        now = drawn_as(base.deployments())
    except ClientError:
        return  # the page said so when it was drawn; the next poll tries again
    if now != drawn:
        if flash:  # the page redraws itself, not at anyone's action: what the last action said stays said
            st.session_state["dep_flash"] = flash
        st.rerun(scope="app")


follow(drawn_as(rows))
st.dataframe([{"name": r.name + (" (default)" if r.default else ""), "model": r.model or "—", "state": r.state,
               "enabled": r.enabled, "replicas": f"{r.serving} serving of {r.instances}",
               "revision": str(r.running_revision or "—"), "placement": placement(r), "memory held": memory(r),
               "reason": r.reason} for r in rows], hide_index=True, width="stretch")
st.caption("Memory held: what the deployment's vLLM processes hold now (on the host for the CPU build, per GPU on "
           "a GPU host). A request's `model` picks the deployment of that name.")

st.subheader("Each deployment")


def set_enabled(name: str, enabled: bool) -> None:
    try:
        base.update_deployment(name, enabled=enabled)
    except ClientError as exc:
        st.session_state["dep_flash_error"] = f"Could not {'enable' if enabled else 'disable'} {name}: {exc}"
        return
    st.session_state["dep_flash"] = (f"Enabled **{name}**: it starts within seconds." if enabled else
                                     f"Disabled **{name}**: it drains and stops; requests for it get 503.")
    st.session_state.pop(deployment.RESOLVED, None)


if error := st.session_state.pop("dep_flash_error", None):
    st.error(error, icon=":material/error:")
for row in rows:
    with st.container(border=True):
        c = st.columns([3, 2, 2, 2], vertical_alignment="center")
        c[0].markdown(f"**{row.name}** · {row.state}" + ("" if row.enabled else " · disabled")
                      + f"  \n{row.model or 'no model'}")
        open_link("overview", "Open", row.name, icon=":material/open_in_new:", where=c[1],
                  help=f"opens the Overview of {row.name}; the other pages act on it from then on")
        if not row.enabled and st.session_state.get("dep_disabling") == row.name:
            st.session_state.pop("dep_disabling", None)  # disabled meanwhile (elsewhere): nothing to confirm
        if row.enabled:  # it stops serving as surely as Delete: confirmed first, as Delete is
            if c[2].button("Disable…", key=f"dep_disable_{row.id}", disabled=not operator,
                           icon=":material/stop_circle:",
                           help="drains it and stops its instances; its settings and history stay"):
                st.session_state["dep_disabling"] = row.name
            if st.session_state.get("dep_disabling") == row.name:
                st.warning(f"Disabling **{row.name}** drains it and stops its instances: requests for "
                           f"`{row.name}` get 503 until it is enabled again"
                           + (" — it is the default deployment, which today's /api routes and clients that send "
                              "no model use." if row.default else "."), icon=":material/stop_circle:")
                e1, e2 = st.columns([1, 4])
                if e1.button("Disable now", type="primary", key=f"dep_disable_go_{row.id}"):
                    st.session_state.pop("dep_disabling", None)
                    set_enabled(row.name, False)
                    st.rerun()
                if e2.button("Cancel", key=f"dep_disable_cancel_{row.id}"):
                    st.session_state.pop("dep_disabling", None)
                    st.rerun()
        else:
            c[2].button("Enable", key=f"dep_enable_{row.id}", disabled=not operator, on_click=set_enabled,
                        args=(row.name, True), icon=":material/play_circle:")
        if c[3].button("Delete…", key=f"dep_delete_{row.id}", disabled=not operator or row.default,
                       icon=":material/delete:",
                       help="the default deployment cannot be deleted" if row.default else None):
            st.session_state["dep_deleting"] = row.name
        if st.session_state.get("dep_deleting") == row.name:
            try:
                gone = base.deletion(row.name)
            except ClientError as exc:
                unreachable(exc)
            st.warning(f"Deleting **{row.name}** stops its instances and removes {gone.revisions} revision(s), "
                       f"{gone.events} event(s), {gone.benchmarks} benchmark run(s) and {gone.requests} logged "
                       "request(s). The audit log keeps its records. This cannot be undone.",
                       icon=":material/delete_forever:")
            typed = st.text_input(f"Type {row.name} to confirm", key=f"dep_confirm_{row.id}")
            d1, d2 = st.columns([1, 4])
            if d1.button("Delete for good", type="primary", key=f"dep_delete_go_{row.id}",
                         disabled=typed != row.name):
                try:
                    base.delete_deployment(row.name, confirm=typed)
                except ClientError as exc:
                    st.error(f"Not deleted: {exc}", icon=":material/error:")
                else:
                    st.session_state.pop("dep_deleting", None)
                    deleted[row.name] = time.monotonic()
                    st.session_state["dep_flash"] = f"Deleted **{row.name}**."
                    if st.session_state.get(deployment.CHOSEN) == row.name:
                        deployment.choose(None)
                    st.rerun()
            if d2.button("Cancel", key=f"dep_delete_cancel_{row.id}"):
                st.session_state.pop("dep_deleting", None)
                st.rerun()

with kept_expander("Prices (usage you can bill)", "deployments_prices"):
    st.caption("What 1,000 tokens cost on each deployment: the Usage page and GET /api/usage price every key's, "
               "team's and day's tokens by them. 0 clears a price.")
    with st.form("dep_prices"):
        priced = st.selectbox("Deployment", [r.name for r in rows], key="price_dep")
        current = next((r for r in rows if r.name == priced), None)
        p1, p2 = st.columns(2)
        price_in = p1.number_input("Prompt tokens, per 1,000", 0.0, 1e6, float(
            (current.price_input_per_1k or 0.0) if current else 0.0), format="%.6f", key=f"price_in_{priced}")
        price_out = p2.number_input("Completion tokens, per 1,000", 0.0, 1e6, float(
            (current.price_output_per_1k or 0.0) if current else 0.0), format="%.6f", key=f"price_out_{priced}")
        if st.form_submit_button("Save prices", disabled=not operator) and priced:
            try:
                base.update_deployment(priced, price_input_per_1k=price_in or None,
                                       price_output_per_1k=price_out or None)
            except ClientError as exc:
                st.error(f"Prices not saved: {exc}", icon=":material/error:")
            else:
                st.toast(f"Prices of {priced} saved")

st.subheader("LoRA adapters")
st.caption("Fine-tunes served beside a deployment's model: each is a model name on /v1 (listed with its base), "
           "loaded live on every instance, kept by applies and restarts. A deployment serves adapters once its "
           "settings have enable_lora (vLLM's LoRA slots are fixed at start: max_loras, max_lora_rank).")
names = [r.name for r in rows]
if names:
    if st.session_state.get("lora_dep") not in names:
        st.session_state["lora_dep"] = st.session_state.get(deployment.CHOSEN) if \
            st.session_state.get(deployment.CHOSEN) in names else names[0]
    of = st.selectbox("Deployment", names, key="lora_dep")
    try:
        listed = base.adapters(of)
    except ClientError as exc:
        unreachable(exc)
    if listed:
        st.dataframe([{"adapter": a.name, "rank": a.rank, "alpha": f"{a.alpha:g}",
                       "target modules": ", ".join(a.target_modules),
                       "loaded on": ", ".join(a.loaded_on) or ("not yet" if a.listed else "—"),
                       "requests (24 h)": a.requests_24h, "tokens in / out (24 h)":
                       f"{fmt.count(a.input_tokens_24h)} / {fmt.count(a.output_tokens_24h)}",
                       "errors (24 h)": a.errors_24h, "folder": a.path,
                       "registered": f"{a.created_at:%Y-%m-%d %H:%M} by {a.created_by}"} for a in listed],
                     hide_index=True, width="stretch")
        for a in listed:
            if a.failure:
                st.warning(f"**{a.name}** did not load on an instance: {a.failure} (tried again every few seconds)",
                           icon=":material/warning:")
        r1, r2 = st.columns([3, 1], vertical_alignment="bottom")
        removing = r1.selectbox("Adapter to remove", [a.name for a in listed], key=f"lora_remove_{of}")
        if r2.button("Remove", key=f"lora_remove_go_{of}", disabled=not operator, icon=":material/delete:",
                     help="its name leaves /v1 at once; each instance unloads it (no restart)"):
            try:
                base.remove_adapter(of, str(removing))
            except ClientError as exc:
                st.error(f"Not removed: {exc}", icon=":material/error:")
            else:
                st.session_state["dep_flash"] = f"Removed adapter **{removing}** of {of}."
                st.rerun()
    else:
        st.caption(f"No adapter is registered under **{of}**.")
    if not operator:
        st.caption(f"Registering an adapter needs the operator role; you are {who.name} ({who.role}).")
    else:
        if st.session_state.pop("lora_registered", False):  # a new form after a registration (before its widgets)
            st.session_state["lora_name"] = st.session_state["lora_path"] = ""
        with st.form("lora_register", border=True):
            f1, f2 = st.columns([1, 2])
            lora_name = f1.text_input("Adapter name (the model clients send)", key="lora_name", max_chars=128,
                                      placeholder="e.g. support-tuned")
            lora_path = f2.text_input("Folder (PEFT: adapter_config.json and adapter_model.safetensors)",
                                      key="lora_path", max_chars=4096,
                                      placeholder="models/my-adapter, under a model root")
            add = st.form_submit_button("Register", type="primary", icon=":material/add:")
        if add:
            try:
                made_adapter = base.register_adapter(of, str(lora_name).strip(), str(lora_path).strip())
            except InvalidRequestError as exc:
                for field, reason in exc.fields:
                    st.error(f"**{field}**: {reason}", icon=":material/block:")
            except ApiError as exc:
                st.error(f"Not registered: {exc.detail}", icon=":material/block:")
            except ClientError as exc:
                unreachable(exc)
            else:
                st.session_state["dep_flash"] = (
                    f"Registered **{made_adapter.name}** (rank {made_adapter.rank}) under {of}: "
                    + (f"loaded on {', '.join(made_adapter.loaded_on)}." if made_adapter.loaded_on else
                       "its instances start with it."))
                st.session_state["lora_registered"] = True
                st.rerun()

st.subheader("Create a deployment")
if not operator:
    st.caption(f"Creating a deployment needs the operator role; you are {who.name} ({who.role}).")
elif not found.models:
    st.info("No model found: put a model folder (with its config.json) under one of the model roots ("
            + ", ".join(f"`{r}`" for r in found.roots) + "), or download one into the Hugging Face cache.",
            icon=":material/folder_off:")
else:
    options = {m.value: m for m in found.models}

    def model_label(value: str) -> str:
        m = options[value]
        extra = [m.source, m.architecture or "", f"{fmt.count(m.parameters)} parameters" if m.parameters else "",
                 f"served by {', '.join(m.used_by)}" if m.used_by else ""]
        return f"{value} ({', '.join(e for e in extra if e)})"

    if st.session_state.pop("dep_created", False):  # a new form after a creation (before its widgets)
        st.session_state["dep_name"] = ""
    with st.form("dep_create", border=True):
        name = st.text_input("Name (the model clients send)", key="dep_name", max_chars=128,
                             placeholder="e.g. small", help="letters, digits and . _ : / -")
        model = st.selectbox("Model", list(options), format_func=model_label, key="dep_model")
        f = st.columns(3)
        seqs = f[0].number_input("max_num_seqs", 1, 4096, 4, key="dep_seqs")
        replicas = f[1].number_input("replicas", 1, 64, 1, key="dep_replicas")
        if cpu:
            memory_value = f[2].number_input("cpu_kv_cache_gib (memory for the KV cache)", 0.001, 4096.0, 0.25,
                                             step=0.25, format="%.3f", key="dep_kv")
        else:
            memory_value = f[2].slider("gpu_memory_utilization", 0.05, 1.0, 0.4, step=0.01, key="dep_gmu")
        gpus_text = "" if cpu else st.text_input("GPUs (indices, comma-separated; empty: placed by the capacity "
                                                 "model)", key="dep_gpus")
        enabled = st.toggle("Start it now", True, key="dep_enabled")
        submitted = st.form_submit_button("Create", type="primary", icon=":material/add:")
    if submitted:
        values: dict[str, Any] = {"model": model, "max_num_seqs": int(seqs), "replicas": int(replicas),
                                  ("cpu_kv_cache_gib" if cpu else "gpu_memory_utilization"): float(memory_value)}
        gpus: list[int] | None = None
        try:
            gpus = [int(g) for g in str(gpus_text).replace(" ", "").split(",") if g] or None
        except ValueError:
            st.error("**gpus**: GPU indices are whole numbers, comma-separated (e.g. `0, 1`).",
                     icon=":material/block:")
        else:
            try:
                deleted.pop(str(name).strip(), None)  # a name deleted earlier can be taken again
                made = base.create_deployment(str(name).strip(), values, gpus=gpus, enabled=bool(enabled))
            except InvalidRequestError as exc:
                for field, reason in exc.fields:
                    st.error(f"**{field}**: {reason}", icon=":material/block:")
            except ApiError as exc:
                st.error(f"Not created: {exc.detail}", icon=":material/block:")
            except ClientError as exc:
                unreachable(exc)
            else:
                for w in made.warnings:
                    st.warning(str(w.get("message", w)), icon=":material/warning:")
                st.session_state["dep_flash"] = (f"Created **{made.name}** (revision {made.revision})"
                                                 + (": it is starting." if made.enabled else ", disabled."))
                st.session_state.pop(deployment.RESOLVED, None)
                st.session_state["dep_created"] = True
                st.rerun()

with kept_expander("Switch deployment", "deployments_switch"):
    st.caption("The sidebar's switcher picks the deployment the other pages act on; these open each one.")
    for row in rows:
        for script, title in (("settings", "Settings"), ("metrics", "Metrics"), ("events", "Events & logs")):
            open_link(script, f"{title} of {deployment_label(row)}", row.name)
