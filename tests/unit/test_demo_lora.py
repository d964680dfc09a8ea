"""The demo LoRA adapter's builder (engine/demo_model/lora.py), on a tiny random Llama: PEFT's layout and key names,
B at zero (an untrained adapter is the base), the PEFT arithmetic of what is written, the atomic write. The real
adapter on the real demo model, served by vLLM, is `llmops demo-model`'s job and the system tier's."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from transformers import LlamaConfig, LlamaForCausalLM

from engine.demo_model import DemoLoraSpec, build_demo_lora
from engine.demo_model import lora as lora_mod
from engine.demo_model.train import EOS, PAD, _train_tokenizer, stdlib_docstrings

LAYERS = 2
HIDDEN, KV_OUT = 64, 32  # 2 heads and 1 KV head of head_dim 32
# A handful of steps on a small corpus: the file's shape is what is tested, not what it learned.
TINY = DemoLoraSpec(steps=3, batch_size=4, seq_len=32, corpus_chars=20_000, warmup_steps=1)


@pytest.fixture(scope="module")
def tiny_base(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A random Llama of the demo model's kind (tied embeddings, GQA, bf16 on disk) with a BPE tokenizer of the
    same special tokens, in a folder named like the real one."""
    folder = tmp_path_factory.mktemp("models") / "demo"
    folder.mkdir()
    raw = _train_tokenizer(stdlib_docstrings(20_000), 320)
    raw.save(str(folder / "tokenizer.json"))  # all the builder reads of the tokenizer
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=raw.get_vocab_size(), hidden_size=HIDDEN, intermediate_size=128,
                         num_hidden_layers=LAYERS, num_attention_heads=2, num_key_value_heads=1, head_dim=32,
                         tie_word_embeddings=True, eos_token_id=raw.token_to_id(EOS),
                         pad_token_id=raw.token_to_id(PAD))
    model = LlamaForCausalLM(config)  # type: ignore[no-untyped-call]
    model.to(torch.bfloat16)  # type: ignore[arg-type]  # (transformers' annotation of .to is off)
    model.save_pretrained(folder, safe_serialization=True)
    return folder


def _load(base: Path) -> torch.nn.Module:
    model: torch.nn.Module = LlamaForCausalLM.from_pretrained(base, dtype=torch.float32)
    return model.eval()


def _logits(model: torch.nn.Module) -> torch.Tensor:
    ids = torch.arange(1, 17).unsqueeze(0)
    with torch.no_grad():
        out: torch.Tensor = model(input_ids=ids).logits
    return out


def test_an_untrained_adapter_is_the_base_model(tiny_base: Path) -> None:
    """PEFT's init: A small and random, B zero, so wrapping changes nothing until training moves B."""
    base = _load(tiny_base)
    before = _logits(base)
    wrapped = lora_mod.attach_lora(base, TINY)
    assert len(wrapped) == 4 * LAYERS
    for lora in wrapped.values():
        assert torch.count_nonzero(lora.lora_B) == 0
        assert 0 < float(lora.lora_A.detach().abs().max()) <= 1 / HIDDEN**0.5  # kaiming-uniform's bound, 1/sqrt(fan_in)
        assert lora.scaling == 2.0  # alpha 16 / r 8
    assert torch.equal(_logits(base), before)
    trainable = {n for n, p in base.named_parameters() if p.requires_grad}
    assert trainable and all(n.endswith(("lora_A", "lora_B")) for n in trainable)  # the base is frozen


def test_the_adapter_is_written_in_peft_layout(tiny_base: Path, tmp_path: Path) -> None:
    out = tmp_path / "models" / "demo-lora"
    build_demo_lora(tiny_base, out, log_path=tmp_path / "logs" / "lora.log", spec=TINY)

    assert sorted(p.name for p in out.iterdir()) == ["adapter_config.json", "adapter_model.safetensors",
                                                    "training.json"]
    assert [p.name for p in out.parent.iterdir()] == ["demo-lora"]  # no temporary folder left beside it
    config = json.loads((out / "adapter_config.json").read_text())
    assert {k: config[k] for k in ("peft_type", "task_type", "r", "lora_alpha", "lora_dropout", "target_modules",
                                   "bias", "fan_in_fan_out", "inference_mode", "base_model_name_or_path")} == {
        "peft_type": "LORA", "task_type": "CAUSAL_LM", "r": 8, "lora_alpha": 16, "lora_dropout": 0.0,
        "target_modules": ["q_proj", "k_proj", "v_proj", "o_proj"], "bias": "none", "fan_in_fan_out": False,
        "inference_mode": True, "base_model_name_or_path": "demo"}
    assert not config["use_dora"] and not config["use_rslora"] and config["modules_to_save"] is None

    tensors = load_file(str(out / "adapter_model.safetensors"))
    outs = {"q_proj": HIDDEN, "k_proj": KV_OUT, "v_proj": KV_OUT, "o_proj": HIDDEN}
    expected: dict[str, tuple[int, int]] = {}
    for i in range(LAYERS):
        for proj, features in outs.items():
            stem = f"base_model.model.model.layers.{i}.self_attn.{proj}"
            expected[f"{stem}.lora_A.weight"] = (8, HIDDEN)  # in_features: hidden for o_proj too (2 heads x 32)
            expected[f"{stem}.lora_B.weight"] = (features, 8)
    assert {k: tuple(v.shape) for k, v in tensors.items()} == expected
    assert {v.dtype for v in tensors.values()} == {torch.bfloat16}  # the base's dtype on disk
    assert all(torch.count_nonzero(v) > 0 for k, v in tensors.items() if "lora_B" in k)  # training moved B

    training = json.loads((out / "training.json").read_text())
    assert training["spec"]["steps"] == 3 and training["seconds"] > 0
    assert [p["step"] for p in training["loss_curve"]] == [1, 3]
    assert "adapter step" in (tmp_path / "logs" / "lora.log").read_text()


def test_what_is_written_applied_the_peft_way_is_what_was_trained(tiny_base: Path, tmp_path: Path) -> None:
    """Merging W + (alpha / r) B A from the file into the base (what PEFT's merge and vLLM's LoRA compute) gives the
    trained model's logits: the keys name the right modules and A, B are not swapped or transposed."""
    out = tmp_path / "demo-lora"
    build_demo_lora(tiny_base, out, spec=TINY)
    tensors = load_file(str(out / "adapter_model.safetensors"))

    trained = _load(tiny_base)
    wrapped = lora_mod.attach_lora(trained, TINY)
    merged = _load(tiny_base)
    state = merged.state_dict()
    for name, lora in wrapped.items():
        a, b = tensors[f"{name}.lora_A.weight"].float(), tensors[f"{name}.lora_B.weight"].float()
        with torch.no_grad():
            lora.lora_A.copy_(a)
            lora.lora_B.copy_(b)
        state[f"{name.removeprefix('base_model.model.')}.weight"] += 2.0 * b @ a
    merged.load_state_dict(state)

    assert torch.allclose(_logits(merged), _logits(trained), atol=1e-4)
    assert not torch.allclose(_logits(merged), _logits(_load(tiny_base)), atol=1e-4)


def test_a_rebuild_replaces_the_adapter_with_the_same_bytes_and_a_failed_one_keeps_it(
        tiny_base: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Seeded, fixed threads and steps: building again gives the same adapter. A build that fails while writing
    leaves the previous adapter whole and no temporary folder."""
    out = tmp_path / "demo-lora"
    build_demo_lora(tiny_base, out, spec=TINY)
    before = (out / "adapter_model.safetensors").read_bytes()
    build_demo_lora(tiny_base, out, spec=TINY)
    assert (out / "adapter_model.safetensors").read_bytes() == before
    assert [p.name for p in tmp_path.iterdir()] == ["demo-lora"]

    def broken(*args: object, **kwargs: object) -> None:
        raise OSError("disk full")

    monkeypatch.setattr("safetensors.torch.save_file", broken)
    with pytest.raises(OSError, match="disk full"):
        build_demo_lora(tiny_base, out, spec=TINY)
    assert [p.name for p in tmp_path.iterdir()] == ["demo-lora"]
    assert (out / "adapter_model.safetensors").read_bytes() == before
