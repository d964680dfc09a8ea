"""Serving metrics: the vLLM child's Prometheus ``/metrics``, parsed with prometheus_client's text parser.

Metric names change between vLLM releases (``gpu_cache_usage_perc`` → ``kv_cache_usage_perc``,
``time_per_output_token_seconds`` → ``inter_token_latency_seconds``, …): ``NAMES`` maps each figure the product
uses to the names it has had, newest first, in one place.
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import httpx
from prometheus_client.parser import text_string_to_metric_families
from sqlalchemy.exc import SQLAlchemyError

from engine.aio import cancel_and_wait
from engine.db import SERVING_FINISH_REASONS, SERVING_METRICS
from engine.metrics.series import SeriesStore

log = logging.getLogger("llmops.metrics")

# Our name → vLLM's names over releases (family names as prometheus_client reports them: counters lose _total).
NAMES: dict[str, tuple[str, ...]] = {
    "requests_running": ("vllm:num_requests_running",),
    "requests_waiting": ("vllm:num_requests_waiting",),
    "kv_cache_usage": ("vllm:kv_cache_usage_perc", "vllm:gpu_cache_usage_perc", "vllm:cpu_cache_usage_perc"),
    "preemptions": ("vllm:num_preemptions", "vllm:num_preemptions_total"),
    "prompt_tokens": ("vllm:prompt_tokens", "vllm:prompt_tokens_total"),
    "generation_tokens": ("vllm:generation_tokens", "vllm:generation_tokens_total"),
    "requests_finished": ("vllm:request_success", "vllm:request_success_total"),
    "ttft_seconds": ("vllm:time_to_first_token_seconds",),
    "itl_seconds": ("vllm:inter_token_latency_seconds", "vllm:time_per_output_token_seconds"),
    "e2e_seconds": ("vllm:e2e_request_latency_seconds",),
    "queue_seconds": ("vllm:request_queue_time_seconds",),
    # prompt tokens looked up in the prefix cache, and those found there (vLLM 0.10 and older: gpu_prefix_cache_*)
    "prefix_cache_queries": ("vllm:prefix_cache_queries", "vllm:gpu_prefix_cache_queries"),
    "prefix_cache_hits": ("vllm:prefix_cache_hits", "vllm:gpu_prefix_cache_hits"),
}
GAUGES = ("requests_running", "requests_waiting", "kv_cache_usage")
FINISH_REASONS = SERVING_FINISH_REASONS
# What the history keeps of each scrape (its columns, engine/db/tables.py), keyed by the revision that was serving.
HISTORY_METRICS = SERVING_METRICS
COUNTERS = ("preemptions", "prompt_tokens", "generation_tokens", "prefix_cache_queries", "prefix_cache_hits")
HISTOGRAMS = ("ttft_seconds", "itl_seconds", "e2e_seconds", "queue_seconds")


@dataclass
class Histogram:
    """Cumulative bucket counts (upper bound → count), summed over label sets."""

    buckets: dict[float, float] = field(default_factory=dict)
    count: float = 0.0
    total: float = 0.0

    def minus(self, earlier: Histogram | None) -> Histogram:
        """The observations made since ``earlier`` (counters only grow, unless vLLM restarted)."""
        if earlier is None or self.count < earlier.count:
            return self
        return Histogram({le: c - earlier.buckets.get(le, 0.0) for le, c in self.buckets.items()},
                         self.count - earlier.count, self.total - earlier.total)

    def quantile(self, q: float) -> float | None:
        """Prometheus' histogram_quantile: linear interpolation inside the bucket that holds rank q."""
        if self.count <= 0:
            return None
        rank = q * self.count
        lower_bound, lower_count = 0.0, 0.0
        for le in sorted(self.buckets):
            count = self.buckets[le]
            if count >= rank:
                if math.isinf(le):
                    return lower_bound
                if count == lower_count:
                    return le
                return lower_bound + (le - lower_bound) * (rank - lower_count) / (count - lower_count)
            lower_bound, lower_count = le, count
        return lower_bound

    @property
    def mean(self) -> float | None:
        return self.total / self.count if self.count else None


@dataclass
class Scrape:
    ts: float
    gauges: dict[str, float] = field(default_factory=dict)
    counters: dict[str, float] = field(default_factory=dict)
    finished: dict[str, float] = field(default_factory=dict)  # finish reason → requests
    histograms: dict[str, Histogram] = field(default_factory=dict)


def parse(text: str, ts: float) -> Scrape:
    families = {f.name: f for f in text_string_to_metric_families(text)}
    out = Scrape(ts)
    for ours, names in NAMES.items():
        fam = next((families[n] for n in names if n in families), None)
        if fam is None:
            continue
        if ours in HISTOGRAMS:
            out.histograms[ours] = _histogram(fam.samples)
        elif ours == "requests_finished":
            for s in fam.samples:
                if s.name.endswith("_total"):
                    reason = s.labels.get("finished_reason") or s.labels.get("finish_reason") or "unknown"
                    out.finished[reason] = out.finished.get(reason, 0.0) + s.value
        else:
            value = sum(s.value for s in fam.samples if not s.name.endswith(("_created",)))
            (out.gauges if ours in GAUGES else out.counters)[ours] = value
    return out


def _histogram(samples: Iterable[Any]) -> Histogram:
    h = Histogram()
    for s in samples:
        if s.name.endswith("_bucket"):
            le = float(s.labels["le"])
            h.buckets[le] = h.buckets.get(le, 0.0) + s.value
        elif s.name.endswith("_count"):
            h.count += s.value
        elif s.name.endswith("_sum"):
            h.total += s.value
    return h


def derive(now: Scrape, before: Scrape | None) -> dict[str, Any]:
    """Live figures: gauges as they are, token and preemption rates and latency quantiles since ``before``."""
    out: dict[str, Any] = {"ts": now.ts, **now.gauges}
    dt = now.ts - before.ts if before is not None else 0.0
    for name in COUNTERS:
        value = now.counters.get(name)
        prev = before.counters.get(name) if before is not None else None
        out[f"{name}_total"] = value
        rate = (value - prev) / dt if value is not None and prev is not None and dt > 0 and value >= prev else None
        out[f"{name}_per_s"] = None if rate is None else round(rate, 3)
    for name, hist in now.histograms.items():
        recent = hist.minus(before.histograms.get(name) if before is not None else None)
        for q in (0.5, 0.95, 0.99):
            value = recent.quantile(q)
            out[f"{name}_p{int(q * 100)}"] = None if value is None else round(value, 4)
    use = cache_use(now, before)
    out["prefix_cache_hit_pct"] = None if before is None or use is None else use.hit_pct
    out["finished"] = dict(now.finished)
    for reason in FINISH_REASONS:
        value, prev = now.finished.get(reason), before.finished.get(reason) if before is not None else None
        ok = value is not None and prev is not None and dt > 0 and value >= prev
        out[f"finished_{reason}_per_s"] = round((value - prev) / dt, 3) if ok else None  # type: ignore[operator]
    return out


@dataclass(frozen=True)
class CacheUse:
    """Prompt tokens vLLM looked up in its prefix cache over a stretch, and how many it found there."""

    queries: float
    hits: float

    @property
    def hit_pct(self) -> float | None:
        """The share of prompt tokens served from the prefix cache (None: no lookup, e.g. caching off)."""
        return round(100 * self.hits / self.queries, 1) if self.queries > 0 else None

    def __add__(self, other: CacheUse) -> CacheUse:
        return CacheUse(self.queries + other.queries, self.hits + other.hits)


def cache_use(after: Scrape, before: Scrape | None) -> CacheUse | None:
    """The prefix cache's lookups and hits between two scrapes of one vLLM (counters only grow: lower counts in
    ``after`` mean vLLM restarted, and all of ``after`` is new); None when vLLM exports no such counters."""
    queries, hits = after.counters.get("prefix_cache_queries"), after.counters.get("prefix_cache_hits")
    if queries is None or hits is None:
        return None
    q0 = before.counters.get("prefix_cache_queries") if before is not None else None
    h0 = before.counters.get("prefix_cache_hits") if before is not None else None
    if q0 is None or h0 is None or queries < q0 or hits < h0:
        return CacheUse(queries, hits)
    return CacheUse(queries - q0, hits - h0)


class Scraped(Protocol):
    """An instance that serves, as the monitor sees it (the gateway's upstream): where it listens, its key, and
    where its KV cache's use and prefix-cache hit rate go (routing reads them)."""

    url: str
    auth: tuple[bytes, bytes] | None
    kv_usage: float | None
    cache_hit_pct: float | None
    instance: str

    def route_tally(self) -> tuple[int, int]:
        """Its requests routed by prefix, and all its requests, since it opened."""
        ...


class ServingMonitor:
    """Scrapes the ready vLLM child every few seconds; ``latest`` holds the live figures (of the first instance
    that serves: the deployment's history); every other instance that serves is scraped too, for its KV cache's
    use and prefix-cache hit rate (``instances``)."""

    def __init__(self, interval_s: float, upstream: Callable[[], str | None],
                 revision: Callable[[], int | None] = lambda: None, history: SeriesStore | None = None,
                 headers: Callable[[], dict[str, str]] = dict,
                 instances: Callable[[], Sequence[Scraped]] = tuple, instance_history: SeriesStore | None = None,
                 deployment_id: int | None = None,
                 scaling: Callable[[], dict[str, float | None] | None] = lambda: None,
                 scaling_history: SeriesStore | None = None) -> None:
        self.interval_s = interval_s
        self.upstream = upstream
        self.headers = headers  # the child's key: every path of it asks for one (engine/vllm_guard.py)
        self.revision = revision
        self.history = history
        self.instances = instances
        self.latest: dict[str, Any] | None = None
        self.error: str | None = None
        self._previous: Scrape | None = None
        self._source: str | None = None
        self._task: asyncio.Task[None] | None = None
        self._each: dict[str, Scrape] = {}  # each instance's previous scrape, by its address
        self.instance_history = instance_history  # each instance's figures over time, keyed "DEPLOYMENT/INSTANCE"
        self.deployment_id = deployment_id
        self._tallies: dict[str, tuple[float, int, int]] = {}  # by address: when, routed by prefix, routed in all
        self.scaling = scaling  # the deployment's replicas serving and wanted, and its load, now (SCALING_METRICS)
        self.scaling_history = scaling_history  # those over time: written with or without a vLLM to scrape

    def start(self) -> None:
        self._task = asyncio.create_task(self._run(), name="serving-monitor")

    async def stop(self) -> None:
        await cancel_and_wait(self._task)

    async def _run(self) -> None:
        """Scrape every ``interval_s``, and at once when a new child becomes ready."""
        last = 0.0
        async with httpx.AsyncClient(timeout=5.0) as client:
            while True:
                if time.monotonic() - last >= self.interval_s or self.upstream() != self._source:
                    last = time.monotonic()
                    await self.scrape_once(client)
                    await self.record_scaling()
                await asyncio.sleep(0.5)

    async def record_scaling(self) -> None:
        """One row of the deployment's replicas against its load (scaled to zero too: nothing to scrape then)."""
        row = self.scaling()
        if self.scaling_history is None or row is None:
            return
        try:
            await asyncio.to_thread(self.scaling_history.write, time.time(),
                                    [{"deployment": self.deployment_id, **row}])
        except SQLAlchemyError as exc:
            log.warning("scaling history: could not record a row: %s", exc)

    async def scrape_once(self, client: httpx.AsyncClient) -> None:
        url = self.upstream()
        if url is None:
            self.latest, self._previous, self._source = None, None, None
            return
        if url != self._source:  # a new child: its counters start again
            self._previous, self._source = None, url
        try:
            resp = await client.get(f"{url}/metrics", headers=self.headers())
            resp.raise_for_status()
        except httpx.HTTPError as exc:
            self.error = f"cannot read vLLM's /metrics: {type(exc).__name__}"
            return
        try:
            scrape = parse(resp.text, time.time())
        except ValueError:  # not Prometheus text (a proxy's page, a stub): this scrape is lost, not the monitor
            self.error = f"vLLM's /metrics at {url} is not Prometheus text: is it vLLM?"
            return
        first = self._previous is None
        self.latest = derive(scrape, self._previous)
        self.error = None
        self._previous = scrape
        await self._scrape_instances(client, url, scrape)
        if self.history is not None and not first:  # rates need two scrapes of the same child
            row = {"revision": self.revision(), **{m: self.latest.get(m) for m in HISTORY_METRICS}}
            try:
                await asyncio.to_thread(self.history.write, scrape.ts, [row])
            except SQLAlchemyError as exc:  # the live figures go on; the history has a gap until it is back
                self.error = f"cannot record the serving history: {type(exc).__name__}"
                log.warning("serving history: could not record a scrape: %s", exc)

    async def _scrape_instances(self, client: httpx.AsyncClient, first_url: str, first: Scrape) -> None:
        """Each instance that serves: its KV cache's use and its prefix-cache hit rate since the last scrape (the
        first instance's from the scrape just made). One that does not answer keeps no stale figure."""
        seen: dict[str, Scrape] = {}
        rows: list[dict[str, Any]] = []
        for inst in list(self.instances()):
            scrape: Scrape | None = first if inst.url == first_url else None
            if scrape is None:
                headers = {inst.auth[0].decode(): inst.auth[1].decode()} if inst.auth else {}
                try:
                    resp = await client.get(f"{inst.url}/metrics", headers=headers)
                    resp.raise_for_status()
                    scrape = parse(resp.text, time.time())
                except (httpx.HTTPError, ValueError):
                    inst.kv_usage = inst.cache_hit_pct = None
                    continue
            usage = scrape.gauges.get("kv_cache_usage")
            inst.kv_usage = float(usage) if usage is not None else None
            before = self._each.get(inst.url)
            use = cache_use(scrape, before) if before is not None else None
            if use is not None and use.queries > 0:  # no lookups since the last scrape: the last rate stands
                inst.cache_hit_pct = use.hit_pct
            seen[inst.url] = scrape
            row = self._instance_row(inst, scrape.ts)
            if row is not None:
                rows.append(row)
        self._each = seen
        self._tallies = {url: t for url, t in self._tallies.items() if url in seen}
        if self.instance_history is not None and rows:
            try:
                await asyncio.to_thread(self.instance_history.write, first.ts, rows)
            except SQLAlchemyError as exc:
                log.warning("instance history: could not record a scrape: %s", exc)

    def _instance_row(self, inst: Scraped, ts: float) -> dict[str, Any] | None:
        """One instance's figures since its last scrape: requests routed to it a second, the share of them routed
        by prefix, vLLM's prefix-cache hit rate and KV-cache use; None at its first scrape (rates need two)."""
        by_prefix, total = inst.route_tally()
        before = self._tallies.get(inst.url)
        self._tallies[inst.url] = (ts, by_prefix, total)
        if before is None or ts <= before[0] or total < before[2]:
            return None
        routed = total - before[2]
        return {"instance": f"{self.deployment_id}/{inst.instance}",
                "requests_per_s": routed / (ts - before[0]),
                "prefix_routed_share": (by_prefix - before[1]) / routed if routed else None,
                "prefix_cache_hit_pct": inst.cache_hit_pct, "kv_cache_usage": inst.kv_usage}
