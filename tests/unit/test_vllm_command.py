from __future__ import annotations

from pathlib import Path

from engine.revisions import EngineSettings, initial_settings, merge_values, validate_settings
from engine.serving import build_command, build_env


def settings(data_dir: Path, **changes: object) -> EngineSettings:
    base = EngineSettings.model_construct(**initial_settings(data_dir)).model_dump()
    return validate_settings(merge_values(base, changes), data_dir)


def flag(args: list[str], name: str) -> str | None:
    return args[args.index(name) + 1] if name in args else None


def test_cpu_command_sizes_the_kv_cache_explicitly(data_dir: Path) -> None:
    args = build_command(settings(data_dir, cpu_kv_cache_gib=0.25, max_num_seqs=3), python="/py", port=4321,
                         data_dir=data_dir, build="cpu")
    assert args[:3] == ["/py", "-m", "vllm.entrypoints.openai.api_server"]
    assert flag(args, "--port") == "4321" and flag(args, "--host") == "127.0.0.1"
    assert flag(args, "--kv-cache-memory-bytes") == str(256 * 1024 * 1024)
    assert flag(args, "--max-num-seqs") == "3"
    assert flag(args, "--model") == str((data_dir / "models" / "demo").resolve())
    assert "--gpu-memory-utilization" not in args


def test_cuda_command_passes_utilization_and_flags(data_dir: Path) -> None:
    s = settings(data_dir, gpu_memory_utilization=0.8, enforce_eager=True, trust_remote_code=True,
                 max_num_batched_tokens=4096, enable_prefix_caching=False, extra_args=["--seed=3"],
                 model="org/model")
    args = build_command(s, python="/py", port=1, data_dir=data_dir, build="cuda")
    assert flag(args, "--gpu-memory-utilization") == "0.8"
    assert flag(args, "--model") == "org/model"
    assert "--enforce-eager" in args and "--trust-remote-code" in args
    assert "--no-enable-prefix-caching" in args
    assert flag(args, "--max-num-batched-tokens") == "4096"
    assert args[-1] == "--seed=3"
    assert "--kv-cache-memory-bytes" not in args


def test_every_argument_is_its_own_list_item(data_dir: Path) -> None:
    s = settings(data_dir, served_model_name="my model".replace(" ", "-"))
    args = build_command(s, python="/py", port=1, data_dir=data_dir, build="cpu")
    assert all(isinstance(a, str) and "\n" not in a for a in args)
    assert flag(args, "--served-model-name") == "my-model"


def test_env_turns_off_usage_reporting_and_legacy_kv_override() -> None:
    env = build_env({"PATH": "/bin", "VLLM_CPU_KVCACHE_SPACE": "40"}, offline=True)
    assert "VLLM_CPU_KVCACHE_SPACE" not in env
    assert env["VLLM_NO_USAGE_STATS"] == "1" and env["HF_HUB_OFFLINE"] == "1" and env["PATH"] == "/bin"
