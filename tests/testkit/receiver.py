"""A webhook receiver, for tests only: a real local HTTP server that keeps every JSON body POSTed to it (an alert
channel's other end), answering 200, or 500 to the first ``fail_first`` of them."""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any


class Receiver:
    def __init__(self, fail_first: int = 0) -> None:
        self.bodies: list[dict[str, Any]] = []
        self.paths: list[str] = []
        self.fail_first = fail_first
        self.calls = 0
        self.lock = threading.Lock()
        self.url = ""

    def received(self, **match: Any) -> list[dict[str, Any]]:
        """The bodies whose fields have these values."""
        with self.lock:
            return [b for b in self.bodies if all(b.get(k) == v for k, v in match.items())]


@contextmanager
def receiver(fail_first: int = 0) -> Iterator[Receiver]:
    got = Receiver(fail_first)

    class Handler(BaseHTTPRequestHandler):
        def do_POST(self) -> None:
            length = int(self.headers.get("content-length") or 0)
            body = self.rfile.read(length)
            with got.lock:
                got.calls += 1
                failing = got.calls <= got.fail_first
                if not failing:
                    got.bodies.append(json.loads(body))
                    got.paths.append(self.path)
            self.send_response(500 if failing else 200)
            self.send_header("content-length", "2")
            self.end_headers()
            self.wfile.write(b"ok")

        def log_message(self, *_: object) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    got.url = f"http://127.0.0.1:{server.server_address[1]}/hook/s3cr3t-path"
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield got
    finally:
        server.shutdown()
        server.server_close()
