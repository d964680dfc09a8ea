from __future__ import annotations

from pathlib import Path

import pytest

from engine.errors import InvalidSettingsError
from engine.revisions import (
    ALLOWED_EXTRA_FLAGS,
    FIELD_NAMES,
    EngineSettings,
    VllmFlag,
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
        ("max_num_seqs_ceiling", 8, "at least max_num_seqs (16)"),
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
    assert "outside the folders" in bad_fields(data_dir, model="/tmp/definitely/not/here")["model"]
    assert "no model folder" in bad_fields(data_dir, model=str(data_dir / "models" / "missing"))["model"]
    assert "hub id" in bad_fields(data_dir, model="not a model")["model"]
    (data_dir / "empty").mkdir()
    assert "model" in bad_fields(data_dir, model=str(data_dir / "empty"))


def test_unknown_fields_are_refused(data_dir: Path) -> None:
    assert "max_num_seq" in bad_fields(data_dir, max_num_seq=4)


def test_extra_args_are_allow_listed(data_dir: Path) -> None:
    ok = validate_settings(full(data_dir, extra_args=["--seed=7", "--disable-log-stats"]), data_dir)
    assert ok.extra_args == ["--seed=7", "--disable-log-stats"]
    graphs = validate_settings(full(data_dir, extra_args=["--max-cudagraph-capture-size=512"]), data_dir)
    assert graphs.extra_args == ["--max-cudagraph-capture-size=512"]
    assert "not allowed" in bad_fields(data_dir, extra_args=["--port=1"])["extra_args"]
    assert "not allowed" in bad_fields(data_dir, extra_args=["--chat-template=/etc/passwd"])["extra_args"]
    assert "form" in bad_fields(data_dir, extra_args=["--seed=1\n--port=2"])["extra_args"]
    assert "form" in bad_fields(data_dir, extra_args=["; rm -rf /"])["extra_args"]
    assert "--port" not in ALLOWED_EXTRA_FLAGS and "--model" not in ALLOWED_EXTRA_FLAGS


def test_vllm_s_stream_interval_is_a_whole_number_the_gateway_reads(data_dir: Path) -> None:
    """--stream-interval=N (tokens per event) is allowed, and read by the gateway to meter a stream cut before its
    usage: so it must be a number vLLM takes, checked when written, not when vLLM fails to start on it."""
    assert validate_settings(full(data_dir), data_dir).tokens_per_event == 1
    four = validate_settings(full(data_dir, extra_args=["--seed=7", "--stream-interval=4"]), data_dir)
    assert four.tokens_per_event == 4
    assert validate_settings(full(data_dir, extra_args=["--stream-interval=2", "--stream-interval=8"]),
                             data_dir).tokens_per_event == 8  # the last one wins, as in vLLM's parser
    for bad in ("0", "-1", "1025", "4.5", "four", "\u0664", "99999999999999999999"):
        found = bad_fields(data_dir, extra_args=[f"--stream-interval={bad}"])
        assert "whole number from 1 to 1024" in found["extra_args"], bad
    assert "whole number" in bad_fields(data_dir, extra_args=["--stream-interval"])["extra_args"]


def test_partial_values_keep_the_base(data_dir: Path) -> None:
    base = full(data_dir)
    merged = merge_values(base, {"max_num_seqs": 4})
    assert merged["max_num_seqs"] == 4
    assert {k: v for k, v in merged.items() if k != "max_num_seqs"} == {
        k: v for k, v in base.items() if k != "max_num_seqs"
    }


def test_every_field_is_documented_once() -> None:
    assert len(FIELD_NAMES) == 30
    for name in FIELD_NAMES:
        assert len(field_help(name)) > 20, name


def test_a_link_out_of_the_roots_is_outside_them_whatever_the_path_says(data_dir: Path, tmp_path: Path) -> None:
    """models/link/../victim with link a symlink: normalised it reads models/victim, resolved it is the victim's
    parent's sibling; a link inside models/ to a folder elsewhere is elsewhere."""
    outside = tmp_path / "outside"
    (outside / "deep").mkdir(parents=True)
    (outside / "victim").mkdir()
    (outside / "victim" / "config.json").write_text("{}")
    (data_dir / "models" / "link").symlink_to(outside / "deep")
    assert "no . or .." in bad_fields(data_dir, model=str(data_dir / "models/link/../victim"))["model"]
    (data_dir / "models" / "elsewhere").symlink_to(outside / "victim")
    assert "outside the folders" in bad_fields(data_dir, model=str(data_dir / "models/elsewhere"))["model"]
    assert "outside the folders" in bad_fields(data_dir, model="models/elsewhere")["model"]
    ok = validate_settings(full(data_dir, model=str(data_dir / "models/elsewhere")), data_dir, [outside])
    assert ok.model.endswith("elsewhere")  # its target's folder added as a root: allowed


def test_outside_the_roots_the_answer_does_not_depend_on_what_exists(data_dir: Path, tmp_path: Path) -> None:
    (tmp_path / "real").mkdir()
    (tmp_path / "real" / "config.json").write_text("{}")
    exists = bad_fields(data_dir, model=str(tmp_path / "real"))["model"]
    missing = bad_fields(data_dir, model=str(tmp_path / "nothing"))["model"]
    assert exists.replace("real", "X") == missing.replace("nothing", "X")


@pytest.mark.parametrize("model", ["/" + "a" * 300, "models/" + "b" * 256, "org/" + "c" * 300])
def test_a_path_part_too_long_for_the_filesystem_is_a_clear_refusal(data_dir: Path, model: str) -> None:
    assert "longer than 255" in bad_fields(data_dir, model=model)["model"]


@pytest.mark.parametrize("model", ["org/name\n", "org/na\x00me", "-org/name", "--trust-remote-code", "org\\name"])
def test_hub_ids_with_control_characters_dashes_or_backslashes_are_refused(data_dir: Path, model: str) -> None:
    assert "model" in bad_fields(data_dir, model=model.encode().decode("unicode_escape"))


@pytest.mark.parametrize("name", ["demo\n", "demo\r", "--trust-remote-code", "-x", "de mo", "d\x00"])
def test_served_names_vllm_would_misread_are_refused(data_dir: Path, name: str) -> None:
    assert "served_model_name" in bad_fields(data_dir, served_model_name=name.encode().decode("unicode_escape"))


class Flags:
    """The installed vLLM's flags as engine/serving/flags.py reads them (a fixed set here: vLLM 0.32's)."""

    error: str | None = None

    def get(self) -> dict[str, VllmFlag]:
        return {f.name: f for f in (VllmFlag("--seed", True), VllmFlag("--disable-log-stats", False),
                                    VllmFlag("--generation-config", True),
                                    VllmFlag("--scheduling-policy", True, ("fcfs", "priority")))}


def test_extra_flags_must_exist_in_the_installed_vllm_and_take_what_it_parses(data_dir: Path) -> None:
    def refused(*args: str) -> str:
        with pytest.raises(InvalidSettingsError) as info:
            validate_settings(full(data_dir, extra_args=list(args)), data_dir, flags=Flags())
        return str(info.value.errors[0]["msg"])

    ok = validate_settings(full(data_dir, extra_args=["--seed=3", "--scheduling-policy=priority"]), data_dir,
                           flags=Flags())
    assert ok.extra_args == ["--seed=3", "--scheduling-policy=priority"]
    assert "not a flag of the installed vLLM" in refused("--swap-space=4")  # allowed once, gone in 0.32
    assert "takes no value" in refused("--disable-log-stats=yes")
    assert "needs a value" in refused("--seed")
    assert "one of fcfs, priority" in refused("--scheduling-policy=lifo")
    assert "only auto or vllm" in refused("--generation-config=/outside")
    assert validate_settings(full(data_dir, extra_args=["--generation-config=vllm"]), data_dir, flags=Flags())


def test_without_the_installed_vllm_flags_no_extra_flag_is_accepted(data_dir: Path) -> None:
    class Broken:
        error: str | None = "no vLLM here"

        def get(self) -> None:
            return None

    with pytest.raises(InvalidSettingsError) as info:
        validate_settings(full(data_dir, extra_args=["--seed=3"]), data_dir, flags=Broken())
    assert "could not be read (no vLLM here)" in str(info.value.errors[0]["msg"])
    assert validate_settings(full(data_dir), data_dir, flags=Broken())  # no extra flags: nothing to check


def test_a_hub_id_shaped_path_means_the_same_to_validation_preflight_and_vllm(data_dir: Path, tmp_path: Path,
                                                                                monkeypatch: pytest.MonkeyPatch
                                                                                ) -> None:
    """Outside probe: ``evil/model`` (and ``engine/api``) passed as hub ids while vLLM loaded them relative to the
    engine's working directory. A relative value is read in the data dir by all three, vLLM included (it runs
    there), so a folder beside the engine is never a model; something under the data dir is a path, in the roots
    or refused."""
    from engine.capacity import find_model_config
    from engine.vllm import build_command

    beside = tmp_path / "cwd"
    (beside / "evil" / "model").mkdir(parents=True)
    (beside / "evil" / "model" / "config.json").write_text("{}")
    monkeypatch.chdir(beside)
    settings = validate_settings(full(data_dir, model="evil/model"), data_dir)  # a hub id: nothing in the data dir
    assert find_model_config("evil/model", data_dir) is None  # pre-flight does not read the folder beside us
    args = build_command(settings, python="/py", port=1, data_dir=data_dir, build="cpu")
    assert args[args.index("--model") + 1] == "evil/model"  # and vLLM, in the data dir, finds no folder of it
    (data_dir / "logs" / "x").mkdir(parents=True)  # anything under the data dir outside models/ is refused
    assert "outside the folders" in bad_fields(data_dir, model="logs/x")["model"]
    (data_dir / "escape").symlink_to(beside / "evil", target_is_directory=True)
    assert "outside the folders" in bad_fields(data_dir, model="escape/model")["model"]
