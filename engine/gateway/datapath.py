"""The data path: every /v1 request (and /tokenize, /detokenize) as raw ASGI, ahead of FastAPI and its
middleware, in the order that keeps it cheap and safe — the route, then the key (before a byte of the body is
read), then the body (size, time, JSON checks), then vLLM. ``/v1/generate``, the engine's own endpoint, is
left to FastAPI."""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from starlette.types import Receive, Scope, Send

from engine.access.keys import GatewayKeys, KeyRefusedError
from engine.bodies import BodyError, header, parse_json_async, read_body
from engine.gateway.ledger import Record, asked_max_tokens
from engine.gateway.proxy import (
    HOP_HEADERS,
    USAGE_PATHS,
    Exchange,
    Gateway,
    forward_query,
    send_simple,
    with_usage,
)
from engine.gateway.routes import ROOT_PATHS, PathRefusal, check_path

ENGINE_OWN = frozenset({"/v1/generate"})


@dataclass(frozen=True)
class BodyLimits:
    max_bytes: int
    timeout_s: float
    max_depth: int


def _error(status: int, message: str, kind: str) -> bytes:
    return json.dumps({"error": {"message": message, "type": kind, "code": status}}).encode()


def prompt_text(data: Any) -> str | None:
    """The prompt or messages as JSON, cut at 4,000 characters (only for sampled requests: it costs)."""
    prompt = data.get("messages", data.get("prompt")) if isinstance(data, dict) else None
    return None if prompt is None else json.dumps(prompt)[:4000]


class DataPath:
    def __init__(self, gateway: Gateway, keys: GatewayKeys, limits: BodyLimits) -> None:
        self.gateway = gateway
        self.keys = keys
        self.limits = limits

    @staticmethod
    def handles(scope: Scope) -> bool:
        if scope["type"] != "http":
            return False
        path: str = scope["path"]
        return (path.startswith("/v1/") and path not in ENGINE_OWN) or path in ROOT_PATHS

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        method: str = scope["method"]
        checked = check_path(method, scope["path"], scope.get("raw_path"))
        if isinstance(checked, PathRefusal):
            kind = {400: "invalid_request_error", 404: "not_found", 405: "method_not_allowed"}[checked.status]
            await send_simple(send, checked.status, _error(checked.status, checked.message, kind),
                              [(b"allow", checked.allow.encode())] if checked.allow else None)
            return
        headers: list[tuple[bytes, bytes]] = scope.get("headers") or []
        try:
            await self.keys.check(headers)
        except KeyRefusedError as exc:
            await send_simple(send, exc.status, _error(exc.status, str(exc), "authentication_error"
                                                       if exc.status == 401 else "rate_limit"), exc.headers)
            return
        body, tail, data = b"", None, None
        try:
            if method not in ("GET", "HEAD"):
                declared = header(headers, b"content-length")
                if declared is not None and declared.isdigit() and int(declared) > self.limits.max_bytes:
                    raise BodyError(413, f"the body is {int(declared):,} bytes; /v1 takes at most "
                                    f"{self.limits.max_bytes:,} (body_limit_v1_bytes)")
                body, tail = await read_body(receive, self.limits.max_bytes, self.limits.timeout_s)
                content_type = (header(headers, b"content-type") or "").lower()
                if body and (not content_type or "json" in content_type):
                    data = await parse_json_async(body, self.limits.max_depth)
        except BodyError as exc:
            kind = {400: "invalid_request_error", 408: "timeout", 413: "request_too_large"}[exc.status]
            await send_simple(send, exc.status, _error(exc.status, str(exc), kind), [(b"connection", b"close")])
            return
        if tail is not None:  # the client left while sending: nothing to answer
            return
        stream = isinstance(data, dict) and data.get("stream") is True
        asked = with_usage(body, data) if checked in USAGE_PATHS and stream else None
        client = header(headers, b"x-llmops-client") or (scope["client"][0] if scope.get("client") else "")
        model = data.get("model") if isinstance(data, dict) else None
        ledger = self.gateway.ledger
        record = Record(ts=0.0, revision_id=None, model=model[:200] if isinstance(model, str) else "",
                        endpoint=checked, stream=stream, status=0, latency_s=0.0, client=client[:200],
                        max_tokens=asked_max_tokens(data),
                        prompt=prompt_text(data) if ledger is not None and ledger.sample_prompt() else None)
        exchange = Exchange(method=method, path=checked, query=forward_query(scope.get("query_string", b"")),
                            headers=[(k, v) for k, v in headers if k not in HOP_HEADERS and k != b"x-llmops-client"],
                            body=asked or body, stream=stream, hide_usage=asked is not None, record=record)
        await self.gateway.serve(exchange, receive, send)

