"""The engine's own /metrics in Prometheus format, so teams keep their Grafana: engine state and revisions,
restarts and rollbacks, the gateway's queue, request KPIs, vLLM's live figures and GPU telemetry.

Gauges are read from the live objects at scrape time (a custom collector); request counters and latency
histograms are kept by the gateway's ledger as requests finish.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Callable, Iterator
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from engine.schemas import EngineState, StatusOut

LATENCY_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1, 2, 5, 10, 20, 30, 60, 120, 300)
GPU_GAUGES = {  # telemetry metric → (Prometheus name, help)
    "mem_used": ("llmops_gpu_memory_used_bytes", "GPU memory in use (NVML)"),
    "mem_total": ("llmops_gpu_memory_total_bytes", "GPU memory in total (NVML)"),
    "vllm_mem": ("llmops_gpu_vllm_memory_bytes", "GPU memory held by the vLLM child's processes"),
    "util_gpu": ("llmops_gpu_utilization_percent", "GPU utilization"),
    "power_w": ("llmops_gpu_power_watts", "Power draw"),
    "power_limit_w": ("llmops_gpu_power_limit_watts", "Enforced power limit"),
    "temp_c": ("llmops_gpu_temperature_celsius", "GPU temperature"),
    "sm_clock_mhz": ("llmops_gpu_sm_clock_mhz", "SM clock"),
}
SERVING_GAUGES = {
    "requests_running": ("llmops_vllm_requests_running", "Requests in vLLM's running batch"),
    "requests_waiting": ("llmops_vllm_requests_waiting", "Requests waiting inside vLLM"),
    "kv_cache_usage": ("llmops_vllm_kv_cache_usage_ratio", "Share of the KV cache in use"),
    "generation_tokens_per_s": ("llmops_vllm_generation_tokens_per_second", "Generation throughput"),
    "prompt_tokens_per_s": ("llmops_vllm_prompt_tokens_per_second", "Prompt throughput"),
}


LAG_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5)


class LoopLag:
    """How late the engine's event loop runs what is due: the gateway, the controller and every async route share it,
    so a stall here is a stall of every stream through the gateway (``llmops_event_loop_lag_seconds``). It wakes every
    ``every_s`` and records how much later than asked it woke."""

    def __init__(self, registry: CollectorRegistry, every_s: float = 0.1) -> None:
        self.every_s = every_s
        self.histogram = Histogram("llmops_event_loop_lag_seconds", "How much later than due the engine's event loop "
                                   "woke (every 0.1 s): a stall of the gateway itself", buckets=LAG_BUCKETS,
                                   registry=registry)
        self._task: asyncio.Task[None] | None = None

    def start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self._run(), name="loop-lag")

    async def _run(self) -> None:
        while True:
            t0 = time.monotonic()
            await asyncio.sleep(self.every_s)
            self.histogram.observe(max(0.0, time.monotonic() - t0 - self.every_s))

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task


class RequestMetrics:
    """Counters and histograms of /v1 requests, by revision and outcome, since the engine started."""

    def __init__(self, registry: CollectorRegistry) -> None:
        self.requests = Counter("llmops_requests", "Requests through the /v1 gateway", ["revision", "outcome"],
                                registry=registry)
        self.tokens = Counter("llmops_tokens", "Tokens of /v1 requests", ["revision", "kind"], registry=registry)
        self.latency = Histogram("llmops_request_latency_seconds", "End-to-end latency of /v1 requests, queueing "
                                 "in the gateway included", ["revision"], buckets=LATENCY_BUCKETS, registry=registry)
        self.ttft = Histogram("llmops_time_to_first_token_seconds", "Time to first token of streamed /v1 requests",
                              ["revision"], buckets=LATENCY_BUCKETS, registry=registry)
        # by team (a key of no team: "none"; keys not required: "anonymous"): as many series as teams
        self.team_requests = Counter("llmops_team_requests", "Requests through the /v1 gateway by team",
                                     ["team", "outcome"], registry=registry)
        self.team_tokens = Counter("llmops_team_tokens", "Tokens of /v1 requests by team", ["team", "kind"],
                                   registry=registry)
        self.limited = Counter("llmops_limit_refusals", "Requests refused (429) for a key's or team's limit",
                               ["team", "limit"], registry=registry)

        # each metric's series by their label values, as labels() gave them: labels() checks and locks on every
        # call, and a request made nine of them (22 us of the event loop's time a request; no series is removed)
        self._series: dict[tuple[Any, ...], Any] = {}

    def _of(self, metric: Counter | Histogram, *values: str) -> Any:
        key = (id(metric), *values)
        series = self._series.get(key)
        if series is None:
            series = self._series[key] = metric.labels(*values)
        return series

    def observe_team(self, team: str, status: int, error: str | None, input_tokens: int | None,
                     output_tokens: int | None) -> None:
        if status == 429 and error is not None and " " in error:  # the gateway's own refusal: "<scope> <limit>"
            self._of(self.limited, team, error.split(" ", 1)[1]).inc()
        self._of(self.team_requests, team, "error" if status >= 400 or error else "ok").inc()
        if input_tokens:
            self._of(self.team_tokens, team, "input").inc(input_tokens)
        if output_tokens:
            self._of(self.team_tokens, team, "output").inc(output_tokens)

    def observe(self, revision: int | None, status: int, error: str | None, latency_s: float,
                ttft_s: float | None, input_tokens: int | None, output_tokens: int | None) -> None:
        rev = str(revision) if revision is not None else "none"
        outcome = "refused" if status == 503 and revision is None else "error" if status >= 400 or error else "ok"
        self._of(self.requests, rev, outcome).inc()
        if outcome != "ok":
            return
        self._of(self.latency, rev).observe(latency_s)
        if ttft_s is not None:
            self._of(self.ttft, rev).observe(ttft_s)
        if input_tokens:
            self._of(self.tokens, rev, "input").inc(input_tokens)
        if output_tokens:
            self._of(self.tokens, rev, "output").inc(output_tokens)


class EngineCollector(Collector):
    """``status``: the default deployment's (unlabelled, as before deployments); ``deployments``: every one's,
    labelled by deployment; ``gpu``: the latest sample of each node (the engine's host is "local"), labelled."""

    def __init__(self, status: Callable[[], StatusOut], gpu: Callable[[], dict[str, Any]],
                 serving: Callable[[], dict[str, Any] | None], event_counts: Callable[[], dict[str, int]],
                 deployments: Callable[[], list[StatusOut]] = list) -> None:
        self.status = status
        self.gpu = gpu
        self.serving = serving
        self.event_counts = event_counts
        self.deployments = deployments

    def collect(self) -> Iterator[Any]:
        st = self.status()
        state = GaugeMetricFamily("llmops_engine_state", "1 for the engine's current state", labels=["state"])
        for s in EngineState:
            state.add_metric([s.value], 1.0 if st.state == s else 0.0)
        yield state
        for name, value, help_ in (("llmops_running_revision", st.running_revision, "Revision vLLM runs"),
                                   ("llmops_desired_revision", st.desired_revision, "Revision vLLM should run")):
            if value is not None:
                yield GaugeMetricFamily(name, help_, value=value)
        yield CounterMetricFamily("llmops_vllm_restarts", "vLLM starts beyond the first", value=st.restarts)
        counts = self.event_counts()
        for kind, name, help_ in (("rollback", "llmops_rollbacks", "Revisions rolled back"),
                                  ("failed", "llmops_failures", "vLLM failures (failed starts and crashes)"),
                                  ("crash_loop", "llmops_crash_loops", "Crash loops that halted restarts")):
            yield CounterMetricFamily(name, help_, value=counts.get(kind, 0))
        gw = st.gateway
        yield GaugeMetricFamily("llmops_gateway_in_flight", "Requests in flight through the gateway",
                                value=gw.in_flight)
        yield GaugeMetricFamily("llmops_gateway_queue_waiting", "Requests waiting for vLLM", value=gw.waiting)
        yield CounterMetricFamily("llmops_gateway_refused", "Requests refused with 503", value=gw.rejected)
        serving = self.serving() or {}
        for key, (name, help_) in SERVING_GAUGES.items():
            if serving.get(key) is not None:
                yield GaugeMetricFamily(name, help_, value=serving[key])
        yield from self._deployments()
        yield from self._gpu()

    def _deployments(self) -> Iterator[Any]:
        state = GaugeMetricFamily("llmops_deployment_state", "1 for each deployment's current state",
                                  labels=["deployment", "state"])
        running = GaugeMetricFamily("llmops_deployment_running_revision", "Revision a deployment runs",
                                    labels=["deployment"])
        instances = GaugeMetricFamily("llmops_deployment_instances_serving", "Instances the gateway sends to",
                                      labels=["deployment"])
        in_flight = GaugeMetricFamily("llmops_deployment_in_flight", "Requests in flight to a deployment",
                                      labels=["deployment"])
        routed = CounterMetricFamily("llmops_instance_routed_requests", "Requests the gateway sent to an instance, "
                                     "by how it chose it: prefix (it was sent the longest start of the prompt "
                                     "before), home (a prompt seen nowhere, by hashing), load (fewest in flight)",
                                     labels=["deployment", "instance", "how"])
        hits = GaugeMetricFamily("llmops_instance_prefix_cache_hit_ratio", "vLLM's own prefix-cache hit rate of an "
                                 "instance (prompt tokens found in its cache) between the last two scrapes",
                                 labels=["deployment", "instance"])
        kv = GaugeMetricFamily("llmops_instance_kv_cache_usage_ratio", "Share of an instance's KV cache in use "
                               "(vLLM's own metric)", labels=["deployment", "instance"])
        for st in self.deployments():
            for s in EngineState:
                state.add_metric([st.deployment, s.value], 1.0 if st.state == s else 0.0)
            if st.running_revision is not None:
                running.add_metric([st.deployment], st.running_revision)
            instances.add_metric([st.deployment], sum(1 for i in st.instances if i.serving))
            in_flight.add_metric([st.deployment], st.gateway.in_flight)
            for inst in st.instances:
                if inst.routing is None:
                    continue
                for how in ("prefix", "home", "load"):
                    routed.add_metric([st.deployment, inst.name, how], getattr(inst.routing, how))
                if inst.routing.prefix_cache_hit_pct is not None:
                    hits.add_metric([st.deployment, inst.name], inst.routing.prefix_cache_hit_pct / 100)
                if inst.routing.kv_cache_usage is not None:
                    kv.add_metric([st.deployment, inst.name], inst.routing.kv_cache_usage)
        yield from (state, running, instances, in_flight, routed, hits, kv)

    def _gpu(self) -> Iterator[Any]:
        snaps = self.gpu()
        available = GaugeMetricFamily("llmops_gpu_available", "1 when NVML sees GPUs", labels=["node"])
        families = {m: GaugeMetricFamily(n, h, labels=["node", "gpu", "uuid"]) for m, (n, h) in GPU_GAUGES.items()}
        energy = CounterMetricFamily("llmops_gpu_energy_joules", "GPU energy counter", labels=["node", "gpu", "uuid"])
        cpu = GaugeMetricFamily("llmops_host_cpu_percent", "Host CPU use", labels=["node"])
        mem = GaugeMetricFamily("llmops_host_memory_used_bytes", "Host memory in use", labels=["node"])
        rss = GaugeMetricFamily("llmops_host_vllm_rss_bytes", "Resident memory of the vLLM processes", labels=["node"])
        for node, snap in snaps.items():
            available.add_metric([node], 1.0 if snap.available else 0.0)
            for g in snap.gpus:
                if g.lost:
                    continue
                for metric, family in families.items():
                    if g.values.get(metric) is not None:
                        family.add_metric([node, str(g.index), g.uuid], g.values[metric])
                if g.values.get("energy_j") is not None:
                    energy.add_metric([node, str(g.index), g.uuid], g.values["energy_j"])
            if snap.host:
                cpu.add_metric([node], snap.host["cpu_pct"])
                mem.add_metric([node], snap.host["mem_used"])
                rss.add_metric([node], snap.host["vllm_rss"])
        yield available
        yield from families.values()
        yield from (energy, cpu, mem, rss)


class BudgetCollector(Collector):
    """Each team's and gateway key's token budget: what it allows and the share of it used now (the Alertmanager
    rules' budget alerts read the share). ``budgets``: (scope, name, used, limit) of each; read at each scrape."""

    def __init__(self, budgets: Callable[[], list[tuple[str, str, int, int]]]) -> None:
        self.budgets = budgets

    def collect(self) -> Iterator[Any]:
        ratio = GaugeMetricFamily("llmops_budget_used_ratio", "Share of a token budget used this period",
                                  labels=["scope", "name"])
        limit = GaugeMetricFamily("llmops_budget_tokens", "Tokens a budget allows per period", labels=["scope", "name"])
        for scope, name, used, allowed in self.budgets():
            ratio.add_metric([scope, name], used / allowed if allowed else 0.0)
            limit.add_metric([scope, name], allowed)
        yield ratio
        yield limit


def render(registry: CollectorRegistry) -> bytes:
    return generate_latest(registry)
