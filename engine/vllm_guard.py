"""Loaded into every vLLM server the engine starts (vLLM's ``--middleware engine.vllm_guard.KeyOnEveryPath``): no
path of the server answers without the instance's own key. vLLM's ``--api-key`` guards ``/v1`` (and a few other
prefixes) only: on an instance's port ``/invocations`` served completions and chat with no key, and ``/tokenize``,
``/detokenize``, ``/load``, ``/scale_elastic_ep``, ``/metrics`` and ``/docs`` answered too — to local users, and on
Ray to the node's whole network (issue 31). The key is the one the engine gave the instance (VLLM_API_KEY, in its
environment only); the gateway, the probes, the scrape of /metrics and the engine's sleeps and wakes send it.

Imported inside vLLM's process: the standard library only, nothing else of the engine.
"""

from __future__ import annotations

import hmac
import json
import os
from collections.abc import Awaitable, Callable, MutableMapping
from typing import Any

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
App = Callable[[Scope, Receive, Send], Awaitable[None]]

_REFUSED = json.dumps({"error": {"message": "this vLLM instance answers its engine only: send its key",
                                 "type": "authentication_error", "code": 401}}).encode()


class KeyOnEveryPath:
    """ASGI middleware: every HTTP request and WebSocket must carry ``Authorization: Bearer <VLLM_API_KEY>``."""

    def __init__(self, app: App) -> None:
        self.app = app
        key = os.environ.get("VLLM_API_KEY", "")
        if not key:
            raise RuntimeError("VLLM_API_KEY is not set: the engine starts vLLM with one; without it, nothing "
                               "could reach this server")
        self.expected = f"Bearer {key}".encode()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        kind = scope.get("type")
        if kind not in ("http", "websocket"):  # lifespan
            await self.app(scope, receive, send)
            return
        sent = next((v for k, v in scope.get("headers") or () if k == b"authorization"), b"")
        if hmac.compare_digest(sent, self.expected):
            await self.app(scope, receive, send)
            return
        if kind == "websocket":
            await send({"type": "websocket.close", "code": 1008})
            return
        await send({"type": "http.response.start", "status": 401,
                    "headers": [(b"content-type", b"application/json"),
                                (b"content-length", str(len(_REFUSED)).encode()), (b"www-authenticate", b"Bearer")]})
        await send({"type": "http.response.body", "body": _REFUSED})
