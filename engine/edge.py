"""The HTTP edge that the engine and the console share: what a connection may send before any app sees it.

- **Heads are bounded.** uvicorn (and httptools under it) take a request head of any size: a 64 MiB header once
  held the event loop for 6 s, freezing every other connection, /healthz and /v1 streams included. This protocol
  scans what arrives *before* the parser sees it: a request line longer than ``header_line_limit_bytes`` is
  answered 414, a header line longer than that or a head longer than ``header_limit_bytes`` 431, and the
  connection is closed; the rest is neither buffered nor parsed. The scan is one ``find`` per head in the common
  case (a whole head under the line limit in one read), one per line otherwise.
- **Heads are timed.** A connection whose head does not arrive within ``header_timeout_s`` (from its first byte,
  or the connection's opening) is closed (slowloris: one header line every few seconds would hold it for ever).
- **Hosts are checked** (``HostCheck``): a request whose Host is none of the service's own names is answered 421.
  A page on another site that makes its name resolve to 127.0.0.1 (DNS rebinding) reaches a loopback service
  with its own name as Host; IP literals pass (a page served from an address is that address's own origin).

Light on purpose: the console's server imports it (no SQLite, NVML, vLLM or torch here).
"""

from __future__ import annotations

import asyncio
import ipaddress
import json
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any
from urllib.parse import urlsplit

import httptools
from starlette.types import ASGIApp, Receive, Scope, Send
from uvicorn.protocols.http.httptools_impl import STATUS_LINE, HttpToolsProtocol

if TYPE_CHECKING:
    from engine.config import AppConfig

LOOPBACK_NAMES = frozenset({"localhost"})
WILDCARD_HOSTS = frozenset({"0.0.0.0", "::", ""})


@dataclass(frozen=True)
class HeadLimits:
    """What a request head may be: ``head_bytes`` in all, ``line_bytes`` a line (the request line: the URL),
    within ``timeout_s`` of its first byte."""

    head_bytes: int = 64 * 1024
    line_bytes: int = 8 * 1024
    timeout_s: float = 10.0


class Shedding:
    """The share of this server's responses after which their connection is let go (``connection: close``): a busy
    gateway worker's, so that those clients reconnect to one with room (engine/gateway/steering.py). Every
    1/share-th response, not drawn at random: the same share always moves the same number."""

    def __init__(self) -> None:
        self.share = 0.0
        self._credit = 0.0

    def take(self) -> bool:
        """Whether this response lets its connection go."""
        if self.share <= 0:
            return False
        self._credit += self.share
        if self._credit < 1.0:
            return False
        self._credit -= 1.0
        return True


class EdgeProtocol(HttpToolsProtocol):
    """uvicorn's httptools protocol with bounded, timed heads. Use ``edge_protocol(limits)`` for a class."""

    limits = HeadLimits()
    shedding: Shedding | None = None

    _header_timer: asyncio.TimerHandle | None = None
    _in_head = True  # the parser is in (or before) a request head; False while a body arrives
    _head_bytes = 0  # bytes of this head scanned so far
    _line_bytes = 0  # bytes of its current, unfinished line
    _line_last = 0  # the last byte of that unfinished line (a lone CR: the line may yet be blank)
    _lines = 0  # complete lines of this head (0: the request line is still arriving)
    _upgraded = False
    # told when the connection is lost (the gateway's relay of a stream: its client left), instead of a task that
    # waits for the ASGI disconnect, one a request
    on_lost: Callable[[], None] | None = None

    # --- the header timeout -------------------------------------------------------------------------------------

    def _arm(self) -> None:
        if self._header_timer is None:
            self._header_timer = self.loop.call_later(self.limits.timeout_s, self._headers_too_slow)

    def _disarm(self) -> None:
        if self._header_timer is not None:
            self._header_timer.cancel()
            self._header_timer = None

    def _headers_too_slow(self) -> None:
        self._header_timer = None
        if not self.transport.is_closing():
            self.transport.close()

    def connection_made(self, transport: Any) -> None:
        super().connection_made(transport)
        self._arm()

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm()
        super().connection_lost(exc)
        if self.on_lost is not None:
            told, self.on_lost = self.on_lost, None
            told()

    # --- the head bound -----------------------------------------------------------------------------------------

    def data_received(self, data: bytes) -> None:
        if self.cycle is None or self.cycle.response_complete:
            self._arm()  # bytes of a (new) request before its headers are complete
        view = memoryview(data)
        pos, end = 0, len(data)
        while pos < end:
            if not self._in_head:  # a body: the parser's own business
                self._feed(view[pos:] if pos else data)
                return
            cut = self._scan(data, pos)
            if cut is None:  # refused, the connection closing
                return
            self._feed(view[pos:cut] if pos or cut < end else data)
            if self._upgraded or self.transport.is_closing():
                return
            pos = cut

    def _feed(self, data: bytes | memoryview) -> None:
        """uvicorn's data_received, less the refusals this protocol has already answered."""
        self._unset_keepalive_if_required()
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserError:
            if not self.transport.is_closing():
                self.logger.warning("Invalid HTTP request received.")
                self.send_400_response("Invalid HTTP request received.")
        except httptools.HttpParserUpgrade:
            if self._should_upgrade():
                self.handle_websocket_upgrade()
            else:
                self._unsupported_upgrade_warning()

    def _scan(self, data: bytes, pos: int) -> int | None:
        """Where, in ``data`` from ``pos``, the head being received ends (``len(data)``: not in this read), once
        every line of it up to there is within the bounds; None when it is refused."""
        end = len(data)
        limits = self.limits
        if not (self._head_bytes or self._line_bytes or self._lines):  # a fresh head: whole in one read, most often
            stop = data.find(b"\r\n\r\n", pos, pos + limits.line_bytes)
            if stop >= 0:
                return stop + 4  # shorter than one line may be: no line of it can be too long
        start = pos
        while True:
            nl = data.find(b"\n", pos)
            stop = end if nl < 0 else nl
            length = self._line_bytes + (stop - pos)
            if length > limits.line_bytes:
                self._refuse_line()
                return None
            if self._head_bytes + (stop - start) > limits.head_bytes:
                self._refuse(431, f"the request head is over {limits.head_bytes:,} bytes (header_limit_bytes)")
                return None
            if nl < 0:
                self._head_bytes += end - start
                self._line_bytes = length
                if end > start:
                    self._line_last = data[end - 1]
                return end
            last = data[nl - 1] if nl > pos else self._line_last
            blank = length == 0 or (length == 1 and last == 0x0D)
            self._line_bytes = 0
            pos = nl + 1
            if blank and self._lines:  # the end of the head
                self._head_bytes = self._lines = 0
                return pos
            if not blank:  # (blank lines before a request line are skipped by the parser)
                self._lines += 1

    def _refuse_line(self, request_line: bool = False) -> None:
        if request_line or self._lines == 0:
            self._refuse(414, f"the request line (its URL) is over {self.limits.line_bytes:,} bytes "
                         "(header_line_limit_bytes)")
        else:
            self._refuse(431, f"a header line is over {self.limits.line_bytes:,} bytes (header_line_limit_bytes)")

    def _refuse(self, status: int, message: str) -> None:
        """Answer ``status`` and close: the rest of the head is never read. A connection still answering an
        earlier (pipelined) request is closed without one: an answer now would land inside that one's."""
        self._disarm()
        if self.cycle is None or self.cycle.response_complete:
            body = (message + "\n").encode()
            self.transport.write(b"".join([STATUS_LINE[status], b"content-type: text/plain; charset=utf-8\r\n",
                                           b"content-length: ", str(len(body)).encode(), b"\r\n",
                                           b"connection: close\r\n\r\n", body]))
        self.transport.close()

    # --- parser callbacks ---------------------------------------------------------------------------------------

    def on_url(self, url: bytes) -> None:
        if len(self.url) + len(url) > self.limits.line_bytes:  # a head that began in a read the scan did not see
            self._refuse_line(request_line=True)
            raise httptools.HttpParserError("the URL is too long")  # stops the parser where it is
        super().on_url(url)

    def on_headers_complete(self) -> None:
        self._disarm()
        self._in_head = False
        self._head_bytes = self._line_bytes = self._lines = 0
        super().on_headers_complete()
        if self.shedding is not None and self.cycle is not None and self.shedding.take():
            self.cycle.keep_alive = False  # its answer says connection: close, and the connection ends with it

    def on_message_complete(self) -> None:
        self._in_head = True
        super().on_message_complete()

    def handle_websocket_upgrade(self) -> None:
        self._upgraded = True
        super().handle_websocket_upgrade()


def edge_protocol(limits: HeadLimits, shedding: Shedding | None = None) -> type[HttpToolsProtocol]:
    """The protocol class to give uvicorn (``http=``), with these limits (and this server's ``shedding``)."""
    return type("BoundedEdgeProtocol", (EdgeProtocol,), {"limits": limits, "shedding": shedding})


# --- Host ------------------------------------------------------------------------------------------------------


def host_name(value: str) -> str:
    """The name part of a Host header or URL authority, lower case, without port or brackets."""
    value = value.strip().lower()
    if value.startswith("["):
        return value[1:value.find("]")] if "]" in value else value[1:]
    name, sep, port = value.rpartition(":")
    if sep and port.isdigit() and ":" not in name:
        value = name
    return value.rstrip(".")


def _is_ip(name: str) -> bool:
    try:
        ipaddress.ip_address(name)
    except ValueError:
        return False
    return True


class HostCheck:
    """Which Host headers a service answers: IP literals, loopback names (``localhost``, ``*.localhost``), and
    ``names`` (its configured host, the host of its public URL, ``allowed_hosts``). A name starting with a dot
    covers its subdomains; ``*`` turns the check off."""

    def __init__(self, names: Iterable[str | None]) -> None:
        cleaned = {host_name(n) for n in names if n}
        self.any = "*" in cleaned
        self.suffixes = tuple(n for n in cleaned if n.startswith("."))
        self.names = frozenset(n for n in cleaned if not n.startswith(".") and n not in WILDCARD_HOSTS)

    @classmethod
    def of(cls, hosts: Iterable[str | None], urls: Iterable[str | None], allowed: Iterable[str]) -> HostCheck:
        """From addresses the service listens on, URLs it is reached by, and the allow-list."""
        return cls([*hosts, *(urlsplit(u).hostname for u in urls if u), *allowed])

    def admits(self, host: str | None) -> bool:
        if self.any or not host:  # no Host: not a browser (every browser sends one)
            return True
        name = host_name(host)
        return (name in LOOPBACK_NAMES or name.endswith(".localhost") or name in self.names or _is_ip(name)
                or name.endswith(self.suffixes) or any(name == s[1:] for s in self.suffixes))

    def refusal(self, host: str) -> str:
        shown = host_name(host)[:100]
        return (f"this service is not reached as {shown!r}: a request for another site's name is refused (DNS "
                f"rebinding). If clients reach it by that name, add it to allowed_hosts (LLMOPS_ALLOWED_HOSTS)")


def host_of(scope: Scope) -> str | None:
    for name, value in scope.get("headers") or []:
        if name == b"host":
            return str(value.decode("latin-1"))
    return None


async def refuse_host(scope: Scope, send: Send, message: str) -> None:
    """421 for a request (OpenAI's error shape on /v1, ``detail`` elsewhere); a websocket is closed unaccepted
    (the server answers 403)."""
    if scope["type"] == "websocket":
        await send({"type": "websocket.close", "code": 1008, "reason": "misdirected request"})
        return
    path: str = scope.get("path", "")
    body = {"error": {"message": message, "type": "misdirected_request", "code": 421}} if path.startswith("/v1/") \
        else {"detail": message}
    data = json.dumps(body).encode()
    await send({"type": "http.response.start", "status": 421,
                "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(data)).encode()),
                            (b"connection", b"close")]})
    await send({"type": "http.response.body", "body": data})


class HostGuard:
    """ASGI middleware: requests and websockets whose Host ``check`` does not admit are refused (421)."""

    def __init__(self, app: ASGIApp, check: HostCheck) -> None:
        self.app = app
        self.check = check

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] in ("http", "websocket"):
            host = host_of(scope)
            if not self.check.admits(host):
                await refuse_host(scope, send, self.check.refusal(host or ""))
                return
        await self.app(scope, receive, send)


# --- from the configuration -------------------------------------------------------------------------------------


def head_limits(config: AppConfig) -> HeadLimits:
    return HeadLimits(config.header_limit_bytes, config.header_line_limit_bytes, config.header_timeout_s)


def engine_hosts(config: AppConfig) -> HostCheck:
    """The engine's names: where it listens, its public URL, the URL the console and CLI reach it by."""
    return HostCheck.of([config.host], [config.public_url, config.engine_url], config.allowed_hosts)


def console_hosts(config: AppConfig) -> HostCheck:
    return HostCheck.of([config.console_host], [], config.allowed_hosts)
