"""Pre-flight: check a settings revision against the capacity model before it is written.

Errors refuse the write (HTTP 422, nothing written) unless the operator forces it; warnings are recorded with the
revision. Every finding names the value that would fit.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from dataclasses import field as dc_field
from pathlib import Path
from typing import Any

from engine.capacity.model import GIB, Calibration, Device, ModelShape, Prediction, load_shape, predict, utilization_for
from engine.revisions import EngineSettings, hf_hub_cache, resolve_local_model
from engine.schemas import MIN_SUGGESTED_MODEL_LEN

SAFE_UTILIZATION = (0.80, 0.85)
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


def check(settings: EngineSettings, *, data_dir: Path | None, device: Device | None,
          calibration: Calibration | None = None, traffic: TrafficNeed | None = None) -> PreflightResult:
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

    if settings.max_model_len is not None and settings.max_model_len > shape.max_position_embeddings:
        errors.append(Finding("max_len_above_model", "max_model_len",
                              f"max_model_len {settings.max_model_len} is above the model's limit of "
                              f"{shape.max_position_embeddings} tokens (max_position_embeddings)",
                              {"max_model_len": shape.max_position_embeddings}))
    tp = settings.tensor_parallel_size
    gpus = device.count if device is not None and device.kind == "cuda" else None
    if shape.heads % tp or (gpus is not None and tp > gpus):
        valid = [d for d in range(1, shape.heads + 1) if shape.heads % d == 0 and (gpus is None or d <= gpus)]
        why = (f"does not divide the model's {shape.heads} attention heads" if shape.heads % tp
               else f"exceeds the {gpus} GPU(s) present")
        errors.append(Finding("tp_mismatch", "tensor_parallel_size",
                              f"tensor_parallel_size {tp} {why}; valid: {', '.join(map(str, valid))}",
                              {"tensor_parallel_size": valid[-1]}))
    _replica_findings(settings, shape, device, errors)
    if device is None:
        warnings.append(Finding("capacity_unknown", "gpu_memory_utilization",
                                "memory not checked: no device reading yet"))
        return PreflightResult(errors, warnings, None, shape, device)
    if errors:  # figures of a max_model_len or tensor_parallel_size that cannot start would describe nothing
        return PreflightResult(errors, warnings, None, shape, device)

    pred = predict(shape, settings, device, calibration)
    _memory_findings(settings, shape, device, calibration, pred, errors, warnings, traffic)
    if (found := _traffic_finding(settings, device, pred, traffic)) is not None:
        warnings.append(found)
    return PreflightResult(errors, warnings, pred, shape, device)


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
            fit: dict[str, Any] = {"max_model_len": pred.usable_tokens}
            if need_util:
                fit["gpu_memory_utilization"] = need_util
            errors.append(Finding("kv_cache_too_small", "max_model_len",
                                  f"one request of {per_request} tokens needs "
                                  f"{_gib(per_request * pred.kv_bytes_per_token)} of KV cache but only "
                                  f"{_gib(max(0, pred.kv_bytes))} is left ({pred.usable_tokens} tokens); the largest "
                                  f"max_model_len for this utilization is {pred.usable_tokens}"
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
        need_gib = math.ceil(100 * (per_request + pred.block_size) * pred.kv_bytes_per_token / GIB) / 100
        if not pred.fits_one_request:
            errors.append(Finding("kv_cache_too_small", "cpu_kv_cache_gib",
                                  f"one request of {per_request} tokens needs "
                                  f"{_gib(per_request * pred.kv_bytes_per_token)} of KV cache but cpu_kv_cache_gib "
                                  f"{settings.cpu_kv_cache_gib} holds {pred.usable_tokens} tokens; the largest "
                                  f"max_model_len for it is {pred.usable_tokens}, or set cpu_kv_cache_gib to "
                                  f"{need_gib}", {"max_model_len": pred.usable_tokens, "cpu_kv_cache_gib": need_gib}))
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
