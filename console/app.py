"""Entry of the Streamlit console: `streamlit run console/app.py` (or `llmops console`)."""

from __future__ import annotations

import streamlit as st

st.set_page_config(page_title="llmops console", page_icon=":material/memory:", layout="wide")

nav = st.navigation(
    [
        st.Page("../pages/overview.py", title="Overview", icon=":material/dashboard:", default=True),
    ]
)
nav.run()
