"""Slow clients: a connection whose request headers do not arrive within ``header_timeout_s`` is closed
(slowloris: a client that sends a header line every few seconds would otherwise hold its connection, and with
enough of them every file descriptor, for ever). Bodies are timed by the body guard and the data path.

uvicorn times out idle keep-alive connections but not unfinished headers; this is its httptools protocol with a
timer from the first byte of a request (or the connection's opening) to the end of its headers."""

from __future__ import annotations

import asyncio
from typing import Any

from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol


def header_timeout_protocol(timeout_s: float) -> type[HttpToolsProtocol]:
    class HeaderTimeoutProtocol(HttpToolsProtocol):
        _header_timer: asyncio.TimerHandle | None = None

        def _arm(self) -> None:
            if self._header_timer is None:
                self._header_timer = self.loop.call_later(timeout_s, self._headers_too_slow)

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

        def data_received(self, data: bytes) -> None:
            if self.cycle is None or self.cycle.response_complete:
                self._arm()  # bytes of a (new) request before its headers are complete
            super().data_received(data)

        def on_headers_complete(self) -> None:
            self._disarm()
            super().on_headers_complete()

        def connection_lost(self, exc: Exception | None) -> None:
            self._disarm()
            super().connection_lost(exc)

    return HeaderTimeoutProtocol
