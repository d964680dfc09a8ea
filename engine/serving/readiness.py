"""Readiness of a vLLM child: /health answers 200 **and** a real 1-token completion succeeds (vLLM's /health can
answer 200 while its engine core is dead)."""

from __future__ import annotations

import httpx


async def probe(client: httpx.AsyncClient, served_model: str) -> bool:
    try:
        if (await client.get("/health")).status_code != 200:
            return False
        resp = await client.post("/v1/completions",
                                 json={"model": served_model, "prompt": "Hello", "max_tokens": 1, "temperature": 0})
        return resp.status_code == 200 and bool(resp.json().get("choices"))
    except (httpx.HTTPError, ValueError):
        return False
