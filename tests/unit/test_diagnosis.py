"""Failure diagnosis on real vLLM logs (H200 and CPU build) and on vLLM's own wording for the other kinds."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from engine.vllm import diagnose

FIXTURES = Path(__file__).parent.parent / "fixtures"
SAMPLES = json.loads((FIXTURES / "diagnosis_samples.json").read_text())


def log(name: str) -> list[str]:
    return (FIXTURES / "vllm_logs" / name).read_text().splitlines()


def test_real_h200_failure_is_no_cache_memory() -> None:
    d = diagnose(log("fail-util011-no-cache-memory.log"))
    assert d.kind == "no_cache_memory" and d.is_oom
    assert "gpu_memory_utilization" in d.fix
    assert any("No available memory for the cache blocks" in line for line in d.evidence)
    assert d.phase == "profiling"


def test_real_cpu_failure_is_kv_cache_too_small_with_the_length_that_fits() -> None:
    d = diagnose(log("cpu-fail-kv-cache-too-small.log"))
    assert d.kind == "kv_cache_too_small" and d.is_oom
    assert "max_model_len 2048" in d.explanation and "896 tokens would fit" in d.explanation
    assert "896" in d.fix


def test_real_cpu_failure_max_len_above_model() -> None:
    d = diagnose(log("cpu-fail-max-len-above-model.log"))
    assert d.kind == "max_len_above_model" and not d.is_oom
    assert "4096" in d.explanation and "2048" in d.fix


def test_successful_start_log_is_not_an_error() -> None:
    assert diagnose(log("startup-util013-len8192.log")).kind == "unknown"


@pytest.mark.parametrize("kind", ["insufficient_free_memory", "tp_mismatch", "engine_dead", "invalid_config",
                                  "ipc_path_too_long", "unknown"])
def test_each_kind_from_vllms_wording(kind: str) -> None:
    d = diagnose(SAMPLES[kind], running=kind == "engine_dead")
    assert d.kind == kind
    assert d.explanation and d.fix and d.evidence


def test_insufficient_free_memory_names_the_utilization_that_fits() -> None:
    d = diagnose(SAMPLES["insufficient_free_memory"])
    assert "20.5 of 139.8 GiB" in d.explanation and "0.15" in d.fix


def test_cuda_oom_names_its_phase() -> None:
    assert diagnose(SAMPLES["cuda_oom"]).phase == "profiling"
    serving = diagnose(SAMPLES["cuda_oom_serving"], running=True)
    assert serving.kind == "cuda_oom" and serving.phase == "serving" and "while serving" in serving.explanation


def test_a_socket_path_too_long_is_named_with_what_to_do() -> None:
    """pyzmq's own wording (vLLM's sockets under a deep TMPDIR): the start failed as 'unknown' before."""
    d = diagnose(SAMPLES["ipc_path_too_long"])
    assert "107 bytes" in d.explanation and "/tmp/pytest-of-root/pytest-103/" in d.explanation
    assert "VLLM_RPC_BASE_PATH" in d.fix and not d.is_oom
