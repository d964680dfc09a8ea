"""The capacity model against vLLM's own arithmetic, and against real vLLM 0.26 start-up logs from an H200."""

from __future__ import annotations

import ast
import json
from pathlib import Path

import pytest

from engine.capacity import (
    GIB,
    Device,
    ModelShape,
    batched_tokens,
    estimate_activation,
    kv_bytes_per_token,
    load_shape,
    parse_start,
    predict,
    to_calibration,
    weight_bytes,
)
from engine.db import CalibrationRow
from engine.revisions import EngineSettings

LOGS = Path(__file__).parent.parent / "fixtures" / "vllm_logs"
# Llama-3-8B's shape, as ../shared/gpu/make_shape_model.py writes it for the H200 runs.
LLAMA3_8B = {"architectures": ["LlamaForCausalLM"], "hidden_size": 4096, "intermediate_size": 14336,
             "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 8, "vocab_size": 128256,
             "max_position_embeddings": 8192, "tie_word_embeddings": False, "torch_dtype": "bfloat16"}
# NVML on the H200: 150,754,820,096 bytes; vLLM's (torch's) view of the total is 139.8 GiB.
H200 = Device("cuda", int(139.8 * GIB), int(139.29 * GIB), count=1, name="NVIDIA H200")


@pytest.fixture
def llama8b(tmp_path: Path) -> ModelShape:
    (tmp_path / "config.json").write_text(json.dumps(LLAMA3_8B))
    return load_shape(tmp_path)


def settings(**values: object) -> EngineSettings:
    return EngineSettings.model_construct(**{**EngineSettings.model_construct(model="m").model_dump(),
                                             "load_format": "dummy", **values})


def test_llama3_8b_weights_and_kv_bytes_per_token(llama8b: ModelShape) -> None:
    assert llama8b.parameters() == pytest.approx(8.03e9, rel=0.001)
    assert weight_bytes(llama8b, settings()) / GIB == pytest.approx(14.96, abs=0.01)  # vLLM: "took 14.96 GiB"
    per_tp = {tp: kv_bytes_per_token(llama8b, settings(tensor_parallel_size=tp)) for tp in (1, 2, 4, 8, 16)}
    assert per_tp == {1: 128 * 1024, 2: 64 * 1024, 4: 32 * 1024, 8: 16 * 1024, 16: 16 * 1024}  # 8 KV heads run out
    assert kv_bytes_per_token(llama8b, settings(kv_cache_dtype="fp8")) == 64 * 1024


def test_mla_kv_is_the_latent_not_split_by_tp(tmp_path: Path) -> None:
    cfg = {**LLAMA3_8B, "kv_lora_rank": 512, "qk_rope_head_dim": 64, "num_hidden_layers": 61}
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    shape = load_shape(tmp_path)
    assert kv_bytes_per_token(shape, settings(tensor_parallel_size=8)) == 61 * 576 * 2


def test_cpu_kv_cache_is_the_explicit_size_in_blocks(data_dir: Path) -> None:
    shape = load_shape(data_dir / "models" / "demo")
    pred = predict(shape, settings(cpu_kv_cache_gib=0.25, max_model_len=2048), Device("cpu", 8 * GIB, 6 * GIB))
    assert pred.kv_bytes_per_token == 1024  # 2 x 2 layers x 2 KV heads x 64 x 2 bytes
    assert pred.kv_tokens == 262_144  # vLLM 0.32 CPU: "CPU KV cache size: 262,144 tokens"
    assert pred.max_concurrency == 128.0  # "Maximum concurrency for 2,048 tokens per request: 128.00x"
    tiny = predict(shape, settings(cpu_kv_cache_gib=1 / 1024, max_model_len=2048), Device("cpu", 8 * GIB, 6 * GIB))
    assert tiny.usable_tokens == 896 and not tiny.fits_one_request  # vLLM: "estimated maximum model length is 896"


def test_parse_start_reads_every_term_of_the_budget() -> None:
    r = parse_start((LOGS / "startup-util085-len4096.log").read_text().splitlines())
    assert (r.weights_gib, r.activation_gib, r.non_torch_gib, r.cudagraph_gib) == (14.96, 1.1, 0.22, 0.22)
    assert (r.utilization, r.requested_gib, r.total_gib, r.kv_gib) == (0.85, 118.83, 139.8, 102.54)
    assert (r.kv_tokens, r.concurrency_len, r.concurrency) == (840_016, 4096, 205.08)


def test_parse_start_reads_the_newer_wording_and_the_cpu_line() -> None:
    lines = ["INFO [gpu_worker.py] Model loading took 14.96 GiB and 3.1 seconds",
             "INFO Free memory on device (139.29/139.8 GiB) on startup. Desired GPU memory utilization is (0.5, "
             "69.9 GiB). Actual usage is 15.18 GiB for consumed memory (weights + non-torch), 1.1 GiB for peak "
             "activation, and 0.22 GiB for CUDAGraph memory. Replace gpu_memory_utilization config with ...",
             "INFO Available KV cache memory: 53.62 GiB"]
    r = parse_start(lines)
    assert r.non_torch_gib == pytest.approx(0.22) and r.activation_gib == 1.1 and r.kv_gib == 53.62
    cpu = parse_start([  # vLLM 0.32.0, CPU build, demo model, --kv-cache-memory-bytes 268435456
        "(Worker pid=2334) INFO 11-30 01:17:31 [cpu_worker.py:260] Explicitly set (0.25/7.96) GiB for KV cache on "
        "node 0.",
        "(EngineCore pid=2313) INFO 11-30 01:17:31 [kv_cache_utils.py:2327] CPU KV cache size: 262,144 tokens, "
        "Maximum concurrency for 2,048 tokens per request: 128.00x"])
    assert (cpu.kv_gib, cpu.kv_tokens, cpu.concurrency_len, cpu.concurrency) == (0.25, 262_144, 2048, 128.0)


# Real H200 starts (vLLM 0.26.0, Llama-3-8B shape, dummy weights, driver 580.159.04): the engine's own starts
# in the order they happened on 2026-11-30 (they calibrate), then the accuracy table's starts and older logs.
H200_DAY = LOGS / "h200-2026-11-30"
ENGINE_STARTS = ["engine-start-1.log", "engine-start-2.log", "engine-start-3-after-rollback.log"]
ACCURACY_CASES = [f"h200-2026-11-30/accuracy-{i}.log" for i in range(6)] + [
    "startup-util085-len4096.log", "startup-util090-len8192-excerpt.log", "startup-util013-len8192.log",
    "startup-util0125-eager.log"]


def read(name: str) -> list[str]:
    return (LOGS / name).read_text().splitlines()


def settings_from_log(lines: list[str]) -> EngineSettings:
    """The revision a start ran, from vLLM's own "non-default args" line."""
    line = next(ln for ln in lines if "non-default args:" in ln)
    args = ast.literal_eval(line.split("non-default args: ", 1)[1])
    keys = ("gpu_memory_utilization", "max_model_len", "max_num_seqs", "enforce_eager", "kv_cache_dtype",
            "max_num_batched_tokens")
    return settings(**{k: args[k] for k in keys if k in args})


def calibration_row(shape: ModelShape, name: str) -> CalibrationRow:
    lines = read(f"h200-2026-11-30/{name}")
    r = parse_start(lines)
    assert r.complete and r.requested_gib and r.utilization and r.activation_gib is not None
    s = settings_from_log(lines)
    tokens = batched_tokens(s, shape, "cuda")
    return CalibrationRow(host="h200", model="m", weights=round((r.weights_gib or 0) * GIB),
                          activation=round(r.activation_gib * GIB),
                          activation_estimate=estimate_activation(shape, s, tokens),
                          non_torch=round((r.non_torch_gib or 0) * GIB),
                          device_total=round(r.requested_gib / r.utilization * GIB), batched_tokens=tokens,
                          enforce_eager=s.enforce_eager, max_num_seqs=s.max_num_seqs, tensor_parallel_size=1,
                          dtype="auto")


def test_activation_varies_between_identical_starts_so_calibration_takes_the_median(llama8b: ModelShape) -> None:
    rows = [calibration_row(llama8b, n) for n in ENGINE_STARTS]
    assert [round(r.activation / GIB, 2) for r in rows] == [1.1, 1.04, 0.45]  # starts 2 and 3: same settings
    cal = to_calibration(rows[::-1])
    assert cal.starts == 3 and cal.weights == round(14.96 * GIB)
    assert cal.activation_factor == pytest.approx(1.04 / (estimate_activation(llama8b, settings(max_num_seqs=1,
                                                  max_model_len=4096), 4096) / GIB), rel=0.01)


def test_default_batched_tokens_follow_vllm(llama8b: ModelShape) -> None:
    assert batched_tokens(settings(max_model_len=4096, max_num_seqs=64), llama8b, "cuda") == 8192
    assert batched_tokens(settings(max_model_len=4096, max_num_seqs=1), llama8b, "cuda") == 4096  # vLLM logged it
    assert batched_tokens(settings(max_num_batched_tokens=16384), llama8b, "cuda") == 16384


@pytest.mark.parametrize("log", ACCURACY_CASES)
def test_h200_accuracy_table_within_3_percent(llama8b: ModelShape, log: str) -> None:
    """Calibrated from the engine's three starts that day, every start's KV tokens are predicted within 3 %."""
    calibration = to_calibration([calibration_row(llama8b, n) for n in reversed(ENGINE_STARTS)])
    lines = read(log)
    logged = parse_start(lines).kv_tokens
    assert logged
    pred = predict(llama8b, settings_from_log(lines), H200, calibration)
    assert pred.calibrated
    assert abs(pred.kv_tokens - logged) / logged < 0.03, (pred.kv_tokens, logged)


@pytest.mark.parametrize("log", ACCURACY_CASES)
def test_uncalibrated_prediction_is_within_5_percent(llama8b: ModelShape, log: str) -> None:
    lines = read(log)
    logged = parse_start(lines).kv_tokens
    assert logged
    pred = predict(llama8b, settings_from_log(lines), H200)
    assert not pred.calibrated and abs(pred.kv_tokens - logged) / logged < 0.05, (pred.kv_tokens, logged)


def test_failed_h200_start_is_predicted_to_have_no_kv_memory(llama8b: ModelShape) -> None:
    calibration = to_calibration([calibration_row(llama8b, n) for n in reversed(ENGINE_STARTS)])
    pred = predict(llama8b, settings_from_log(read("fail-util011-no-cache-memory.log")), H200, calibration)
    assert pred.kv_bytes < 0 and pred.kv_tokens == 0 and not pred.fits_one_request  # vLLM logged -0.68 GiB
    assert pred.kv_bytes / GIB == pytest.approx(-0.68, abs=0.1)


@pytest.mark.store
def test_calibration_store_keeps_the_last_starts_per_model(db_target: Path | str, llama8b: ModelShape) -> None:
    from engine.capacity import CalibrationStore
    from engine.db import open_database

    calibrations = CalibrationStore(open_database(db_target))  # an H200's byte counts: past 32 bits
    assert calibrations.latest("m", 1, "auto") is None
    for name in ENGINE_STARTS:
        lines = read(f"h200-2026-11-30/{name}")
        s = settings_from_log(lines)
        tokens = batched_tokens(s, llama8b, "cuda")
        assert calibrations.record(parse_start(lines), s, tokens, estimate_activation(llama8b, s, tokens), 1)
    cal = calibrations.latest("m", 1, "auto")
    assert cal is not None and cal.starts == 3 and cal.activation_factor == pytest.approx(1.0, abs=0.01)
    assert calibrations.latest("m", 2, "auto") is None  # another TP size is another calibration
    assert calibrations.record(parse_start(read("fail-util011-no-cache-memory.log")), settings(), 8192, 1, 1) is None
