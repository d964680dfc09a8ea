"""Playground: try prompts on the served model, streamed, with what each run cost; compare two parameter sets."""

from __future__ import annotations

from typing import Any

import streamlit as st

from console import fmt
from console.client import ClientError, Run
from console.widgets import client, engine_status, restart_banner, unreachable

st.title("Playground")
TEMPLATES = {
    "None": "",
    "Helpful assistant": "You are a helpful, precise assistant.",
    "Concise JSON (under ~100 tokens)": "Answer only with one compact JSON object, under about 100 tokens, "
    'for example {"answer": "...", "confidence": 0.0}. No prose outside the JSON.',
    "Summarizer": "Summarize the user's text in three short bullet points.",
}

status = engine_status()
restart_banner(status)
model = status.model or "demo"

try:
    saved = client().prompts()
except ClientError as exc:
    unreachable(exc)
names = {f"{p['name']} ({p['mode']})": p for p in saved}
top = st.columns([3, 1, 1], vertical_alignment="bottom")
chosen = top[0].selectbox("Saved prompts", ["—", *names], key="saved_choice")
if top[1].button("Load", disabled=chosen == "—", width="stretch"):
    p = names[chosen]
    st.session_state.update(pg_mode=p["mode"], pg_system=p["system"], pg_prompt=p["prompt"],
                            **{f"pg_a_{k}": v for k, v in p["params"].items()})
    st.rerun()
if top[2].button("Delete", disabled=chosen == "—", width="stretch"):
    client().delete_prompt(names[chosen]["id"])
    st.rerun()

mode = st.segmented_control("Mode", ["chat", "completion"], default="chat", key="pg_mode") or "chat"


def apply_template() -> None:
    st.session_state["pg_system"] = TEMPLATES[st.session_state["pg_template"]]


if mode == "chat":
    st.selectbox("System prompt template", list(TEMPLATES), key="pg_template", on_change=apply_template)
    st.text_area("System prompt", key="pg_system", height=80)
st.text_area("Prompt" if mode == "chat" else "Text to continue", key="pg_prompt", height=120,
             placeholder="Describe what this module does.")
compare = st.toggle("Compare two parameter sets side by side", key="pg_compare")


def params_form(tag: str, container: Any) -> dict[str, Any]:
    with container:
        c = st.columns(4)
        temperature = c[0].slider("temperature", 0.0, 2.0, 0.7, 0.05, key=f"pg_{tag}_temperature")
        top_p = c[1].slider("top_p", 0.05, 1.0, 1.0, 0.05, key=f"pg_{tag}_top_p")
        max_tokens = c[2].number_input("max_tokens", 1, 32_768, 128, key=f"pg_{tag}_max_tokens")
        stop = c[3].text_input("stop (comma-separated)", key=f"pg_{tag}_stop")
    return {"temperature": temperature, "top_p": top_p, "max_tokens": int(max_tokens),
            "stop": [s for s in (x.strip() for x in stop.split(",")) if s] or None}


sets = {"A": params_form("a", st.container(border=True) if compare else st.container())}
if compare:
    sets["B"] = params_form("b", st.container(border=True))


def show_stats(run: Run) -> None:
    if run.error:
        st.error(run.error, icon=":material/error:")
        return
    c = st.columns(5)
    c[0].metric("Time to first token", fmt.seconds(run.ttft_s))
    c[1].metric("Tokens/s", fmt.rate(run.tokens_per_s, ""))
    c[2].metric("Input tokens", run.input_tokens if run.input_tokens is not None else "n/a")
    c[3].metric("Output tokens", run.output_tokens if run.output_tokens is not None else "n/a")
    c[4].metric("Finish", run.finish_reason or "n/a", help="stop: the model ended; length: max_tokens reached")


prompt = st.session_state.get("pg_prompt", "")
b1, b2 = st.columns([1, 4], vertical_alignment="bottom")
run_clicked = b1.button("Run", type="primary", icon=":material/play_arrow:")
with b2.popover("Save prompt"):
    name = st.text_input("Name", key="pg_save_name")
    if st.button("Save", disabled=not (name.strip() and prompt.strip())):
        client().save_prompt(name.strip(), mode, st.session_state.get("pg_system", "") if mode == "chat" else "",
                             prompt, sets["A"])
        st.toast(f"Saved “{name.strip()}”")

if run_clicked and not prompt.strip():
    st.warning("Write a prompt first.")
elif run_clicked:
    columns = st.columns(len(sets))
    for col, (tag, params) in zip(columns, sets.items(), strict=True):
        with col:
            if compare:
                st.markdown(f"**{tag}**: temperature {params['temperature']}, top_p {params['top_p']}, "
                            f"max_tokens {params['max_tokens']}")
            run = Run(model=model, mode=mode, prompt=prompt,
                      system=st.session_state.get("pg_system", "") if mode == "chat" else "", params=params)
            with st.container(border=True):
                st.write_stream(client().stream(run))
            show_stats(run)
