"""The engine's ASGI app behind a real uvicorn on a free port, in a thread of the test process: for tests that need
real concurrency (many clients at once, the event loop and the thread pool as in production) without vLLM."""

from __future__ import annotations

import socket
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import uvicorn

from tests.support.wait import wait_until


@contextmanager
def serve(app: Any, **config: Any) -> Iterator[str]:
    """``app`` served by uvicorn until the block ends; yields its base URL."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning", **config))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    wait_until(lambda: server.started, 30, what="uvicorn")
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(30)
