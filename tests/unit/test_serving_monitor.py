"""The serving monitor's scrape of vLLM's /metrics outlives an answer that is not Prometheus text: it says so and
scrapes again (an upstream answering ``{}`` there once ended the monitor's task for good, found by issue 34's
service tests against a stub upstream)."""

from __future__ import annotations

import asyncio
from pathlib import Path

import httpx

from engine.metrics import ServingMonitor

REAL_SCRAPE = (Path(__file__).parent.parent / "fixtures" / "vllm-0.32-cpu-metrics.txt").read_text()


def test_a_metrics_page_that_is_not_prometheus_text_is_an_error_and_the_next_scrape_works() -> None:
    answers = iter(["{}", REAL_SCRAPE])
    monitor = ServingMonitor(5.0, lambda: "http://vllm", lambda: 1)
    transport = httpx.MockTransport(lambda _: httpx.Response(200, text=next(answers)))

    async def twice() -> list[str | None]:
        seen = []
        async with httpx.AsyncClient(transport=transport) as client:
            for _ in range(2):
                await monitor.scrape_once(client)
                seen.append(monitor.error)
        return seen

    first, second = asyncio.run(twice())
    assert first is not None and "not Prometheus text" in first
    assert second is None and monitor.latest is not None
