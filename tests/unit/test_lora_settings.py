"""LoRA's settings of a revision: what vLLM is started with, its environment, and the memory pre-flight counts."""

from __future__ import annotations

from pathlib import Path

import pytest
from pydantic import ValidationError

from engine.capacity import GIB, ModelShape, lora_bytes, predict
from engine.revisions import EngineSettings
from engine.vllm import build_command, build_env
from tests.unit.test_capacity import H200, llama8b, settings  # noqa: F401 (a fixture)


def test_lora_on_starts_vllm_with_its_slots_and_the_deployment_s_adapters(tmp_path: Path) -> None:
    lora = settings(enable_lora=True, max_loras=4, max_lora_rank=16, max_cpu_loras=None)
    args = build_command(lora, python="python", port=1, data_dir=tmp_path, build="cuda",
                         lora_modules=[("a", "/m/a"), ("b", "/m/b")])
    at = args.index("--enable-lora")
    assert args[at:at + 7] == ["--enable-lora", "--max-loras", "4", "--max-lora-rank", "16", "--max-cpu-loras", "4"]
    assert args[args.index("--lora-modules") + 1:][:2] == ["a=/m/a", "b=/m/b"]
    plain = build_command(settings(), python="python", port=1, data_dir=tmp_path, build="cuda",
                          lora_modules=[("a", "/m/a")])
    assert "--enable-lora" not in plain and "--lora-modules" not in plain  # only where LoRA is on
    assert build_env({}, runtime_lora=True)["VLLM_ALLOW_RUNTIME_LORA_UPDATING"] == "True"
    assert "VLLM_ALLOW_RUNTIME_LORA_UPDATING" not in build_env({"VLLM_ALLOW_RUNTIME_LORA_UPDATING": "True"})


def test_pre_flight_counts_lora_s_buffers_out_of_the_kv_cache(llama8b: ModelShape) -> None:  # noqa: F811
    off = predict(llama8b, settings(gpu_memory_utilization=0.85), H200)
    on = predict(llama8b, settings(gpu_memory_utilization=0.85, enable_lora=True, max_loras=4, max_lora_rank=16),
                 H200)
    buffers = lora_bytes(llama8b, settings(enable_lora=True, max_loras=4, max_lora_rank=16))
    # every linear layer of 32: q, k, v, o, gate, up, down at rank 16, four slots, bf16: about 0.33 GiB
    assert buffers / GIB == pytest.approx(0.3125, abs=0.001)
    assert off.kv_bytes - on.kv_bytes == buffers and any("LoRA" in n for n in on.notes)
    assert lora_bytes(llama8b, settings(enable_lora=True, max_loras=8, max_lora_rank=64)) == 8 * buffers
    assert lora_bytes(llama8b, settings(enable_lora=False, max_loras=8)) == 0


def test_cpu_slots_fewer_than_the_batch_s_are_refused() -> None:
    with pytest.raises(ValidationError, match="at least max_loras"):
        EngineSettings.model_validate({"model": "org/m", "max_loras": 4, "max_cpu_loras": 2})
    with pytest.raises(ValidationError, match="the ranks vLLM serves"):
        EngineSettings.model_validate({"model": "org/m", "max_lora_rank": 12})
