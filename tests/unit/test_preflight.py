"""Pre-flight tables: which settings are refused (errors) or flagged (warnings), each with the value that fits."""

from __future__ import annotations

from pathlib import Path

import pytest

from engine.capacity import GIB, Device, TrafficNeed, check
from engine.revisions import EngineSettings
from engine.schemas import MIN_SUGGESTED_MODEL_LEN, PLAYGROUND_MAX_TOKENS, SNIPPET_MAX_TOKENS
from tests.unit.test_capacity import H200


def gpu_settings(model: Path, **values: object) -> EngineSettings:
    base = {"model": str(model), "load_format": "dummy", "gpu_memory_utilization": 0.85, "max_model_len": 4096,
            "max_num_seqs": 64}
    return EngineSettings.model_validate({**base, **values})


def codes(findings: list) -> dict[str, dict]:  # type: ignore[type-arg]
    return {f.code: f.fit for f in findings}


@pytest.mark.parametrize(("values", "device", "code", "fit_key"), [
    ({"gpu_memory_utilization": 0.1}, H200, "weights_do_not_fit", "gpu_memory_utilization"),
    ({"gpu_memory_utilization": 0.13, "max_model_len": 8192, "max_num_seqs": 1, "enforce_eager": True},
     H200, None, None),
    ({"max_model_len": 16384}, H200, "max_len_above_model", "max_model_len"),
    ({"tensor_parallel_size": 3}, Device("cuda", int(139.8 * GIB), int(139.3 * GIB), count=4), "tp_mismatch",
     "tensor_parallel_size"),
    ({"tensor_parallel_size": 2}, H200, "tp_mismatch", "tensor_parallel_size"),
    ({}, Device("cuda", int(139.8 * GIB), int(60 * GIB), count=1), "insufficient_free_memory",
     "gpu_memory_utilization"),
])
def test_gpu_errors(m8b: Path, values: dict, device: Device, code: str | None, fit_key: str | None) -> None:  # type: ignore[type-arg]
    result = check(gpu_settings(m8b, **values), data_dir=None, device=device)
    if code is None:
        assert result.errors == []
        return
    found = codes(result.errors)
    assert code in found, [e.message for e in result.errors]
    assert fit_key in found[code]


def test_kv_cache_too_small_names_the_length_and_the_utilization_that_fit(m8b: Path) -> None:
    result = check(gpu_settings(m8b, gpu_memory_utilization=0.12, max_model_len=8192, enforce_eager=True),
                   data_dir=None, device=H200)
    err = {e.code: e for e in result.errors}["kv_cache_too_small"]
    assert err.field == "max_model_len"
    assert 0 < err.fit["max_model_len"] < 8192
    assert err.fit["gpu_memory_utilization"] == 0.13
    assert str(err.fit["max_model_len"]) in err.message


def test_free_memory_error_names_the_utilization_that_fits(m8b: Path) -> None:
    result = check(gpu_settings(m8b), data_dir=None, device=Device("cuda", int(139.8 * GIB), int(60 * GIB)))
    err = {e.code: e for e in result.errors}["insufficient_free_memory"]
    assert err.fit == {"gpu_memory_utilization": 0.42}
    assert "other processes hold 79.80 GiB" in err.message


def test_safe_settings_pass_without_findings(m8b: Path) -> None:
    result = check(gpu_settings(m8b), data_dir=None, device=H200)
    assert result.errors == [] and result.warnings == []
    assert result.prediction is not None and result.prediction.max_concurrency > 64


@pytest.mark.parametrize(("values", "code", "fit"), [
    ({"gpu_memory_utilization": 0.95}, "utilization_high", {"gpu_memory_utilization": 0.85}),
    ({"gpu_memory_utilization": 0.2, "max_model_len": 8192, "max_num_seqs": 64}, "concurrency_below_max_num_seqs",
     None),
])
def test_gpu_warnings(m8b: Path, values: dict, code: str, fit: dict | None) -> None:  # type: ignore[type-arg]
    result = check(gpu_settings(m8b, **values), data_dir=None, device=H200)
    assert result.errors == []
    found = codes(result.warnings)
    assert code in found
    if fit is not None:
        assert found[code] == fit
    else:
        assert found[code]["max_num_seqs"] < 64


WEEK_OF_TRAFFIC = {"requests": 5000, "span_s": 6 * 86400}


def max_len_fits(findings: list) -> list[int]:  # type: ignore[type-arg]
    return [int(f.fit["max_model_len"]) for f in findings if "max_model_len" in f.fit]


def test_a_smaller_max_model_len_is_suggested_where_it_buys_concurrency(m8b: Path) -> None:
    # a small KV cache on a GPU: 11.7 requests of 8,192 tokens fit, max_num_seqs is 64, traffic needs 700 tokens
    result = check(gpu_settings(m8b, gpu_memory_utilization=0.2, max_model_len=8192), data_dir=None, device=H200,
                   traffic=TrafficNeed(700, **WEEK_OF_TRAFFIC))
    found = {f.code: f for f in result.warnings}["max_len_above_traffic"]
    assert found.fit == {"max_model_len": 2048}
    assert "HTTP 400" in found.message and "700 tokens (prompt + max_tokens)" in found.message  # what it breaks
    assert "would hold 47" in found.message  # what it gains


@pytest.mark.parametrize("longest", [18, 133, 700])
def test_no_max_model_len_suggestion_on_the_cpu_build(data_dir: Path, longest: int) -> None:
    # the CPU build's KV cache is cpu_kv_cache_gib whatever max_model_len is, and 256 requests fit already
    host = Device("cpu", 24 * GIB, 20 * GIB)
    demo = EngineSettings.model_validate({"model": "models/demo", "cpu_kv_cache_gib": 0.5, "max_num_seqs": 256})
    result = check(demo, data_dir=data_dir, device=host, traffic=TrafficNeed(longest, **WEEK_OF_TRAFFIC))
    assert result.errors == [] and result.warnings == []


def test_a_small_cpu_kv_cache_suggests_fewer_sequences_not_a_max_model_len_that_breaks_clients(
        data_dir: Path) -> None:
    host = Device("cpu", 24 * GIB, 20 * GIB)
    small = EngineSettings.model_validate({"model": "models/demo", "cpu_kv_cache_gib": 0.05, "max_num_seqs": 256})
    result = check(small, data_dir=data_dir, device=host, traffic=TrafficNeed(18, **WEEK_OF_TRAFFIC))
    assert codes(result.warnings)["concurrency_below_max_num_seqs"] == {"max_num_seqs": 25}  # not max_model_len 52


@pytest.mark.parametrize(("longest", "requests", "span_s"), [
    (18, 40, 600),  # a few requests of the first minutes
    (18, 5000, 3600),  # many, but an hour of them
    (133, 150, 3 * 86400),
])
def test_too_little_traffic_suggests_nothing(m8b: Path, longest: int, requests: int, span_s: float) -> None:
    result = check(gpu_settings(m8b, gpu_memory_utilization=0.2, max_model_len=8192), data_dir=None, device=H200,
                   traffic=TrafficNeed(longest, requests, span_s))
    assert "max_len_above_traffic" not in codes(result.warnings)


@pytest.mark.parametrize("longest", [1, 18, 133, 700, 1500, 3000])
def test_a_suggested_max_model_len_holds_the_longest_request_twice_and_the_consoles_own(m8b: Path,
                                                                                         longest: int) -> None:
    for util in (0.15, 0.2, 0.3, 0.85):
        result = check(gpu_settings(m8b, gpu_memory_utilization=util, max_model_len=8192, max_num_seqs=256),
                       data_dir=None, device=H200, traffic=TrafficNeed(longest, **WEEK_OF_TRAFFIC))
        for length in max_len_fits(result.warnings):
            assert length >= max(2 * longest, MIN_SUGGESTED_MODEL_LEN, PLAYGROUND_MAX_TOKENS, SNIPPET_MAX_TOKENS)


def test_a_gpu_that_holds_max_num_seqs_full_length_requests_gets_no_suggestion(m8b: Path) -> None:
    result = check(gpu_settings(m8b, max_model_len=8192), data_dir=None, device=H200,
                   traffic=TrafficNeed(700, **WEEK_OF_TRAFFIC))
    assert result.warnings == []  # 0.85 of an H200: hundreds of 8,192-token requests fit; nothing to buy


def test_cpu_build_checks_the_explicit_kv_cache(data_dir: Path) -> None:
    host = Device("cpu", 24 * GIB, 20 * GIB)
    tiny = EngineSettings.model_validate({"model": "models/demo", "cpu_kv_cache_gib": 0.001, "max_model_len": 2048})
    result = check(tiny, data_dir=data_dir, device=host)
    err = {e.code: e for e in result.errors}["kv_cache_too_small"]
    assert err.field == "cpu_kv_cache_gib" and err.fit == {"max_model_len": 896, "cpu_kv_cache_gib": 0.01}
    huge = EngineSettings.model_validate({"model": "models/demo", "cpu_kv_cache_gib": 64})
    assert "weights_do_not_fit" in codes(check(huge, data_dir=data_dir, device=host).errors)
    ok = EngineSettings.model_validate({"model": "models/demo", "cpu_kv_cache_gib": 0.5, "max_model_len": 2048})
    assert check(ok, data_dir=data_dir, device=host).errors == []


def test_unknown_model_is_a_warning_not_an_error() -> None:
    s = EngineSettings.model_construct(**{**EngineSettings.model_construct(model="org/absent-model").model_dump()})
    result = check(s, data_dir=None, device=H200)
    assert result.errors == [] and codes(result.warnings) == {"capacity_unknown": {}}


def test_a_model_in_stages_is_planned_across_the_cluster(m8b: Path) -> None:
    """pipeline_parallel_size spreads a model too large for one node over several, through vLLM's Ray executor:
    pre-flight wants a cluster with the GPUs, tensor-parallel groups inside a node; each rank holds its stage."""
    from engine.capacity import Cluster, check, kv_bytes_per_token, load_shape, weight_bytes
    from engine.vllm import build_command

    one = gpu_settings(m8b)
    staged = gpu_settings(m8b, pipeline_parallel_size=2, tensor_parallel_size=2)
    shape = load_shape(m8b)
    assert kv_bytes_per_token(shape, staged) * 2 == kv_bytes_per_token(shape, one.model_copy(
        update={"tensor_parallel_size": 2}))  # a stage's half of the layers
    # a quarter of the weights, and on every rank the replicated norms and rotary cache
    assert weight_bytes(shape, staged) * 4 == pytest.approx(weight_bytes(shape, one), rel=1e-3)
    assert weight_bytes(shape, staged) * 4 > weight_bytes(shape, one)
    alone = check(staged, data_dir=None, device=None)
    assert [f.code for f in alone.errors] == ["pp_needs_cluster"]
    small = check(staged, data_dir=None, device=None, cluster=Cluster(gpus=2, gpus_per_node=1, nodes=2))
    assert {f.code for f in small.errors} == {"tp_mismatch", "cluster_gpus"}
    assert next(f for f in small.errors if f.code == "cluster_gpus").fit == {"pipeline_parallel_size": 1}
    fits = check(staged, data_dir=None, device=None, cluster=Cluster(gpus=4, gpus_per_node=2, nodes=2))
    assert fits.errors == []
    args = build_command(staged, python="/py", port=1, data_dir=None, build="cuda")
    assert args[args.index("--pipeline-parallel-size") + 1] == "2"
    assert args[args.index("--distributed-executor-backend") + 1] == "ray"
    assert "--pipeline-parallel-size" not in build_command(one, python="/py", port=1, data_dir=None,
                                                           build="cuda")
