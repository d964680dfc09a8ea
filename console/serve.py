"""The console's process: console/server.py's ``st.App`` served by uvicorn behind the same edge as the engine.

``streamlit run`` would serve the app with uvicorn's stock HTTP protocol: request heads of any size (one 64 MiB
header froze every session for seconds) and no header timeout. Here it gets engine/edge.py's protocol (heads
bounded by ``header_limit_bytes`` and ``header_line_limit_bytes``, timed by ``header_timeout_s``) and its Host
check (``allowed_hosts``), the websocket settings ``streamlit run`` would give it, and the same Streamlit options
``llmops console`` always set.

Run: ``python -m console.serve --host 127.0.0.1 --port 8501`` (``llmops console`` and ``llmops up`` do); the
engine's URL comes from ``LLMOPS_ENGINE_URL``, the limits from the other ``LLMOPS_*`` settings.
"""

from __future__ import annotations

import argparse
import sys
from typing import Any

from engine.config import AppConfig
from engine.edge import HostGuard, console_hosts, edge_protocol, head_limits

STREAMLIT_OPTIONS: dict[str, Any] = {"server.headless": True, "browser.gatherUsageStats": False,
                                     "client.toolbarMode": "minimal"}


def uvicorn_config(config: AppConfig, host: str, port: int) -> Any:
    """The uvicorn configuration of the console (imports Streamlit and the console's app)."""
    import uvicorn
    from streamlit.web import bootstrap
    from streamlit.web.server.starlette.starlette_server import _get_uvicorn_config_kwargs

    # Before the app is built: st.App reads its options when it is made.
    bootstrap.load_config_options({"server.port": port, "server.address": host, **STREAMLIT_OPTIONS})
    from console.server import app

    streamlit_kwargs = _get_uvicorn_config_kwargs()  # websocket, TLS and logging as `streamlit run` sets them
    return uvicorn.Config(HostGuard(app, console_hosts(config)), host=host, port=port,
                          http=edge_protocol(head_limits(config)), lifespan="on", **streamlit_kwargs)


def main(argv: list[str] | None = None) -> None:
    import uvicorn

    config = AppConfig()
    parser = argparse.ArgumentParser(prog="python -m console.serve", description=__doc__.split("\n\n")[0])
    parser.add_argument("--host", default=config.console_host, help="address to listen on (console_host)")
    parser.add_argument("--port", type=int, default=config.console_port, help="port (console_port)")
    args = parser.parse_args(argv)
    config = config.model_copy(update={"console_host": args.host, "console_port": args.port})
    server = uvicorn.Server(uvicorn_config(config, args.host, args.port))
    print(f"  console: http://{args.host}:{args.port}", file=sys.stderr, flush=True)
    server.run()


if __name__ == "__main__":
    main()
