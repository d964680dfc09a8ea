"""Pre-flight: check a settings revision against the capacity model before it is written.

Errors refuse the write (HTTP 422, nothing written) unless the operator forces it; warnings are recorded with the
revision. Every finding names the value that would fit. What the capacity model does not model for this model and
these settings is a ``capacity_approximate`` warning naming the feature and how far the prediction may be off.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from dataclasses import field as dc_field
from pathlib import Path
from typing import Any

from engine.capacity.kv import layer_kinds
from engine.capacity.model import (
    GIB,
    Calibration,
    Device,
    ModelShape,
    Prediction,
    extra_flags,
    load_shape,
    model_limit,
    predict,
    utilization_for,
)
from engine.revisions import EngineSettings, hf_hub_cache, resolve_local_model
from engine.schemas import MIN_SUGGESTED_MODEL_LEN

SAFE_UTILIZATION = (0.80, 0.85)
# kept free beside each further instance on a GPU: allocator slack, the CUDA context of the next one (measured on
# the H200 with two instances side by side, 2026-12-01); engine/capacity/plans.py keeps the same beside a new one
NEIGHBOUR_MARGIN_BYTES = 1 << 30


@dataclass(frozen=True)
class Neighbour:
    """Another deployment of this host and what it reserves: on GPUs, its gpu_memory_utilization on each GPU it
    runs on (replicas sharing a GPU add up); on the CPU build, the host memory it will still take beyond what its
    instances hold now (what they hold is already out of the host's available memory)."""

    name: str
    gpus: tuple[int, ...] = ()
    utilization: float = 0.0
    instances: int = 1
    host_bytes: int = 0
    sleeps: bool = False  # it scales to zero: put to sleep when another on its GPU must come back (not pinned)


# A smaller max_model_len is suggested from the traffic of this window only, and only once the window holds
# enough of it: a few requests of the first minutes say nothing of what clients need.
TRAFFIC_WINDOW_S = 7 * 86400
TRAFFIC_MIN_REQUESTS = 200
TRAFFIC_MIN_SPAN_S = 86400
TRAFFIC_MARGIN = 2  # the suggestion holds twice the longest request seen
GAIN_MIN = 1.25  # a suggestion must raise the full-length concurrency by at least this factor


@dataclass(frozen=True)
class TrafficNeed:
    """What real requests asked of max_model_len over a window: the longest prompt + max_tokens (the output
    tokens where a request asked for no max_tokens), how many requests, and how far back they reach."""

    tokens: int
    requests: int
    span_s: float
    window_s: float = TRAFFIC_WINDOW_S

    @property
    def enough(self) -> bool:
        return self.requests >= TRAFFIC_MIN_REQUESTS and self.span_s >= TRAFFIC_MIN_SPAN_S

    def describe(self) -> str:
        return (f"the longest of {self.requests:,} requests in the last {self.span_s / 86400:.1f} days asked for "
                f"{self.tokens:,} tokens (prompt + max_tokens)")


def shortest_safe_len(traffic: TrafficNeed | None) -> int:
    """The smallest max_model_len the engine would suggest: twice what traffic asked for, rounded up to a power of
    two, and never below what the console's own playground and snippets need (MIN_SUGGESTED_MODEL_LEN)."""
    need = TRAFFIC_MARGIN * traffic.tokens if traffic is not None else 0
    return max(MIN_SUGGESTED_MODEL_LEN, 1 << max(0, math.ceil(math.log2(max(1, need)))))


@dataclass
class Finding:
    code: str
    field: str
    message: str
    fit: dict[str, Any] = dc_field(default_factory=dict)

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass
class PreflightResult:
    errors: list[Finding]
    warnings: list[Finding]
    prediction: Prediction | None
    shape: ModelShape | None
    device: Device | None

    def as_dict(self) -> dict[str, Any]:
        return {
            "ok": not self.errors,
            "errors": [f.as_dict() for f in self.errors],
            "warnings": [f.as_dict() for f in self.warnings],
            "prediction": self.prediction.as_dict() if self.prediction else None,
            "model": None if self.shape is None else {
                "layers": self.shape.layers, "heads": self.shape.heads, "kv_heads": self.shape.kv_heads,
                "head_dim": self.shape.head_dim, "max_position_embeddings": self.shape.max_position_embeddings,
                "dtype": self.shape.dtype, "parameters": self.shape.parameters()},
            "device": None if self.device is None else asdict(self.device),
        }


def find_model_config(model: str, data_dir: Path | None) -> Path | None:
    """The local folder of ``model``, or its snapshot in the Hugging Face cache, if either has a config.json."""
    local = resolve_local_model(model, data_dir)
    if local is not None:
        return local
    cache = hf_hub_cache() / f"models--{model.replace('/', '--')}" / "snapshots"
    configs = sorted(cache.glob("*/config.json"), key=lambda p: p.stat().st_mtime) if cache.is_dir() else []
    return configs[-1].parent if configs else None


def _gib(n: float) -> str:
    return f"{n / GIB:.2f} GiB" if abs(n) >= 0.1 * GIB else f"{n / (1 << 20):.1f} MiB"


@dataclass(frozen=True)
class Cluster:
    """The GPUs of a Ray cluster, for a model spread over nodes (pipeline parallel): in all, and on the largest
    node (a tensor-parallel group stays inside one)."""

    gpus: int
    gpus_per_node: int
    nodes: int


def check(settings: EngineSettings, *, data_dir: Path | None, device: Device | None,
          calibration: Calibration | None = None, traffic: TrafficNeed | None = None,
          neighbours: list[Neighbour] | None = None, cluster: Cluster | None = None,
          sleep_mode: bool = False, host_available: int | None = None) -> PreflightResult:
    """``sleep_mode``: instances put to sleep keep their weights in host memory and wake in about a second (CUDA
    with LLMOPS_SLEEP_MODE); else a deployment put to sleep for another is stopped and starts again cold.
    ``host_available``: the host's memory available now (where the weights of an instance asleep go)."""
    errors: list[Finding] = []
    warnings: list[Finding] = []
    if settings.gpu_memory_utilization > 0.90 and (device is None or device.kind == "cuda"):
        lo, hi = SAFE_UTILIZATION
        warnings.append(Finding("utilization_high", "gpu_memory_utilization",
                                f"gpu_memory_utilization {settings.gpu_memory_utilization} leaves little headroom "
                                f"for activation spikes and other processes; {lo:.2f}-{hi:.2f} is the safe "
                                "production range", {"gpu_memory_utilization": hi}))
    folder = find_model_config(settings.model, data_dir)
    if folder is None:
        warnings.append(Finding("capacity_unknown", "model", f"capacity not checked: no config.json for "
                                f"{settings.model!r} on this host (hub models are checked once downloaded)"))
        return PreflightResult(errors, warnings, None, None, device)
    try:
        shape = load_shape(folder)
    except (KeyError, ValueError, TypeError, OSError) as exc:
        warnings.append(Finding("capacity_unknown", "model", f"capacity not checked: {folder}/config.json is not "
                                f"a model config this check understands ({type(exc).__name__}: {exc})"))
        return PreflightResult(errors, warnings, None, None, device)

    _config_coverage(settings, shape, warnings)
    limit = model_limit(shape, settings)
    if settings.max_model_len is not None and settings.max_model_len > limit:
        why = "its sliding window, as --disable-sliding-window makes it" if limit < shape.max_position_embeddings \
            else "max_position_embeddings"
        errors.append(Finding("max_len_above_model", "max_model_len",
                              f"max_model_len {settings.max_model_len} is above the model's limit of "
                              f"{limit} tokens ({why})", {"max_model_len": limit}))
    tp = settings.tensor_parallel_size
    gpus = device.count if device is not None and device.kind == "cuda" else None
    if shape.heads % tp or (gpus is not None and tp > gpus):
        valid = [d for d in range(1, shape.heads + 1) if shape.heads % d == 0 and (gpus is None or d <= gpus)]
        why = (f"does not divide the model's {shape.heads} attention heads" if shape.heads % tp
               else f"exceeds the {gpus} GPU(s) present")
        errors.append(Finding("tp_mismatch", "tensor_parallel_size",
                              f"tensor_parallel_size {tp} {why}; valid: {', '.join(map(str, valid))}",
                              {"tensor_parallel_size": valid[-1]}))
    _pipeline_findings(settings, shape, cluster, errors)
    _replica_findings(settings, shape, device, errors)
    if device is None:
        warnings.append(Finding("capacity_unknown", "gpu_memory_utilization",
                                "memory not checked: no device reading yet"))
        return PreflightResult(errors, warnings, None, shape, device)
    if errors:  # figures of a max_model_len or tensor_parallel_size that cannot start would describe nothing
        return PreflightResult(errors, warnings, None, shape, device)

    pred = predict(shape, settings, device, calibration)
    _memory_findings(settings, shape, device, calibration, pred, errors, warnings, traffic)
    _prediction_coverage(settings, shape, device, pred, warnings)
    if neighbours:
        _neighbour_findings(settings, shape, device, neighbours, errors, warnings, sleep_mode)
    if (found := _traffic_finding(settings, device, pred, traffic)) is not None:
        warnings.append(found)
    if device.kind == "cuda" and sleep_mode and settings.scale_to_zero_after_s is not None \
            and host_available is not None:
        asleep = pred.weight_bytes * settings.tensor_parallel_size * settings.most_replicas
        if asleep + NEIGHBOUR_MARGIN_BYTES > host_available:
            warnings.append(Finding(
                "sleep_host_memory", "scale_to_zero_after_s",
                f"asleep, its weights ({_gib(asleep)}) move to the host's memory, which has {_gib(host_available)} "
                "available: a sleep that does not fit there may fail (the instance is then stopped, and the next "
                "request is a cold start, not a wake of about a second)"))
    return PreflightResult(errors, warnings, pred, shape, device)


def _approximate(feature: str, effect: str, off: str = "", plural: bool = False) -> Finding:
    return Finding("capacity_approximate", "model", f"{feature} {'are' if plural else 'is'} not modelled: {effect}"
                   + (f"; the prediction may be off by {off}" if off else ""))


def _config_coverage(settings: EngineSettings, shape: ModelShape, warnings: list[Finding]) -> None:
    """What the model's config asks for that the capacity model does not model (engine/capacity/shape.py)."""
    for item in shape.unmodelled:
        warnings.append(_approximate(item.feature, item.effect, _gib(item.bytes) if item.bytes else "", item.plural))
    if shape.quantization and (settings.load_format == "dummy" or not shape.checkpoint_bytes):
        warnings.append(_approximate(
            f"quantized weights ({shape.quantization})", "without the checkpoint's files their size is counted "
            "at 16 bits a weight, while a 4-bit checkpoint holds about a quarter of that", f"up to "
            f"{_gib(shape.parameters() * 3 // 2)} (the KV cache larger than predicted)", plural=True))
    flags = extra_flags(settings)
    for flag, what in (("--cpu-offload-gb", "weights offloaded to the CPU (--cpu-offload-gb)"),
                       ("--quantization", "on-the-fly quantization (--quantization)"),
                       ("--no-enable-chunked-prefill", "prefill without chunking (--no-enable-chunked-prefill)")):
        if flag in flags:
            warnings.append(_approximate(what, "the weights on the GPU and the profiling pass are counted as without "
                                         "it", "several GiB (the first start calibrates the weights and activation)"))
    if settings.pipeline_parallel_size > 1 and len(set(layer_kinds(shape))) > 1:
        warnings.append(_approximate(
            "a hybrid KV cache (sliding-window and full layers) split into pipeline stages", "vLLM groups the "
            "layers over the whole model and pads each stage's groups; the stage's layers are grouped on their own "
            "here", "a few percent of the KV tokens"))


def _prediction_coverage(settings: EngineSettings, shape: ModelShape, device: Device, pred: Prediction,
                         warnings: list[Finding]) -> None:
    """Parts of the prediction that are estimates not yet measured for this kind of model."""
    if device.kind != "cuda" or pred.calibrated or not (shape.moe or shape.mla):
        return
    kind = " and ".join(k for k, on in (("mixture-of-experts", shape.moe), ("latent-attention (MLA)", shape.mla))
                        if on)
    off = pred.activation_bytes // 2
    share = f" ({100 * off / pred.kv_bytes:.1f} % of the KV cache)" if pred.kv_bytes > 0 else ""
    warnings.append(_approximate(
        f"peak activation of {kind} layers", "it is estimated from the kernels' workspaces, not fitted to a start; "
        "the first start on this host measures and calibrates it", f"about {_gib(off)}{share}"))


def _pipeline_findings(settings: EngineSettings, shape: ModelShape, cluster: Cluster | None,
                       errors: list[Finding]) -> None:
    """A model in stages (pipeline parallel) runs through vLLM's Ray executor, across the nodes of the cluster."""
    pp, tp = settings.pipeline_parallel_size, settings.tensor_parallel_size
    if pp <= 1:
        return
    if pp > shape.layers:
        errors.append(Finding("pp_mismatch", "pipeline_parallel_size", f"pipeline_parallel_size {pp} is more "
                              f"stages than the model's {shape.layers} layers", {"pipeline_parallel_size":
                                                                                 shape.layers}))
        return
    if cluster is None:
        errors.append(Finding("pp_needs_cluster", "pipeline_parallel_size", f"pipeline_parallel_size {pp} runs "
                              "through vLLM's Ray executor: place instances on a Ray cluster (LLMOPS_RAY_ADDRESS), "
                              "or use tensor_parallel_size within this host", {"pipeline_parallel_size": 1}))
        return
    if tp > cluster.gpus_per_node:
        errors.append(Finding("tp_mismatch", "tensor_parallel_size", f"tensor_parallel_size {tp} is more GPUs than "
                              f"the largest node has ({cluster.gpus_per_node}): a tensor-parallel group stays in one "
                              "node", {"tensor_parallel_size": cluster.gpus_per_node}))
    if tp * pp > cluster.gpus:
        fits = max(1, cluster.gpus // tp)
        errors.append(Finding("cluster_gpus", "pipeline_parallel_size", f"{tp} x {pp} = {tp * pp} GPUs; the "
                              f"cluster's {cluster.nodes} alive node(s) have {cluster.gpus}: at most "
                              f"pipeline_parallel_size {fits} at tensor_parallel_size {tp}",
                              {"pipeline_parallel_size": fits}))


def _neighbour_findings(settings: EngineSettings, shape: ModelShape, device: Device, neighbours: list[Neighbour],
                        errors: list[Finding], warnings: list[Finding], sleep_mode: bool) -> None:
    """Packing: what the other deployments on the same GPUs (or host) reserve is not this one's to take — unless
    they scale to zero: then no more of them is awake at once than fits (engine/serving/residency.py), and this says
    which will sleep for it and what their wake costs."""
    if device.kind == "cuda":
        mine = settings.gpu_memory_utilization * (1 if device.count >= settings.most_replicas *
                                                  settings.tensor_parallel_size else settings.replicas)
        for gpu in device.indices or (0,):
            beside = [n for n in neighbours if gpu in n.gpus]
            if not beside:
                continue
            taken = sum(n.utilization for n in beside)
            margin = NEIGHBOUR_MARGIN_BYTES * sum(n.instances for n in beside) / device.total_bytes
            if mine + taken + margin <= 1.0:
                continue
            pinned = [n for n in beside if not n.sleeps]
            held = sum(n.utilization for n in pinned) + \
                NEIGHBOUR_MARGIN_BYTES * sum(n.instances for n in pinned) / device.total_bytes
            if mine + held <= 1.0:
                sleepers = [n.name for n in beside if n.sleeps]
                wake = ("a wake from sleep takes about a second (sleep mode)" if sleep_mode else
                        "a wake is a cold start (no sleep mode: the one put to sleep is stopped)")
                alone = "" if settings.scale_to_zero_after_s is not None else (
                    f"; this deployment has no scale_to_zero_after_s (pinned awake): while it is up, "
                    f"{', '.join(sleepers)} cannot wake")
                warnings.append(Finding(
                    "neighbours_sleep", "gpu_memory_utilization",
                    f"fits on GPU {gpu} only while deployment{'s' if len(sleepers) > 1 else ''} "
                    f"{', '.join(sleepers)} sleep{'' if len(sleepers) > 1 else 's'}: no more of them is awake at once "
                    f"than fits, and a request for one asleep puts the least recently used idle one to sleep and "
                    f"waits for it; {wake}{alone}"))
                continue
            fit = math.floor(100 * (1.0 - taken - margin) / max(1, round(mine / settings.gpu_memory_utilization)))
            fit_u = fit / 100
            who = ", ".join(f"{n.name} ({n.utilization:.2f})" for n in beside)
            errors.append(Finding(
                "neighbours_memory", "gpu_memory_utilization",
                f"gpu_memory_utilization {settings.gpu_memory_utilization} does not fit on GPU {gpu} beside "
                f"deployment{'s' if len(beside) > 1 else ''} {who} and a {_gib(NEIGHBOUR_MARGIN_BYTES)} margin per "
                f"instance: "
                + (f"the largest that fits is {fit_u:.2f}" if fit > 0 else "nothing fits there: place it on another "
                   "GPU or shrink a neighbour")
                + (f" (or let {', '.join(n.name for n in pinned)} sleep when idle: scale_to_zero_after_s; "
                   "deployments that scale to zero take turns on a GPU)" if pinned else ""),
                {"gpu_memory_utilization": fit_u} if fit > 0 else {}))
            return
        return
    pending = sum(n.host_bytes for n in neighbours)
    per = int(settings.cpu_kv_cache_gib * GIB) + shape.parameters() * 2 + int(1.5 * GIB)
    need = per * settings.replicas
    room = device.free_bytes - pending - NEIGHBOUR_MARGIN_BYTES
    if need > room:
        fits = math.floor(100 * max(0, room / settings.replicas - per + settings.cpu_kv_cache_gib * GIB) / GIB) / 100
        errors.append(Finding(
            "neighbours_memory", "cpu_kv_cache_gib",
            f"this deployment needs about {_gib(need)} of the host's memory; {_gib(device.free_bytes)} is available "
            f"and deployments {', '.join(n.name for n in neighbours if n.host_bytes)} will still take "
            f"{_gib(pending)} of it: " + (f"the largest cpu_kv_cache_gib that fits is {fits}" if fits > 0 else
                                          "nothing fits beside them"),
            {"cpu_kv_cache_gib": fits} if fits > 0 else {}))


def breaks_text(length: int) -> str:
    """What a max_model_len of ``length`` refuses: said wherever one is suggested."""
    return (f"with max_model_len {length:,}, a request whose prompt + max_tokens exceeds {length:,} tokens gets "
            "HTTP 400, and one without max_tokens gets at most the tokens left after its prompt")


def _traffic_finding(settings: EngineSettings, device: Device, pred: Prediction,
                     traffic: TrafficNeed | None) -> Finding | None:
    """A smaller max_model_len, only where it gains something measurable: on a GPU whose KV cache holds fewer
    full-length requests than max_num_seqs, sized from a long window of real traffic with a margin.

    On the CPU build the KV cache is a fixed size (cpu_kv_cache_gib): a smaller max_model_len frees nothing there.
    """
    if device.kind != "cuda" or traffic is None or not traffic.enough or not pred.fits_one_request:
        return None
    seqs = settings.max_num_seqs
    if pred.max_concurrency >= seqs:
        return None  # max_num_seqs full-length requests fit already: nothing to buy
    length = shortest_safe_len(traffic)
    if length >= pred.max_model_len:
        return None
    after = min(float(seqs), pred.usable_tokens / length)
    if after < GAIN_MIN * pred.max_concurrency:
        return None
    return Finding("max_len_above_traffic", "max_model_len",
                   f"the KV cache holds {pred.max_concurrency:.1f} requests of max_model_len "
                   f"{pred.max_model_len:,} at once, fewer than max_num_seqs {seqs}; {traffic.describe()}, so "
                   f"max_model_len {length:,} (at least twice that, and never below {MIN_SUGGESTED_MODEL_LEN:,}, "
                   f"what the console's playground and snippets need) would hold {after:.0f}. What it would break: "
                   f"{breaks_text(length)}",
                   {"max_model_len": length})


def _replica_findings(settings: EngineSettings, shape: ModelShape, device: Device | None,
                      errors: list[Finding]) -> None:
    """Replicas either get their own GPUs (replicas × tensor_parallel_size of them) or share one device, where
    their memory must add up."""
    n = settings.replicas
    if n < 2 or device is None:
        return
    tp = settings.tensor_parallel_size
    if device.kind == "cuda":
        if device.count >= n * tp:
            return  # each replica on its own GPUs
        if tp > 1:
            errors.append(Finding("replicas_gpus", "replicas",
                                  f"{n} replicas of tensor_parallel_size {tp} need {n * tp} GPUs; {device.count} "
                                  "are present", {"replicas": max(1, device.count // tp)}))
            return
        share = settings.gpu_memory_utilization * n
        if share > 0.95:  # they share the GPUs there are: their memory adds up
            fit = math.floor(95 / n) / 100
            errors.append(Finding("replicas_memory", "gpu_memory_utilization",
                                  f"{n} replicas on {device.count} GPU(s) take {n} x "
                                  f"{settings.gpu_memory_utilization} = {share:.2f} of its memory; at most {fit} "
                                  "each, or fewer replicas", {"gpu_memory_utilization": fit}))
        return
    per = int(settings.cpu_kv_cache_gib * GIB) + shape.parameters() * 2 + int(1.5 * GIB)
    if per * n > device.free_bytes:
        errors.append(Finding("replicas_memory", "replicas",
                              f"{n} replicas need about {_gib(per * n)} of the host's memory and "
                              f"{_gib(device.free_bytes)} is available",
                              {"replicas": max(1, device.free_bytes // per)}))


def _memory_findings(settings: EngineSettings, shape: ModelShape, device: Device, calibration: Calibration | None,
                     pred: Prediction, errors: list[Finding], warnings: list[Finding],
                     traffic: TrafficNeed | None = None) -> None:
    per_request = pred.tokens_per_request
    if device.kind == "cuda":
        need_util = utilization_for(shape, settings, device, calibration, per_request)
        fixed = pred.weight_bytes + pred.activation_bytes + pred.non_torch_bytes
        if fixed >= pred.budget_bytes:
            more = f"the smallest utilization that fits one request is {need_util}" if need_util else \
                "raise tensor_parallel_size to split the weights across more GPUs"
            errors.append(Finding("weights_do_not_fit", "gpu_memory_utilization",
                                  f"weights ({_gib(pred.weight_bytes)}) plus activation and runtime memory "
                                  f"({_gib(pred.activation_bytes + pred.non_torch_bytes)}) exceed the budget of "
                                  f"{settings.gpu_memory_utilization} x {_gib(device.total_bytes)} = "
                                  f"{_gib(pred.budget_bytes)}: no memory is left for the KV cache; {more}",
                                  {"gpu_memory_utilization": need_util} if need_util else {}))
        elif not pred.fits_one_request:
            fit: dict[str, Any] = {"max_model_len": pred.longest_request}
            if need_util:
                fit["gpu_memory_utilization"] = need_util
            errors.append(Finding("kv_cache_too_small", "max_model_len",
                                  f"one request of {per_request} tokens needs {_gib(pred.request_kv_bytes)} of KV "
                                  f"cache but only {_gib(max(0, pred.kv_bytes))} is left ({pred.usable_tokens} "
                                  f"tokens); the largest max_model_len for this utilization is "
                                  f"{pred.longest_request}"
                                  + (f", or raise gpu_memory_utilization to {need_util}" if need_util else ""), fit))
        requested = settings.gpu_memory_utilization * device.total_bytes
        if device.free_bytes < requested:
            fits = math.floor(100 * device.free_bytes / device.total_bytes) / 100
            errors.append(Finding("insufficient_free_memory", "gpu_memory_utilization",
                                  f"only {_gib(device.free_bytes)} of {_gib(device.total_bytes)} is free now (other "
                                  f"processes hold {_gib(device.total_bytes - device.free_bytes)}), less than "
                                  f"{settings.gpu_memory_utilization} x total = {_gib(requested)}; the largest "
                                  f"utilization that fits now is {fits:.2f}", {"gpu_memory_utilization": fits}))
    else:
        null_block = pred.block_size * pred.kv_bytes_per_token
        need_gib = math.ceil(100 * (pred.request_kv_bytes + null_block) / GIB) / 100
        if not pred.fits_one_request:
            errors.append(Finding("kv_cache_too_small", "cpu_kv_cache_gib",
                                  f"one request of {per_request} tokens needs {_gib(pred.request_kv_bytes)} of KV "
                                  f"cache but cpu_kv_cache_gib {settings.cpu_kv_cache_gib} holds "
                                  f"{pred.usable_tokens} tokens; the largest max_model_len for it is "
                                  f"{pred.longest_request}, or set cpu_kv_cache_gib to {need_gib}",
                                  {"max_model_len": pred.longest_request, "cpu_kv_cache_gib": need_gib}))
        needed = pred.kv_bytes + pred.weight_bytes
        if needed > device.free_bytes:
            fits = math.floor(100 * max(0, device.free_bytes - pred.weight_bytes) / GIB) / 100
            errors.append(Finding("weights_do_not_fit", "cpu_kv_cache_gib",
                                  f"KV cache ({_gib(pred.kv_bytes)}) plus weights ({_gib(pred.weight_bytes)}) exceed "
                                  f"the host's available memory ({_gib(device.free_bytes)}); the largest "
                                  f"cpu_kv_cache_gib that fits is {fits}", {"cpu_kv_cache_gib": fits}))
    if pred.fits_one_request and pred.max_concurrency < settings.max_num_seqs:
        full = max(1, math.floor(pred.max_concurrency))
        fewer: dict[str, Any] = {"max_num_seqs": full}
        shorter = pred.kv_tokens // settings.max_num_seqs
        # a shorter max_model_len only where it keeps what traffic and the console's own requests need
        also = ""
        if shorter >= shortest_safe_len(traffic if traffic is not None and traffic.enough else None):
            fewer["max_model_len"] = shorter
            also = f" or max_model_len {shorter} ({breaks_text(shorter)})"
        warnings.append(Finding("concurrency_below_max_num_seqs", "max_num_seqs",
                                f"the KV cache holds {pred.max_concurrency:.1f} requests of {per_request} tokens, "
                                f"fewer than max_num_seqs {settings.max_num_seqs}: long requests will be preempted; "
                                f"max_num_seqs {full}{also} would fit", fewer))
