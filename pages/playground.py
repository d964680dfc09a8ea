"""Playground: try prompts on the served model (a multi-turn chat, or a completion), streamed, with what each run
cost; ask for JSON through vLLM's structured outputs and see it checked; compare two parameter sets, or two
models (one prompt, each answered by its own: two deployments, or a LoRA adapter and its base), side by side, run at
the same time; keep prompts the team shares."""

from __future__ import annotations

import json
import threading
import time
from typing import Any

import jsonschema
import streamlit as st

from console import drafts, fmt
from console.widgets import client, deployment_header, engine_status, me, restart_banner, unreachable
from engine.client import ClientError, EngineClient, Run
from engine.schemas import PLAYGROUND_MAX_TOKENS, ROLES, PromptOut

st.title("Playground")
TEMPLATES = {
    "None": "",
    "Helpful assistant": "You are a helpful, precise assistant.",
    "Concise JSON (under ~100 tokens)": "Answer only with one compact JSON object, under about 100 tokens, "
    'for example {"answer": "...", "confidence": 0.0}. No prose outside the JSON.',
    "Summarizer": "Summarize the user's text in three short bullet points.",
}
FORMATS = ["Text", "JSON object", "JSON schema"]
DEFAULT_SCHEMA = json.dumps({"type": "object", "properties": {"answer": {"type": "string"},
                                                              "confidence": {"type": "number"}},
                             "required": ["answer"]}, indent=1)
DEFAULTS: dict[str, Any] = {"temperature": 0.7, "top_p": 1.0, "max_tokens": PLAYGROUND_MAX_TOKENS, "stop": ""}
# The whole draft survives a page switch and a reload (console/drafts.py): the conversation, the last results
# and every field, the parameters of both sets included.
FIRST = {"pg_mode": "chat", "pg_messages": [], "pg_schema": DEFAULT_SCHEMA,
         **{f"pg_{tag}_{name}": value for tag in ("a", "b") for name, value in DEFAULTS.items()}}
DRAFT = [*FIRST, "pg_template", "pg_system", "pg_prompt", "pg_format", "pg_compare", "pg_save_name", "pg_last",
         "saved_choice", "pg_compare_deps", "pg_dep_a", "pg_dep_b", "pg_model"]
drafts.keep("playground", DRAFT, FIRST, per_deployment=False)  # it compares deployments

here = deployment_header("a run sends its name as `model` through the gateway")
status = engine_status()
restart_banner(status)
model = here.shown  # the name clients send: the gateway routes a request by it to its deployment
deployment_names = [r.name for r in here.rows] or [model]


def listed_adapters(names: list[str]) -> dict[str, str]:
    """Each LoRA adapter clients may call now (listed on /v1), with its deployment."""
    out: dict[str, str] = {}
    for name in names:
        try:
            out.update({a.name: name for a in client().adapters(name) if a.listed})
        except ClientError:
            continue  # a deployment that went meanwhile, or no adapters' route on an older engine
    return out


adapters = listed_adapters(deployment_names)
# what a run may call: each deployment's model and its adapters (a fine-tune beside its base)
choices = [n for d in deployment_names for n in (d, *sorted(a for a, of in adapters.items() if of == d))]


def choice_label(name: str) -> str:
    return f"{name} (LoRA adapter of {adapters[name]})" if name in adapters else name


def load_prompt(p: PromptOut | None) -> None:
    """Put a saved prompt into the form (a callback: it runs before the widgets are drawn)."""
    if p is None:
        return
    params = p.params
    st.session_state.update(pg_mode=p.mode, pg_system=p.system or "", pg_prompt=p.prompt or "")
    st.session_state["pg_a_temperature"] = params.temperature if params.temperature is not None else \
        DEFAULTS["temperature"]
    st.session_state["pg_a_top_p"] = params.top_p if params.top_p is not None else DEFAULTS["top_p"]
    st.session_state["pg_a_max_tokens"] = params.max_tokens or DEFAULTS["max_tokens"]
    st.session_state["pg_a_stop"] = ", ".join(params.stop or [])
    st.session_state["pg_format"] = params.format or "Text"
    if params.schema_:
        st.session_state["pg_schema"] = params.schema_
    st.session_state["pg_flash"] = f"Loaded “{p.name}”."


def may_delete(p: PromptOut) -> bool:
    """Its author may delete a saved prompt, and an operator or admin (the engine checks it too)."""
    who = me()
    return p.author == who.name or ROLES.index(who.role) >= ROLES.index("operator")


@st.dialog("Delete this saved prompt?")
def confirm_delete(p: PromptOut) -> None:
    st.markdown(f"**{p.name}** ({p.mode}) by **{p.author}**, saved {fmt.since(p.created_at)}. It is deleted for "
                "everyone who uses the playground; this cannot be undone.")
    if st.button("Delete", type="primary", key="pg_confirm_delete"):
        try:
            client().delete_prompt(p.id)
        except ClientError as exc:
            st.error(f"Could not delete “{p.name}”: {exc}")
            return
        st.session_state["saved_choice"] = "—"
        st.session_state["pg_flash"] = f"Deleted “{p.name}”."
        st.rerun()


def prompt_label(p: PromptOut) -> str:
    return f"{p.name} ({p.mode}) · by {p.author}"


def save_prompt() -> None:
    name = str(st.session_state.get("pg_save_name", "")).strip()
    mode = st.session_state.get("pg_mode") or "chat"
    params = params_of("a")
    params.update(format=st.session_state.get("pg_format", "Text"))
    if params["format"] == "JSON schema":
        params["schema"] = st.session_state.get("pg_schema", "")
    try:
        saved = client().save_prompt(name, mode, st.session_state.get("pg_system", "") if mode == "chat" else "",
                                     st.session_state.get("pg_prompt", ""), params)
    except ClientError as exc:
        st.session_state["pg_flash"] = f"Not saved: {exc}"
        return
    st.session_state["saved_choice"] = prompt_label(saved)
    st.session_state["pg_flash"] = f"Saved “{name}”."


def params_of(tag: str) -> dict[str, Any]:
    stop = [s for s in (x.strip() for x in str(st.session_state.get(f"pg_{tag}_stop") or "").split(",")) if s]
    return {"temperature": float(st.session_state[f"pg_{tag}_temperature"]),
            "top_p": float(st.session_state[f"pg_{tag}_top_p"]),
            "max_tokens": int(st.session_state[f"pg_{tag}_max_tokens"]), "stop": stop or None}


SHOWN = 100  # saved prompts listed (the newest): the list API gives them a page at a time
try:
    saved = client().prompts(limit=SHOWN)
except ClientError as exc:
    unreachable(exc)
names = {prompt_label(p): p for p in saved}
if st.session_state.get("saved_choice") not in (None, "—", *names):
    st.session_state["saved_choice"] = "—"
top = st.columns([3, 1, 1], vertical_alignment="bottom")
chosen = top[0].selectbox("Saved prompts", ["—", *names], key="saved_choice",
                          help=f"the newest {SHOWN} prompts the team saved, each with its author"
                          if len(saved) >= SHOWN else "prompts the team saved, each with its author")
picked = names.get(chosen)
top[1].button("Load", disabled=picked is None, width="stretch", on_click=load_prompt, args=(picked,))
if top[2].button("Delete", disabled=picked is None or not may_delete(picked), width="stretch",
                 help=None if picked is None or may_delete(picked) else
                 f"only {picked.author}, its author, or an operator may delete it"):
    assert picked is not None
    confirm_delete(picked)
if flash := st.session_state.pop("pg_flash", None):
    st.toast(flash)

mode = st.segmented_control("Mode", ["chat", "completion"], key="pg_mode") or "chat"


def apply_template() -> None:
    st.session_state["pg_system"] = TEMPLATES[st.session_state["pg_template"]]


# Each part of the page that comes and goes (the conversation, the models compared, B's parameters, the schema's
# error) is drawn inside a block that is always there, so that what follows keeps its place from run to run. While a
# run draws, the browser keeps what stood at each place until the new run puts something there (and a block's
# children where the new one is of the same type): had the conversation's end moved everything up by two, the Run
# button of the run before would stand below the new one (two Run buttons), and the single form's max_tokens (A's)
# where B's was about to be (a value typed there went to A).
with st.container():
    if mode == "chat":
        st.selectbox("System prompt template", list(TEMPLATES), key="pg_template", on_change=apply_template)
        st.text_area("System prompt", key="pg_system", height=80)
        conversation = st.session_state["pg_messages"]
        if conversation:
            with st.container(border=True):
                for turn in conversation:
                    with st.chat_message(turn["role"]):
                        st.markdown(turn["content"] or "*(no text)*")
            st.button("New conversation", icon=":material/restart_alt:",
                      on_click=lambda: st.session_state.update(pg_messages=[], pg_last=[]))
st.text_area("Prompt" if mode == "chat" else "Text to continue", key="pg_prompt", height=120,
             placeholder="Describe what this module does.")
c1, c2 = st.columns([1, 3])
out_format = c1.selectbox("Output format", FORMATS, key="pg_format",
                          help="JSON through vLLM's structured outputs: the reply is constrained to JSON, or to "
                          "the schema; the playground checks what comes back.")
schema_text = c2.text_area("JSON schema", key="pg_schema", height=110) if out_format == "JSON schema" else None
schema: dict[str, Any] | None = None
if schema_text is not None:
    try:
        schema = json.loads(schema_text)
        jsonschema.Draft202012Validator.check_schema(schema)
    except (ValueError, jsonschema.SchemaError) as exc:
        c2.error(f"The JSON schema is not valid: {getattr(exc, 'message', exc)}", icon=":material/data_object:")
        schema = None
c1, c2 = st.columns(2)
compare_deps = c2.toggle("Compare two models side by side", key="pg_compare_deps",
                         disabled=len(choices) < 2,
                         help="one prompt, sent to both (model = a deployment's name, or one of its LoRA adapters), "
                         "with the same parameters: a fine-tune beside its base, or two deployments"
                         if len(choices) > 1 else "there is only one model: create another deployment on the "
                         "Deployments page, or register a LoRA adapter there")
compare_deps = compare_deps and len(choices) > 1
compare = c1.toggle("Compare two parameter sets side by side", key="pg_compare", disabled=compare_deps) \
    and not compare_deps
mine = [model, *sorted(a for a, of in adapters.items() if of == model)]
if st.session_state.get("pg_model") not in mine:
    st.session_state["pg_model"] = model
with st.container():  # (always there: see above)
    if compare_deps:
        # a deployment with an adapter compares the adapter with its base first; else two deployments
        second = next((n for n in mine if n != model), next((n for n in choices if n != model), model))
        for tag, fallback in (("a", model), ("b", second)):
            if st.session_state.get(f"pg_dep_{tag}") not in choices:
                st.session_state[f"pg_dep_{tag}"] = fallback
        d = st.columns(2)
        d[0].selectbox("Model A", choices, key="pg_dep_a", format_func=choice_label)
        d[1].selectbox("Model B", choices, key="pg_dep_b", format_func=choice_label)
    elif len(mine) > 1:
        st.selectbox("Model", mine, key="pg_model", format_func=choice_label,
                     help="the deployment's base model, or one of its LoRA adapters (sent as `model`)")


def params_form(tag: str) -> None:
    c = st.columns(4)
    c[0].slider("temperature", 0.0, 2.0, step=0.05, key=f"pg_{tag}_temperature")
    c[1].slider("top_p", 0.05, 1.0, step=0.05, key=f"pg_{tag}_top_p")
    c[2].number_input("max_tokens", 1, 32_768, key=f"pg_{tag}_max_tokens")
    c[3].text_input("stop (comma-separated)", key=f"pg_{tag}_stop")


def label(tag: str, params: dict[str, Any], deployment: str | None = None) -> str:
    return (f"**{tag}**" + (f" · model **{choice_label(deployment)}**" if deployment else "")
            + f" · temperature {params['temperature']:g} · top_p {params['top_p']:g} · "
            f"max_tokens {params['max_tokens']}" + (f" · stop {params['stop']}" if params["stop"] else ""))


# A's fields stand at the same place whichever the mode (after an element: B's label, or nothing), B's in a column
# of their own: switching compare on or off never leaves one of A's fields where one of B's is drawn.
for col, tag in zip(st.columns(2 if compare else 1), ("a", "b") if compare else ("a",), strict=True):
    with col.container(border=compare):
        if compare:
            st.markdown(label(tag.upper(), params_of(tag)))
        else:
            st.empty()
        params_form(tag)


def response_format() -> dict[str, Any] | None:
    if out_format == "JSON object":
        return {"type": "json_object"}
    if out_format == "JSON schema" and schema is not None:
        return {"type": "json_schema", "json_schema": {"name": "answer", "schema": schema}}
    return None


def check_json(run: Run) -> tuple[bool, str] | None:
    """Whether a JSON-mode reply is JSON (and matches the schema it was asked for); None when JSON was not asked
    for."""
    asked = run.params.get("response_format")
    if not isinstance(asked, dict) or run.error:
        return None
    try:
        data = json.loads(run.text)
    except ValueError as exc:
        cut = " The reply was cut off at max_tokens: raise it." if run.finish_reason == "length" else ""
        return False, f"not valid JSON: {exc}.{cut}"
    wanted = (asked.get("json_schema") or {}).get("schema") if asked.get("type") == "json_schema" else None
    if wanted is None:
        return True, "valid JSON"
    errors = sorted(jsonschema.Draft202012Validator(wanted).iter_errors(data), key=lambda e: list(e.path))
    if errors:
        where = "/".join(str(p) for p in errors[0].path) or "the top level"
        return False, f"valid JSON, but not the schema: at {where}, {errors[0].message}"
    return True, "valid JSON that matches the schema"


def show_stats(run: Run, narrow: bool = False) -> None:
    if run.error:
        st.error(run.error, icon=":material/error:")
        return
    rate = run.tokens_per_s
    figures = [("Time to first token", fmt.seconds(run.ttft_s), None),
               ("Tokens/s", "n/a" if rate is None else f"{rate:,.0f}" if rate >= 100 else f"{rate:.1f}",
                "output tokens over the generation time, from the request to the last token"),
               ("Finish", run.finish_reason or "n/a", "stop: the model ended; length: max_tokens reached"),
               ("Input tokens", str(run.input_tokens) if run.input_tokens is not None else "n/a", None),
               ("Output tokens", str(run.output_tokens) if run.output_tokens is not None else "n/a", None)]
    rows = [figures[:3], figures[3:]] if narrow else [figures]  # side by side, five in a row do not fit
    for row in rows:
        for col, (label_, value, help_) in zip(st.columns(len(row)), row, strict=True):
            col.metric(label_, value, help=help_)
    if not run.text:
        why = {"length": f"it reached max_tokens ({run.params.get('max_tokens')}) before any text",
               "stop": "the model ended at once (an end-of-text token or a stop string came first)"}
        st.warning(f"The model returned no text: {why.get(run.finish_reason or '', 'no reason given')} "
                   f"(finish reason {run.finish_reason or 'none'}, {run.output_tokens or 0} output tokens).",
                   icon=":material/block:")
    if (checked := check_json(run)) is not None:
        ok, message = checked
        (st.success if ok else st.error)(f"JSON check: {message}", icon=":material/data_object:")


def show_run(tag: str | None, run: Run, *, text: bool = True, by_deployment: bool = False) -> None:
    if tag:
        st.markdown(label(tag, run.params, run.model if by_deployment else None))
    if text:
        with st.container(border=True):
            st.markdown(run.text or "*(no text)*")
    show_stats(run, narrow=tag is not None)
    if tag and run.total_s is not None and not run.error:
        st.caption(f"Whole request: {fmt.seconds(run.total_s)} · model `{run.model}`")


prompt = st.session_state.get("pg_prompt", "")
b1, b2 = st.columns([1, 4], vertical_alignment="bottom")
run_clicked = b1.button("Run", type="primary", icon=":material/play_arrow:")
with b2.popover("Save prompt"):
    st.text_input("Name", key="pg_save_name", max_chars=200)
    st.button("Save", disabled=not (str(st.session_state.get("pg_save_name", "")).strip() and prompt.strip()),
              on_click=save_prompt)


def by_deployment(runs: dict[str, Run] | list[tuple[str, Run]]) -> bool:
    """Whether the runs went to different deployments (then each is labelled with its own)."""
    return len({run.model for _, run in (runs.items() if isinstance(runs, dict) else runs)}) > 1


def stream_all(runs: dict[str, Run]) -> None:
    """Run every request at once (each on its own thread and connection) and show them as they stream."""
    token = client().token

    def go(run: Run) -> None:
        with EngineClient(client().base_url, token=token) as own:
            for _ in own.stream(run):
                pass

    columns = st.columns(len(runs))
    boxes = {}
    for col, (tag, run) in zip(columns, runs.items(), strict=True):
        with col:
            if len(runs) > 1:
                st.markdown(label(tag, run.params, run.model if by_deployment(runs) else None))  # before it runs
            boxes[tag] = st.empty()
    threads = [threading.Thread(target=go, args=(run,), daemon=True) for run in runs.values()]
    for t in threads:
        t.start()
    while any(t.is_alive() for t in threads):
        for tag, run in runs.items():
            boxes[tag].markdown(run.text or "…")
        time.sleep(0.05)
    for box in boxes.values():
        box.empty()


if run_clicked and not prompt.strip():
    st.warning("Write a prompt first.")
elif run_clicked:
    fmt_ = response_format()
    history = [{"role": t["role"], "content": t["content"]} for t in st.session_state["pg_messages"]] \
        if mode == "chat" else []
    chosen_model = st.session_state.get("pg_model") or model
    targets = {"a": st.session_state["pg_dep_a"], "b": st.session_state["pg_dep_b"]} if compare_deps else \
        {"a": chosen_model, "b": chosen_model}
    runs = {tag.upper(): Run(model=targets[tag], mode=mode, prompt=prompt, history=history,
                             system=st.session_state.get("pg_system", "") if mode == "chat" else "",
                             params={**params_of("a" if compare_deps else tag),
                                     **({"response_format": fmt_} if fmt_ else {})})
            for tag in (("a", "b") if compare or compare_deps else ("a",))}
    stream_all(runs)
    st.session_state["pg_last"] = list(runs.items())
    first = next(iter(runs.values()))
    if mode == "chat" and not first.error:
        st.session_state["pg_messages"] = [*history, {"role": "user", "content": prompt},
                                           {"role": "assistant", "content": first.text}]
    st.rerun()  # the conversation and the results are drawn from the session, like on any other rerun

last: list[tuple[str, Run]] = st.session_state.get("pg_last") or []
if last:
    columns = st.columns(len(last))
    for col, (tag, run) in zip(columns, last, strict=True):
        with col:  # a single chat reply is in the conversation above: its figures only
            show_run(tag if len(last) > 1 else None, run, by_deployment=by_deployment(last),
                     text=len(last) > 1 or run.mode != "chat" or bool(run.error))
drafts.settle()  # drawn whole from the draft: from now on the fields are the user's
