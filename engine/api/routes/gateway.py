"""The engine's own /v1 route: ``/v1/generate``, the simple endpoint of a hand-written wrapper around vLLM. Every
other /v1 path is the raw data path's (engine/gateway/datapath.py), ahead of FastAPI. The gate has checked the
API key (when ``gateway_keys`` says so) and its rate limit before the body was read."""

from __future__ import annotations

import json

from fastapi import APIRouter, Depends, Request, Response
from fastapi.responses import JSONResponse

from engine.api.deps import SendsTo, ServicesDep, access, default_deployment
from engine.gateway import GenerateRequest

router = APIRouter(tags=["gateway"])

RESPONSES: dict[int | str, dict[str, str]] = {
    401: {"description": "an API key is needed (gateway_keys)"}, 429: {"description": "this key's rate limit"},
    503: {"description": "vLLM is restarting or stopped (Retry-After)"}}


def client_of(request: Request) -> str:
    """Who sent it: the X-LLMOps-Client header if given (benchmarks tag themselves), else the peer address."""
    return (request.headers.get("x-llmops-client") or (request.client.host if request.client else ""))[:200]


@router.post("/v1/generate", dependencies=[*access(None), Depends(SendsTo(default_deployment))],
             responses={**RESPONSES, 404: {"description": "this key is limited to other deployments"}})
async def generate(body: GenerateRequest, request: Request, svc: ServicesDep) -> Response:
    """Prompt in, text out: ``{"prompt", "temperature", "max_tokens"}`` → ``{"result"}``."""
    default = svc.fleet.default
    payload = {"model": default.controller.served_model() or default.name, "prompt": body.prompt,
               "temperature": body.temperature, "max_tokens": body.max_tokens}
    status, content = await svc.gateway.complete("/v1/completions", json.dumps(payload).encode(),
                                                 client_of(request), model=default.name)
    if status != 200:
        return Response(content, status_code=status, media_type="application/json",
                        headers={"Retry-After": str(svc.gateway.retry_after_s)} if status == 503 else None)
    try:
        text = json.loads(content)["choices"][0]["text"]
    except (ValueError, KeyError, IndexError, TypeError):
        return JSONResponse({"error": {"message": "vLLM's answer had no text", "type": "upstream_error",
                                       "code": 502}}, status_code=502)
    return JSONResponse({"result": text})
