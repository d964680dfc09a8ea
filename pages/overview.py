"""Overview: engine state, model and revisions (the full console lands with its own issue)."""

from __future__ import annotations

import streamlit as st

from console.client import ClientError, EngineClient

st.title("Overview")
client = EngineClient()
try:
    status = client.status()
except ClientError as exc:
    st.error(f"The engine is unreachable: {exc}")
    st.stop()

st.metric("Engine", status.state)
st.caption(status.reason)
st.write(f"Running revision **{status.running_revision}**, desired **{status.desired_revision}**, "
         f"model **{status.model}**, vLLM {status.vllm_version} ({status.vllm_build})")
