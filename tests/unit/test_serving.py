"""Parsing vLLM's /metrics (a real scrape of vLLM 0.32, and the older names) into live serving figures."""

from __future__ import annotations

from pathlib import Path

import pytest

from engine.metrics import Histogram, derive, parse

REAL = (Path(__file__).parent.parent / "fixtures" / "vllm-0.32-cpu-metrics.txt").read_text()

OLD_NAMES = """
# TYPE vllm:gpu_cache_usage_perc gauge
vllm:gpu_cache_usage_perc{model_name="m"} 0.25
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{model_name="m"} 3
# TYPE vllm:generation_tokens_total counter
vllm:generation_tokens_total{model_name="m"} 1000
# TYPE vllm:time_per_output_token_seconds histogram
vllm:time_per_output_token_seconds_bucket{le="0.01",model_name="m"} 10
vllm:time_per_output_token_seconds_bucket{le="0.05",model_name="m"} 90
vllm:time_per_output_token_seconds_bucket{le="+Inf",model_name="m"} 100
vllm:time_per_output_token_seconds_count{model_name="m"} 100
vllm:time_per_output_token_seconds_sum{model_name="m"} 2.5
"""


def test_real_vllm_032_scrape() -> None:
    s = parse(REAL, 100.0)
    assert s.gauges == {"requests_running": 0.0, "requests_waiting": 0.0, "kv_cache_usage": 0.0}
    assert s.counters["generation_tokens"] == 21.0 and s.counters["prompt_tokens"] > 0  # 1-token probe + 20
    assert s.finished["length"] == 2.0 and s.finished["stop"] == 0.0
    assert s.histograms["e2e_seconds"].count == 2.0
    assert s.histograms["ttft_seconds"].quantile(0.95) is not None


def test_older_metric_names_map_to_the_same_figures() -> None:
    s = parse(OLD_NAMES, 10.0)
    assert s.gauges["kv_cache_usage"] == 0.25 and s.gauges["requests_running"] == 3
    assert s.counters["generation_tokens"] == 1000
    assert s.histograms["itl_seconds"].quantile(0.5) == pytest.approx(0.01 + 0.04 * (50 - 10) / 80)


def test_rates_and_quantiles_are_since_the_previous_scrape() -> None:
    before = parse(OLD_NAMES, 10.0)
    later = parse(OLD_NAMES.replace("} 1000", "} 1600").replace('le="+Inf",model_name="m"} 100',
                                                                  'le="+Inf",model_name="m"} 200')
                  .replace('_count{model_name="m"} 100', '_count{model_name="m"} 200'), 15.0)
    live = derive(later, before)
    assert live["generation_tokens_per_s"] == 120.0
    assert live["itl_seconds_p99"] == 0.05  # the 100 new observations all fell in the +Inf bucket


def test_histogram_quantile_interpolates_like_prometheus() -> None:
    h = Histogram({0.1: 50.0, 0.5: 90.0, float("inf"): 100.0}, 100.0, 20.0)
    assert h.quantile(0.5) == pytest.approx(0.1)
    assert h.quantile(0.7) == pytest.approx(0.1 + 0.4 * 20 / 40)
    assert h.quantile(0.99) == 0.5
    assert Histogram().quantile(0.5) is None


def test_engine_log_comes_back_after_it_is_deleted(tmp_path: Path) -> None:
    """Outside probe: engine.log deleted (by hand, or by a cleanup) was never written again."""
    import logging
    import shutil

    from engine.app import engine_log_handler
    from engine.config import AppConfig

    handler = engine_log_handler(AppConfig(data_dir=tmp_path / "data"))
    logger = logging.Logger("llmops.test-engine-log")
    logger.addHandler(handler)
    try:
        logger.warning("first line")
        path = tmp_path / "data" / "logs" / "engine.log"
        assert "first line" in path.read_text()
        path.unlink()
        logger.warning("after the file was deleted")
        assert "after the file was deleted" in path.read_text()
        shutil.rmtree(tmp_path / "data" / "logs")
        logger.warning("after its folder was deleted")
        assert "after its folder was deleted" in path.read_text() and oct(path.stat().st_mode & 0o777) == "0o600"
    finally:
        handler.close()
