"""Entry of the Streamlit console: `streamlit run console/app.py` (or `llmops console`).

Pages live in pages/ and reach the engine only through console/client.py.
"""

from __future__ import annotations

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:  # streamlit puts console/ on the path, not the project root
    sys.path.insert(0, str(ROOT))

import streamlit as st  # noqa: E402

st.set_page_config(page_title="llmops console", page_icon=":material/memory:", layout="wide")

PAGES = ROOT / "pages"
nav = st.navigation(
    {
        "Operate": [
            st.Page(PAGES / "overview.py", title="Overview", icon=":material/dashboard:", default=True),
            st.Page(PAGES / "gpu_health.py", title="GPU health", icon=":material/memory:"),
            st.Page(PAGES / "settings.py", title="Engine settings", icon=":material/tune:"),
        ],
        "Use": [st.Page(PAGES / "playground.py", title="Playground", icon=":material/chat:")],
        "Measure": [
            st.Page(PAGES / "metrics.py", title="Metrics", icon=":material/monitoring:"),
            st.Page(PAGES / "benchmarks.py", title="Benchmarks", icon=":material/speed:"),
        ],
        "Investigate": [st.Page(PAGES / "events.py", title="Events & logs", icon=":material/history:")],
    }
)
nav.run()
