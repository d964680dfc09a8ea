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

from tests.testkit.wait import wait_until


@contextmanager
def _running(app: Any, **config: Any) -> Iterator[int]:
    """``app`` served by uvicorn (``config``: more of uvicorn.Config) in a thread until the block ends; its port.

    The listening socket is bound here and handed to uvicorn, so no other process can take the port between its
    choice and the bind (a port picked free and closed again could go to any connection's ephemeral end first: CI saw
    a server that never started). A server whose thread ends before it serves (its app's startup failed) is an
    error at once, not after the wait."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.bind(("127.0.0.1", 0))
    port = int(sock.getsockname()[1])
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning", **config))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    try:
        wait_until(lambda: server.started or not thread.is_alive(), 60, what="uvicorn's start")
        assert server.started, "uvicorn's thread ended before it served (its log above says why)"
        yield port
    finally:
        server.should_exit = True
        thread.join(30)
        if not server.started:  # once serving, the loop owns the socket and closes it (uvloop detaches ours)
            sock.close()


@contextmanager
def serving(app: Any, protocol: Any) -> Iterator[int]:
    """``app`` served by uvicorn with the HTTP ``protocol`` class, in a thread, until the block ends; its port."""
    with _running(app, http=protocol) as port:
        yield port


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
    with _running(app, **config) as port:
        yield f"http://127.0.0.1:{port}"
