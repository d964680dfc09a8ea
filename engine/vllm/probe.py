"""What the engine asks a vLLM server over HTTP, apart from the gateway's traffic: is it ready (``/health`` answers
200 **and** a real 1-token completion succeeds: vLLM's /health can answer 200 while its engine core is dead), is it
alive (``/health``), and, on CUDA with sleep mode, sleep and wake up (loopback only: vLLM's dev endpoints).

One client serves every such request of a deployment (made once: an httpx client costs a TLS context, 18 ms of CPU
on the event loop, each time it is made). No connection is kept alive between two requests: vLLM closes idle ones
after 5 s, and a probe must not fail on a connection the server has just closed.
"""

from __future__ import annotations

import httpx

READY_TIMEOUT_S = 10.0  # one readiness probe (a loaded host answers a 1-token completion slowly)
HEALTH_TIMEOUT_S = 5.0
SLEEP_TIMEOUT_S = 120.0  # the first sleep moves the weights to host memory (11-13 s on the H200)


async def probe(client: httpx.AsyncClient, url: str, headers: dict[str, str], served_model: str) -> bool:
    """Ready: /health answers 200 and a 1-token completion returns a choice (``headers``: the instance's key, which
    every path of it asks for)."""
    try:
        if (await client.get(f"{url}/health", headers=headers, timeout=READY_TIMEOUT_S)).status_code != 200:
            return False
        resp = await client.post(f"{url}/v1/completions", headers=headers, timeout=READY_TIMEOUT_S,
                                 json={"model": served_model, "prompt": "Hello", "max_tokens": 1, "temperature": 0})
        return resp.status_code == 200 and bool(resp.json().get("choices"))
    except (httpx.HTTPError, ValueError):
        return False


class Prober:
    """The engine's own requests to vLLM servers, through one client made on first use (on the event loop)."""

    def __init__(self) -> None:
        self._client: httpx.AsyncClient | None = None

    @property
    def client(self) -> httpx.AsyncClient:
        if self._client is None:
            self._client = httpx.AsyncClient(timeout=READY_TIMEOUT_S,
                                             limits=httpx.Limits(max_keepalive_connections=0))
        return self._client

    async def ready(self, url: str, headers: dict[str, str], served_model: str) -> bool:
        """One readiness probe of the server at ``url`` (``headers``: its API key)."""
        return await probe(self.client, url, headers, served_model)

    async def alive(self, url: str, headers: dict[str, str]) -> bool:
        """Whether /health answers 200."""
        try:
            return (await self.client.get(f"{url}/health", headers=headers,
                                          timeout=HEALTH_TIMEOUT_S)).status_code == 200
        except httpx.HTTPError:
            return False

    async def sleep(self, url: str, headers: dict[str, str]) -> str | None:
        """Put the server to sleep (level 1: weights to host memory, KV cache dropped); why not, if it would not."""
        try:
            resp = await self.client.post(f"{url}/sleep", params={"level": 1}, headers=headers,
                                          timeout=SLEEP_TIMEOUT_S)
        except httpx.HTTPError as exc:
            return str(exc) or type(exc).__name__
        return None if resp.status_code == 200 else f"HTTP {resp.status_code}"

    async def wake_up(self, url: str, headers: dict[str, str], served_model: str) -> bool:
        """Wake a sleeping server and probe it: whether it serves again."""
        try:
            woken = (await self.client.post(f"{url}/wake_up", headers=headers,
                                            timeout=SLEEP_TIMEOUT_S)).status_code == 200
        except httpx.HTTPError:
            return False
        return woken and await self.ready(url, headers, served_model)

    async def close(self) -> None:
        if self._client is not None:
            await self._client.aclose()
            self._client = None
