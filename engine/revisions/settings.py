"""vLLM settings: the fields of a revision, each documented once, and their validation.

A revision's values are an ``EngineSettings``. The ``description`` of each field is the one place its meaning
is written: the CLI's help and the console's help text are generated from it.
"""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Any

from pydantic import ConfigDict, ValidationError, ValidationInfo, field_validator

from engine.errors import InvalidSettingsError
from engine.schemas import SettingsValues

HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]{0,95}/[\w.-]{1,96}$")
SERVED_NAME = re.compile(r"^[\w.:/-]{1,128}$")

# Further vLLM flags an operator may pass through ``extra_args``. Flags that the fields above own, and flags
# that would read arbitrary files or open the network, are deliberately absent.
ALLOWED_EXTRA_FLAGS: frozenset[str] = frozenset(
    {
        "--seed",
        "--block-size",
        "--swap-space",
        "--max-logprobs",
        "--disable-log-stats",
        "--enable-log-requests",
        "--tokenizer-mode",
        "--generation-config",
        "--override-generation-config",
        "--disable-sliding-window",
        "--enable-chunked-prefill",
        "--no-enable-chunked-prefill",
        "--scheduling-policy",
        "--long-prefill-token-threshold",
        "--max-num-partial-prefills",
        "--max-long-partial-prefills",
        "--cpu-offload-gb",
        "--quantization",
        "--revision",
        "--reasoning-parser",
        "--enable-auto-tool-choice",
        "--tool-call-parser",
        "--uvicorn-log-level",
        "--max-parallel-loading-workers",
        "--async-scheduling",
        "--no-async-scheduling",
    }
)
_EXTRA_ARG = re.compile(r"^(--[a-z0-9][a-z0-9-]*)(?:=([^\x00-\x1f]{0,256}))?$")


class EngineSettings(SettingsValues):
    """A revision's values as the engine validates them: the fields of SettingsValues (engine/schemas), and what
    needs this host to check (model folders and their roots, names vLLM is given, its extra flags)."""

    model_config = ConfigDict(extra="forbid", validate_default=False, protected_namespaces=())

    @field_validator("model")
    @classmethod
    def _model_exists(cls, value: str, info: ValidationInfo) -> str:
        context = info.context or {}
        data_dir = context.get("data_dir")
        if resolve_local_model(value, data_dir) is not None:
            roots = context.get("model_roots")  # given by validate_settings, which every write goes through
            where = model_path(value, data_dir)
            if roots is not None and not any(where == root or root in where.parents for root in roots):
                raise ValueError(f"{value!r} is outside the folders models may come from "
                                 f"({', '.join(map(str, roots))}); add one with LLMOPS_MODEL_ROOTS")
            return value
        if any(part in (".", "..") for part in value.split("/")):
            raise ValueError(f"{value!r}: no . or .. in a hub id")
        if value.startswith(("/", ".", "~")) or "\\" in value:
            raise ValueError(f"no model folder with a config.json at {value!r}")
        if not HUB_ID.match(value):
            raise ValueError(
                f"{value!r} is neither a local model folder (with config.json) nor a hub id like org/name"
            )
        return value

    @field_validator("served_model_name")
    @classmethod
    def _served_name(cls, value: str) -> str:
        if not SERVED_NAME.match(value):
            raise ValueError("use 1-128 letters, digits and . _ : / -")
        return value

    @field_validator("extra_args")
    @classmethod
    def _extra_args(cls, value: list[str]) -> list[str]:
        for arg in value:
            m = _EXTRA_ARG.match(arg)
            if not m:
                raise ValueError(f"{arg!r} is not of the form --flag or --flag=value")
            if m.group(1) not in ALLOWED_EXTRA_FLAGS:
                raise ValueError(
                    f"{m.group(1)} is not allowed; allowed flags: {', '.join(sorted(ALLOWED_EXTRA_FLAGS))}"
                )
        return value


FIELD_NAMES: tuple[str, ...] = tuple(EngineSettings.model_fields)


def field_help(name: str) -> str:
    """The one documentation string of a settings field."""
    return EngineSettings.model_fields[name].description or ""


def resolve_local_model(value: str, data_dir: Path | str | None) -> Path | None:
    """The local folder ``value`` names, if it holds a config.json; else None (a hub id, or missing)."""
    candidates = [Path(value).expanduser()]
    if data_dir is not None and not Path(value).is_absolute():
        candidates.insert(0, Path(data_dir) / value)
    for path in candidates:
        if (path / "config.json").is_file():
            return path.resolve()
    return None


def names_local_path(value: str) -> bool:
    """Whether a model value names a folder on this machine (absolute, or ./ ../ ~), not a hub id."""
    return value.startswith(("/", "./", "../", "~"))


def hf_home() -> Path:
    """Hugging Face's folder, found as huggingface_hub finds it: HF_HOME, else $XDG_CACHE_HOME/huggingface
    (default ~/.cache/huggingface)."""
    home = os.environ.get("HF_HOME") or Path(os.environ.get("XDG_CACHE_HOME") or "~/.cache") / "huggingface"
    return Path(home).expanduser()


def hf_hub_cache() -> Path:
    """Where vLLM's hub downloads land: HF_HUB_CACHE, else HF_HOME/hub."""
    cache = os.environ.get("HF_HUB_CACHE")
    return Path(cache).expanduser() if cache else hf_home() / "hub"


def default_model_roots(data_dir: Path | str | None) -> list[Path]:
    roots = [Path(os.path.normpath(p.absolute())) for p in (hf_home(), hf_hub_cache())]
    if data_dir is not None:
        roots.insert(0, Path(os.path.normpath(Path(data_dir).absolute() / "models")))
    return roots


def model_path(value: str, data_dir: Path | str | None) -> Path:
    """Where a local model value points, normalised but with links not followed (a link an operator placed in
    an allowed folder is allowed; a ../ escape is not)."""
    path = Path(value).expanduser()
    if not path.is_absolute() and data_dir is not None and (Path(data_dir) / value / "config.json").is_file():
        path = Path(data_dir) / value
    return Path(os.path.normpath(path.absolute()))


def validate_settings(values: dict[str, Any], data_dir: Path | None,
                      model_roots: list[Path] | None = None) -> EngineSettings:
    """Validate full values; raise InvalidSettingsError naming each bad field (loc ["body","values",field]).

    Local models must lie under ``model_roots`` (default: DATA_DIR/models and the Hugging Face cache)."""
    roots = [Path(os.path.normpath(Path(r).absolute())) for r in (model_roots or [])] + default_model_roots(data_dir)
    try:
        return EngineSettings.model_validate(values, context={"data_dir": data_dir, "model_roots": roots})
    except ValidationError as exc:
        errors: list[dict[str, object]] = []
        for err in exc.errors(include_url=False):
            errors.append(
                {
                    "type": err["type"],
                    "loc": ["body", "values", *err["loc"]],
                    "msg": err["msg"].removeprefix("Value error, "),
                    "input": _jsonable(err.get("input")),
                }
            )
        raise InvalidSettingsError(errors) from None


def merge_values(base: dict[str, Any], changes: dict[str, Any]) -> dict[str, Any]:
    """Partial write: fields omitted from ``changes`` keep the base revision's values."""
    merged = dict(base)
    merged.update(changes)
    return merged


def initial_settings(data_dir: Path) -> dict[str, Any]:
    """Values of revision 1 on a fresh data dir: the demo model, sized for a small CPU or one GPU."""
    return {
        "model": os.path.abspath(data_dir / "models" / "demo"),  # not resolved: a link placed there stays inside
        "served_model_name": "demo",
        "max_model_len": 2048,
        "max_num_seqs": 16,
        "cpu_kv_cache_gib": 0.5,
    }


def _jsonable(value: object) -> object:
    if value is None or isinstance(value, str | int | float | bool):
        return value
    if isinstance(value, list | tuple):
        return [_jsonable(v) for v in value]
    if isinstance(value, dict):
        return {str(k): _jsonable(v) for k, v in value.items()}
    return repr(value)
