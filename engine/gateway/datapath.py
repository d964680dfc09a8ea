"""The data path: every /v1 request (and /tokenize, /detokenize) as raw ASGI, ahead of FastAPI and its
middleware, in the order that keeps it cheap and safe — the route, then the key (before a byte of the body is
read), then the body (size, time, JSON checks), then vLLM. ``/v1/generate``, the engine's own endpoint, is
left to FastAPI."""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

from starlette.types import Receive, Scope, Send

from engine.access.auth import Principal
from engine.access.keys import KeyRefusedError
from engine.bodies import BodyBudget, BodyError, BodyHold, RequestBounds, header, inspect_v1, read_body
from engine.gateway.ledger import Record
from engine.gateway.limits import asked_tokens
from engine.gateway.proxy import (
    GENERATING_PATHS,
    HOP_HEADERS,
    METERED_PATHS,
    USAGE_PATHS,
    Claim,
    Exchange,
    Gateway,
    forward_query,
    model_not_found,
    send_simple,
    with_usage,
)
from engine.gateway.routes import ROOT_PATHS, PathRefusal, check_path
from engine.gateway.routing import PREFIX_BYTES

ENGINE_OWN = frozenset({"/v1/generate"})


@dataclass(frozen=True)
class BodyLimits:
    max_bytes: int
    timeout_s: float
    max_depth: int
    budget_bytes: int = 128 << 20  # all requests' bodies together (v1_body_budget_bytes)
    first_byte_s: float | None = None  # body_first_byte_s
    bounds: RequestBounds = field(default_factory=RequestBounds)  # what one request may ask (v1_max_n, …)
    bytes_per_token: float = 1.0  # limit_bytes_per_token
    unasked_max_tokens: int = 1024  # limit_unasked_max_tokens


def _error(status: int, message: str, kind: str) -> bytes:
    return json.dumps({"error": {"message": message, "type": kind, "code": status}}).encode()


def prompt_text(data: Any) -> str | None:
    """The prompt or messages of a parsed body as JSON, cut at 4,000 characters."""
    prompt = data.get("messages", data.get("prompt")) if isinstance(data, dict) else None
    return None if prompt is None else json.dumps(prompt)[:4000]


BODY_KINDS = {400: "invalid_request_error", 408: "timeout", 413: "request_too_large", 503: "service_unavailable"}


class KeyCheck(Protocol):
    """Who sends a request, from its head (engine.access.GatewayKeys; a worker asks the engine's)."""

    async def check(self, headers: list[tuple[bytes, bytes]]) -> Principal | None: ...


class DataPath:
    def __init__(self, gateway: Gateway, keys: KeyCheck, limits: BodyLimits,
                 budget: BodyBudget | None = None, models: Callable[[], list[dict[str, Any]]] | None = None) -> None:
        self.gateway = gateway
        self.keys = keys
        self.limits = limits
        self.budget = budget or BodyBudget(limits.budget_bytes)
        # GET /v1/models is answered here from the deployments that serve (None: forwarded to vLLM), so a client
        # sees every model of the gateway, and never a model's folder on this host (vLLM's `root`)
        self.models = models

    async def list_models(self, principal: Principal | None) -> bytes | None:
        """GET /v1/models's answer: the models the caller may use (None: vLLM answers)."""
        if self.models is None:
            return None
        models = [m for m in self.models() if principal is None or principal.may_use(m.get("deployment"))]
        return json.dumps({"object": "list", "data": [
            {k: v for k, v in m.items() if k != "deployment"} for m in models]}).encode()

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
            principal = await self.keys.check(headers)
        except KeyRefusedError as exc:
            kind = {401: "authentication_error", 429: "rate_limit"}.get(exc.status, "service_unavailable")
            await send_simple(send, exc.status, _error(exc.status, str(exc), kind), exc.headers)
            return
        if checked == "/v1/models" and (listed := await self.list_models(principal)) is not None:
            await send_simple(send, 200, listed)
            return
        # the body's bytes count in its key's share of the budget (its peer's, with no key)
        owner = f"key:{principal.token_id}" if principal is not None else (
            f"peer:{scope['client'][0]}" if scope.get("client") else "peer:")
        hold = self.budget.hold(owner)
        try:
            exchange = await self._exchange(scope, receive, send, method, checked, headers, hold, principal)
            if exchange is not None and principal is not None and not principal.may_use(
                    exchange.admission.deployment if exchange.admission is not None else None):
                # a key limited to other deployments: the model does not exist for it (as OpenAI answers)
                await send_simple(send, 404, model_not_found(exchange.record.model or "(none)"))
                return
            if exchange is not None:  # (the body is referenced by the exchange alone: let go once vLLM has it)
                exchange.on_sent = hold.release
                await self.gateway.serve(exchange, receive, send)
        finally:
            hold.release()

    async def _exchange(self, scope: Scope, receive: Receive, send: Send, method: str, checked: str,
                        headers: list[tuple[bytes, bytes]], hold: BodyHold,
                        principal: Principal | None = None) -> Exchange | None:
        """The request to forward, its body read within the limits and the budget; None when it was answered."""
        body, tail, fields = b"", None, None
        try:
            if method not in ("GET", "HEAD"):
                declared = header(headers, b"content-length")
                if declared is not None and declared.isdigit():
                    if int(declared) > self.limits.max_bytes:
                        raise BodyError(413, f"the body is {int(declared):,} bytes; /v1 takes at most "
                                        f"{self.limits.max_bytes:,} (body_limit_v1_bytes)")
                    hold.check_declared(int(declared))  # refused before a byte is read if it cannot fit now
                body, tail = await read_body(receive, self.limits.max_bytes, self.limits.timeout_s, hold,
                                             self.limits.first_byte_s)
                content_type = (header(headers, b"content-type") or "").lower()
                if body and (not content_type or "json" in content_type):
                    fields = await inspect_v1(body, self.limits.max_depth)
                    if fields.is_object:
                        self.limits.bounds.check(fields, checked)
        except BodyError as exc:
            await send_simple(send, exc.status, _error(exc.status, str(exc), BODY_KINDS[exc.status]),
                              [(b"connection", b"close"), *exc.headers])
            return None
        if tail is not None:  # the client left while sending: nothing to answer
            return None
        stream = fields is not None and fields.stream
        asked = with_usage(body, fields) if fields is not None and checked in USAGE_PATHS and stream else None
        client = header(headers, b"x-llmops-client") or (scope["client"][0] if scope.get("client") else "")
        model = fields.model if fields is not None else None
        ledger = self.gateway.ledger
        admission = await self.gateway.resolve(model)
        record = Record(ts=0.0, revision_id=None, model=model[:200] if model else "",
                        endpoint=checked, stream=stream, status=0, latency_s=0.0, client=client[:200],
                        max_tokens=fields.max_tokens_for(checked) if fields is not None else None,
                        prompt=fields.prompt_text() if fields is not None and ledger is not None
                        and ledger.sample_prompt() else None,
                        key_id=principal.token_id if principal is not None else None)
        limits = self.limits
        prompt, tokens = asked_tokens(len(body), fields.max_tokens_for(checked), fields.n, fields.best_of,
                                      fields.prompts, limits.bytes_per_token,
                                      limits.unasked_max_tokens if checked in GENERATING_PATHS else 0
                                      ) if fields else (0, 0)
        # without a key a request's flow is its peer's address (the x-llmops-client header is the client's own
        # word: one that changed it on every request would jump the fair queue each time)
        peer = scope["client"][0] if scope.get("client") else ""
        claim = Claim(record.key_id, peer, prompt, tokens, checked in METERED_PATHS)
        return Exchange(method=method, path=checked, query=forward_query(scope.get("query_string", b"")),
                        headers=[(k, v) for k, v in headers if k not in HOP_HEADERS and k != b"x-llmops-client"],
                        body=asked or body, stream=stream, hide_usage=asked is not None, record=record,
                        admission=admission, claim=claim,
                        stream_interval=(fields.stream_interval or 1) if fields is not None
                        and checked in USAGE_PATHS else 1,  # (the Responses API and Messages do not take it)
                        prompt=fields.prompt_bytes(PREFIX_BYTES) if fields is not None and admission is not None
                        and admission.by_prefix else None)
