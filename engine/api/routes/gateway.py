"""The /v1 gateway's routes: vLLM's OpenAI-compatible API, passed through to the ready child, and /v1/generate.
An API key is needed when ``gateway_keys`` says so, with a per-key rate limit."""

from __future__ import annotations

import json
from typing import Annotated

from fastapi import APIRouter, Depends, HTTPException, Request, Response
from fastapi.responses import JSONResponse

from engine.access import Principal, allows
from engine.api.deps import ServicesDep, access
from engine.api.gate import bearer_of
from engine.gateway import GenerateRequest

router = APIRouter(tags=["gateway"])


def gateway_key(request: Request, svc: ServicesDep) -> Principal | None:
    """/v1's own check: an API key (or a prompter's token) when keys are required; its rate limit."""
    if not svc.gateway_keys:
        return None
    token = bearer_of(request.scope)
    principal = svc.auth.authenticate(token) if token else None
    if principal is None or (principal.kind != "gateway" and not allows(principal.role, "prompter")):
        raise HTTPException(401, detail="this gateway needs an API key: Authorization: Bearer <key>",
                            headers={"WWW-Authenticate": "Bearer"})
    limit = principal.rate_limit_per_min
    if limit and principal.token_id is not None and (retry := svc.limits.take(principal.token_id, limit)):
        raise HTTPException(429, detail=f"rate limit of {limit} requests per minute for this key",
                            headers={"Retry-After": str(retry)})
    return principal


KeyDep = Annotated[Principal | None, Depends(gateway_key)]
RESPONSES: dict[int | str, dict[str, str]] = {
    401: {"description": "an API key is needed (gateway_keys)"}, 429: {"description": "this key's rate limit"},
    503: {"description": "vLLM is restarting or stopped (Retry-After)"}}


def client_of(request: Request) -> str:
    """Who sent it: the X-LLMOps-Client header if given (benchmarks tag themselves), else the peer address."""
    return (request.headers.get("x-llmops-client") or (request.client.host if request.client else ""))[:200]


@router.post("/v1/generate", dependencies=access(None), responses=RESPONSES)
async def generate(body: GenerateRequest, request: Request, svc: ServicesDep, _: KeyDep) -> Response:
    """The simple endpoint of a hand-written FastAPI wrapper around vLLM: prompt in, text out."""
    gateway = svc.gateway
    payload = {"model": svc.supervisor.served_model() or "", "prompt": body.prompt,
               "temperature": body.temperature, "max_tokens": body.max_tokens}
    resp = await gateway.forward("POST", "/v1/completions", {}, {"content-type": "application/json"},
                                 json.dumps(payload).encode(), client=client_of(request))
    if resp.status_code != 200 or resp.headers.get("content-type", "").startswith("text/event-stream"):
        return resp
    data = json.loads(bytes(resp.body))
    return JSONResponse({"result": data["choices"][0]["text"]})


async def proxy(path: str, request: Request, svc: ServicesDep, _: KeyDep) -> Response:
    """OpenAI-compatible API of the running vLLM, streaming passed through."""
    body = await request.body()
    return await svc.gateway.forward(request.method, f"/v1/{path}", dict(request.query_params),
                                     dict(request.headers), body, client=client_of(request))


for _method in ("GET", "POST", "PUT", "DELETE", "PATCH"):
    router.add_api_route("/v1/{path:path}", proxy, methods=[_method], name=f"proxy_{_method.lower()}",
                         operation_id=f"proxy_{_method.lower()}", dependencies=access(None), responses=RESPONSES)
