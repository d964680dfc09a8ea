from __future__ import annotations

from pathlib import Path

import pytest

from engine.errors import InvalidSettingsError
from engine.revisions import (
    ALLOWED_EXTRA_FLAGS,
    FIELD_NAMES,
    EngineSettings,
    field_help,
    initial_settings,
    merge_values,
    validate_settings,
)


def full(data_dir: Path, **changes: object) -> dict[str, object]:
    return merge_values(EngineSettings.model_construct(**initial_settings(data_dir)).model_dump(), changes)


def bad_fields(data_dir: Path, **changes: object) -> dict[str, str]:
    with pytest.raises(InvalidSettingsError) as info:
        validate_settings(full(data_dir, **changes), data_dir)
    return {str(e["loc"][-1]): str(e["msg"]) for e in info.value.errors}  # type: ignore[index]


def test_initial_settings_are_valid(data_dir: Path) -> None:
    settings = validate_settings(full(data_dir), data_dir)
    assert settings.max_num_seqs == 16
    assert settings.model.endswith("models/demo")


@pytest.mark.parametrize(
    ("field", "value", "reason"),
    [
        ("gpu_memory_utilization", 0, "greater than 0"),
        ("gpu_memory_utilization", 1.2, "less than or equal to 1"),
        ("max_num_seqs", 0, "greater than or equal to 1"),
        ("max_num_seqs", "many", "valid integer"),
        ("max_model_len", -5, "greater than or equal to 16"),
        ("tensor_parallel_size", 0, "greater than or equal to 1"),
        ("dtype", "int3", "'auto'"),
        ("cpu_kv_cache_gib", 0, "greater than 0"),
        ("served_model_name", "bad name!", "letters"),
    ],
)
def test_out_of_range_values_name_the_field_and_why(data_dir: Path, field: str, value: object, reason: str) -> None:
    errors = bad_fields(data_dir, **{field: value})
    assert list(errors) == [field]
    assert reason in errors[field]


def test_every_bad_field_is_reported_at_once(data_dir: Path) -> None:
    errors = bad_fields(data_dir, max_num_seqs=0, gpu_memory_utilization=2, model="/nope/nowhere")
    assert set(errors) == {"max_num_seqs", "gpu_memory_utilization", "model"}


def test_model_is_a_folder_with_config_or_a_hub_id(data_dir: Path) -> None:
    assert validate_settings(full(data_dir, model="meta-llama/Llama-3.1-8B-Instruct"), data_dir)
    assert validate_settings(full(data_dir, model="models/demo"), data_dir)  # relative to the data dir
    assert "no model folder" in bad_fields(data_dir, model="/tmp/definitely/not/here")["model"]
    assert "hub id" in bad_fields(data_dir, model="not a model")["model"]
    (data_dir / "empty").mkdir()
    assert "model" in bad_fields(data_dir, model=str(data_dir / "empty"))


def test_unknown_fields_are_refused(data_dir: Path) -> None:
    assert "max_num_seq" in bad_fields(data_dir, max_num_seq=4)


def test_extra_args_are_allow_listed(data_dir: Path) -> None:
    ok = validate_settings(full(data_dir, extra_args=["--seed=7", "--disable-log-stats"]), data_dir)
    assert ok.extra_args == ["--seed=7", "--disable-log-stats"]
    assert "not allowed" in bad_fields(data_dir, extra_args=["--port=1"])["extra_args"]
    assert "not allowed" in bad_fields(data_dir, extra_args=["--chat-template=/etc/passwd"])["extra_args"]
    assert "form" in bad_fields(data_dir, extra_args=["--seed=1\n--port=2"])["extra_args"]
    assert "form" in bad_fields(data_dir, extra_args=["; rm -rf /"])["extra_args"]
    assert "--port" not in ALLOWED_EXTRA_FLAGS and "--model" not in ALLOWED_EXTRA_FLAGS


def test_partial_values_keep_the_base(data_dir: Path) -> None:
    base = full(data_dir)
    merged = merge_values(base, {"max_num_seqs": 4})
    assert merged["max_num_seqs"] == 4
    assert {k: v for k, v in merged.items() if k != "max_num_seqs"} == {
        k: v for k, v in base.items() if k != "max_num_seqs"
    }


def test_every_field_is_documented_once() -> None:
    assert len(FIELD_NAMES) == 15
    for name in FIELD_NAMES:
        assert len(field_help(name)) > 20, name
