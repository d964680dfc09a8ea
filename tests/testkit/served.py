"""Apps behind a real uvicorn on a free port, and raw-socket HTTP for what no client library sends (heads of any
size, bytes one at a time, pipelining)."""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import uvicorn

from engine.vllm import free_port
from tests.testkit.wait import wait_until


@contextmanager
def serving(app: Any, protocol: Any) -> Iterator[int]:
    """``app`` served by uvicorn with the HTTP ``protocol`` class, in a thread, until the block ends; its port."""
    port = free_port()
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning", http=protocol))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    wait_until(lambda: server.started, 30, what="uvicorn")
    try:
        yield port
    finally:
        server.should_exit = True
        thread.join(30)


def read_until_closed(sock: socket.socket, seconds: float) -> bytes:
    """What the server sent before closing the connection, or AssertionError if it is still open after
    ``seconds``. A reset after the answer (the server closed with bytes of ours unread) counts as closed."""
    sock.settimeout(seconds)
    got = b""
    deadline = time.monotonic() + seconds
    try:
        while chunk := sock.recv(65536):
            got += chunk
            if time.monotonic() > deadline:
                break
        else:
            return got
    except TimeoutError:
        pass
    except ConnectionResetError:
        return got
    raise AssertionError(f"the connection was still open after {seconds} s (got {got[:100]!r})")


def status_of(answer: bytes) -> int:
    """The status code of the first answer in ``answer``."""
    line = answer.split(b"\r\n", 1)[0]
    assert line.startswith(b"HTTP/1."), answer[:200]
    return int(line.split(b" ")[1])


def statuses(answer: bytes) -> list[int]:
    """The status codes of every answer on a connection (pipelined or kept alive), in order."""
    return [int(part[:3]) for part in answer.split(b"HTTP/1.1 ")[1:] if part[:3].isdigit()]


def get(port: int, path: str = "/healthz", host: str = "127.0.0.1", timeout: float = 10.0) -> tuple[int, bytes]:
    """One GET on a fresh connection: (status, whole answer)."""
    with socket.create_connection(("127.0.0.1", port), timeout=timeout) as sock:
        sock.sendall(f"GET {path} HTTP/1.1\r\nHost: {host}\r\nConnection: close\r\n\r\n".encode())
        answer = read_until_closed(sock, timeout)
    return status_of(answer), answer


@contextmanager
def serve(app: Any, **config: Any) -> Iterator[str]:
    """``app`` served by uvicorn (``config``: more of uvicorn.Config) until the block ends; its base URL."""
    port = free_port()
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning", **config))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    wait_until(lambda: server.started, 30, what="uvicorn")
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(30)
