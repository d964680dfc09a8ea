"""The scenarios of ``python -m bench``, by name, each a module of this package with a line that says what it
measures. The modules are imported only when their scenario runs (or shows its help): listing them costs nothing."""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from types import ModuleType


@dataclass(frozen=True)
class Scenario:
    name: str
    module: str
    summary: str
    needs: str  # what it starts: the scenario list says so before anything is run

    def load(self) -> ModuleType:
        return importlib.import_module(f"bench.scenarios.{self.module}")


SCENARIOS = {s.name: s for s in (
    Scenario("gateway-overhead", "gateway_overhead", "vLLM's serving benchmark direct to vLLM and through the /v1 "
             "gateway, alternated; the gateway's cap of N against vLLM restarted with N; the plans and starts of "
             "applies after it", "engine + vLLM"),
    Scenario("routing", "routing", "two replicas behind the gateway, routing by prefix against least outstanding "
             "on a shared-prefix load and on one without (alternated, a soft change between runs), and the routing "
             "decision's own cost", "engine + vLLM x2"),
    Scenario("routing-events", "routing_events", "would vLLM's KV-cache events beat the gateway's estimate: two "
             "replicas publishing their events behind a router in the bench that alternates least outstanding, the "
             "engine's prefix estimate and routing by the events (tokenized prompts), on a shared-prefix load",
             "vLLM x2 (no engine)"),
    Scenario("scale-to-zero", "scale_to_zero", "a deployment scaled to zero and woken by one request, N times: "
             "the first token from zero against vLLM's own wake-up and an awake request's first token",
             "engine + vLLM"),
    Scenario("many-models", "many_models", "N deployments that do not fit a GPU together, taking turns on it: each "
             "called in turn, the one before put to sleep for it; the first token of a switch against an awake one",
             "engine + vLLM xN"),
    Scenario("limits", "limits", "what keys' and teams' limits and usage add to a request at a fixed rate (a key "
             "with limits against one without, alternated), and a light key's first token beside a key at ten times "
             "its rate at capacity: fair queues against first come, first served", "engine + stub, or + vLLM"),
    Scenario("lora", "lora", "LoRA adapters: registering one while it serves until its first answer, and vLLM's "
             "serving benchmark with N adapters in one batch against the base model alone (alternated)",
             "engine + vLLM"),
    Scenario("relay-ceiling", "relay_ceiling", "the gateway's data path with 0, 1, 2, ... worker processes "
             "against a stub upstream that streams as fast as it can: tokens/s and the gateway's CPU per 1,000",
             "gateway + stub"),
    Scenario("apply-gap", "apply_gap", "N streaming clients while revisions are applied: the longest stretch with "
             "no completed request, failures, the plan and its predicted time against the real one", "engine + vLLM"),
    Scenario("fleet", "fleet_rolling", "a deployment of two replicas on a two-node Ray cluster on this host: a "
             "rolling apply under load, then a node killed", "engine + vLLM + Ray"),
    Scenario("autoscale", "autoscale_sine", "the demo model autoscaled between 1 and 2 replicas on a two-node Ray "
             "cluster under a sine-wave load: failures, replica-seconds against two held, TTFT P95 per minute "
             "against twice the unloaded", "engine + vLLM x2 + Ray"),
    Scenario("deployments", "deployments_side_by_side", "two deployments side by side: the untouched one's "
             "throughput while the other is applied (and a bad revision of it)", "engine + vLLM"),
    Scenario("start-kinds", "start_kinds", "real vLLM starts of every kind this host makes, each with the ETA the "
             "engine gave it (the replay fixtures of tests/fixtures/starts/)", "engine + vLLM"),
    Scenario("crash-detect", "crash_detect", "SIGKILL of vLLM under load: how fast the engine sees it, and what "
             "clients see", "engine + vLLM"),
    Scenario("builtin-benchmarks", "builtin_benchmarks", "the product's own guided search and concurrency sweep "
             "through its API, fresh prompts against one seed", "engine + vLLM"),
    Scenario("guided-search", "gpu_session", "the engine's guided search for max_num_seqs on a GPU model: its "
             "levels, tokens per joule, KPIs and capacity predictions", "engine + vLLM (GPU)"),
    Scenario("capacity-cpu", "capacity_cpu", "the capacity model's KV tokens against what vLLM logs on the CPU "
             "build, six settings of the demo model", "vLLM x6 (CPU)"),
    Scenario("capacity-gpu", "gpu_accuracy", "the capacity model's KV tokens against what vLLM logs on a GPU, six "
             "settings, calibrated as the engine is", "vLLM x6 (GPU)"),
    Scenario("capacity-archs", "capacity_archs", "the capacity model on five architectures (Gemma 3, Mistral, "
             "DeepSeek-V2-Lite, Qwen3 MoE and dense), each started twice: one calibrates, one is held out",
             "vLLM x10 (GPU)"),
    Scenario("signin-flood", "signin_flood", "300 wrong sign-ins, 48 at a time: the engine's CPU and memory, and "
             "/healthz latency meanwhile", "engine"),
    Scenario("edge-heads", "edge_heads", "/healthz latency while a connection sends 96 MiB request heads, engine "
             "and console, per checkout", "engine, console"),
    Scenario("body-budget", "body_budget", "the engine's memory while clients each send a ~31 MiB /v1 body, per "
             "checkout and body shape", "engine"),
    Scenario("engine-startup", "engine_startup", "seconds from `llmops engine` to /healthz, checkouts side by side, "
             "and whether Ray was imported", "engine"),
    Scenario("store-latency", "store_latency", "one store operation on SQLite and PostgreSQL (one serialized "
             "transaction each)", "PostgreSQL"),
    Scenario("telemetry-cost", "telemetry_cost", "CPU of one GPU-sampling tick (NVML reads, SQLite write, alert "
             "rules), scripted GPUs or the real driver", "nothing"),
    Scenario("prompt-list", "prompt_list_size", "size of the saved-prompt list the playground reads, prompts as "
             "large as accepted", "nothing"),
    Scenario("session", "session", "several scenarios in turn, each in its own process with a time limit, "
             "progress.txt and DONE: one GPU session as data (the profile's knobs)", "what its scenarios start"),
)}
