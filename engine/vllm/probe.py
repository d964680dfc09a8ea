"""What the engine asks a vLLM server over HTTP, apart from the gateway's traffic: is it ready (``/health`` answers
200 **and** a real 1-token completion succeeds: vLLM's /health can answer 200 while its engine core is dead), is it
alive (``/health``), and, on CUDA with sleep mode, sleep and wake up (loopback only: vLLM's dev endpoints)."""

from __future__ import annotations

import httpx

READY_TIMEOUT_S = 10.0  # one readiness probe (a loaded host answers a 1-token completion slowly)
HEALTH_TIMEOUT_S = 5.0
SLEEP_TIMEOUT_S = 120.0  # the first sleep moves the weights to host memory (11-13 s on the H200)


async def probe(client: httpx.AsyncClient, served_model: str) -> bool:
    """Ready: /health answers 200 and a 1-token completion returns a choice (``client`` has the base URL and the
    instance's key)."""
    try:
        if (await client.get("/health")).status_code != 200:
            return False
        resp = await client.post("/v1/completions",
                                 json={"model": served_model, "prompt": "Hello", "max_tokens": 1, "temperature": 0})
        return resp.status_code == 200 and bool(resp.json().get("choices"))
    except (httpx.HTTPError, ValueError):
        return False


async def ready(url: str, headers: dict[str, str], served_model: str) -> bool:
    """One readiness probe of the server at ``url``."""
    async with httpx.AsyncClient(base_url=url, timeout=READY_TIMEOUT_S, headers=headers) as client:
        return await probe(client, served_model)


async def alive(url: str) -> bool:
    """Whether /health answers 200."""
    try:
        async with httpx.AsyncClient(timeout=HEALTH_TIMEOUT_S) as client:
            return (await client.get(f"{url}/health")).status_code == 200
    except httpx.HTTPError:
        return False


async def sleep(url: str) -> str | None:
    """Put the server to sleep (level 1: weights to host memory, KV cache dropped); why not, if it would not."""
    try:
        async with httpx.AsyncClient(base_url=url, timeout=SLEEP_TIMEOUT_S) as client:
            resp = await client.post("/sleep", params={"level": 1})
    except httpx.HTTPError as exc:
        return str(exc) or type(exc).__name__
    return None if resp.status_code == 200 else f"HTTP {resp.status_code}"


async def wake_up(url: str, headers: dict[str, str], served_model: str) -> bool:
    """Wake a sleeping server and probe it: whether it serves again."""
    try:
        async with httpx.AsyncClient(base_url=url, timeout=SLEEP_TIMEOUT_S, headers=headers) as client:
            return (await client.post("/wake_up")).status_code == 200 and await probe(client, served_model)
    except httpx.HTTPError:
        return False
