"""A LoRA adapter is checked against its deployment's base model before anything starts (engine/adapters/check.py):
what vLLM would refuse, or what would read outside the allowed folders, is refused naming the reason."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import pytest

from engine.adapters import check_name, inspect
from engine.errors import AdapterInvalidError
from engine.revisions import EngineSettings, initial_settings
from tests.testkit.adapters import give_demo_weights, make_adapter, write_safetensors
from tests.testkit.data import make_data_dir


@pytest.fixture
def data(tmp_path: Path) -> Path:
    data_dir = make_data_dir(tmp_path / "data")
    give_demo_weights(data_dir / "models" / "demo")
    return data_dir


def settings(data: Path, **values: Any) -> EngineSettings:
    return EngineSettings.model_construct(**{**initial_settings(data.resolve()), "enable_lora": True,
                                             "max_lora_rank": 16, **values})


def refused(data: Path, path: str, **values: Any) -> str:
    with pytest.raises(AdapterInvalidError) as caught:
        inspect(path, settings(data, **values), data_dir=data, roots=None)
    assert caught.value.field == "path"
    return caught.value.reason


def test_an_adapter_that_fits_is_read_with_its_rank_and_modules(data: Path) -> None:
    folder = make_adapter(data / "models" / "tuned", rank=8, targets=("q_proj", "k_proj", "v_proj", "o_proj"))
    info = inspect("models/tuned", settings(data), data_dir=data, roots=None)
    assert info.path == folder.resolve() and info.rank == 8 and info.alpha == 16
    assert info.target_modules == ("q_proj", "k_proj", "v_proj", "o_proj") and info.base_model == "demo"


def test_what_does_not_fit_the_base_model_is_refused_with_the_reason(data: Path) -> None:
    make_adapter(data / "models" / "r32", rank=32)
    assert "rank 32 is above the deployment's max_lora_rank 16" in refused(data, "models/r32")
    make_adapter(data / "models" / "gpt2ish", targets=("c_attn",))
    assert "c_attn are not modules of the base model" in refused(data, "models/gpt2ish")
    other = {"self_attn.q_proj": (4096, 4096), "self_attn.v_proj": (1024, 4096)}  # an 8B model's
    make_adapter(data / "models" / "for-8b", modules=other)
    assert "trained for another model" in refused(data, "models/for-8b")
    make_adapter(data / "models" / "ok")
    assert "enable_lora is off" in refused(data, "models/ok", enable_lora=False)
    make_adapter(data / "models" / "dora", use_dora=True)
    assert "DoRA" in refused(data, "models/dora")
    make_adapter(data / "models" / "heads", modules_to_save=["lm_head"])
    assert "modules_to_save" in refused(data, "models/heads")
    make_adapter(data / "models" / "ia3", peft_type="IA3")
    assert "only LoRA" in refused(data, "models/ia3")


def test_a_config_and_weights_that_say_another_rank_are_refused(data: Path) -> None:
    folder = make_adapter(data / "models" / "liar", rank=8)
    config = json.loads((folder / "adapter_config.json").read_text())
    (folder / "adapter_config.json").write_text(json.dumps({**config, "r": 4}))
    assert "not of rank 4" in refused(data, "models/liar")


def test_pickled_weights_and_missing_files_are_refused(data: Path) -> None:
    folder = make_adapter(data / "models" / "pickled")
    (folder / "adapter_model.safetensors").rename(folder / "adapter_model.bin")
    assert "pickled code" in refused(data, "models/pickled")
    (data / "models" / "empty").mkdir()
    assert "no adapter_config.json" in refused(data, "models/empty")
    assert "no folder" in refused(data, "models/nowhere")


def test_hostile_paths_and_files_are_refused(data: Path, tmp_path: Path) -> None:
    outside = make_adapter(tmp_path / "elsewhere")
    assert "outside the folders" in refused(data, str(outside))
    os.symlink(outside, data / "models" / "link-out")
    assert "outside the folders" in refused(data, "models/link-out")  # a link is followed before it is judged
    inside = make_adapter(data / "models" / "half-out")
    (inside / "adapter_model.safetensors").unlink()
    os.symlink(outside / "adapter_model.safetensors", inside / "adapter_model.safetensors")
    assert "links outside" in refused(data, "models/half-out")
    assert ". or .." in refused(data, "models/../models/ok")
    assert "control character" in refused(data, "models/a\x00b")
    deep = make_adapter(data / "models" / "deep")
    (deep / "adapter_config.json").write_text("[" * 100_000 + "]" * 100_000)
    assert "not JSON" in refused(data, "models/deep") or "not a JSON object" in refused(data, "models/deep")
    (deep / "adapter_config.json").write_text(json.dumps({"peft_type": "LORA", "r": float("nan")}))
    assert "whole number" in refused(data, "models/deep")
    huge = make_adapter(data / "models" / "huge")
    with (huge / "adapter_model.safetensors").open("wb") as f:
        f.write((1 << 62).to_bytes(8, "little") + b"{}")
    assert "not a safetensors file" in refused(data, "models/huge")


def test_weights_that_are_not_lora_matrices_are_refused(data: Path) -> None:
    folder = make_adapter(data / "models" / "full")
    write_safetensors(folder / "adapter_model.safetensors", {"model.layers.0.self_attn.q_proj.weight": [256, 256]})
    assert "not a LoRA matrix" in refused(data, "models/full")


@pytest.mark.parametrize("name", ["", "-flag", "a/b", "x" * 129, "tab\there", "new\nline", "../up"])
def test_an_adapter_name_is_one_plain_model_name(name: str) -> None:
    with pytest.raises(AdapterInvalidError) as caught:
        check_name(name)
    assert caught.value.field == "name"
