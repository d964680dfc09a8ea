"""vLLM settings: the fields of a revision, each documented once, and their validation.

A revision's values are an ``EngineSettings``. The ``description`` of each field is the one place its meaning
is written: the CLI's help and the console's help text are generated from it.
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

from pydantic import ConfigDict, ValidationError, ValidationInfo, field_validator

from engine.errors import InvalidSettingsError
from engine.revisions.models import ModelPathError, allowed_roots, locate_model
from engine.schemas import SettingsValues

LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)  # vLLM's --max-lora-rank choices
SERVED_NAME = re.compile(r"[\w.:/-]{1,128}")  # fullmatch: "demo\n" is not "demo"

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
        # CUDA graphs for batches up to this many tokens (vLLM's default: 2 x max_num_seqs, at most 512): a restart
        # with a smaller max_num_seqs can ask for the graphs of a larger one (docs/gpu-validation.md, 2026-12-04)
        "--max-cudagraph-capture-size",
        # tokens a streamed event carries (vLLM's default 1): N cuts the events a stream takes, and with them the CPU
        # of vLLM's API server and of any relay in front of it, about N-fold per token; clients get N tokens at a
        # time (docs/benchmarks.md, "Fewer events per token")
        "--stream-interval",
    }
)
_EXTRA_ARG = re.compile(r"(--[a-z0-9][a-z0-9-]*)(?:=([^\x00-\x1f\x7f]{1,256}))?")  # fullmatch
# flags whose other values name files: only these values are accepted
EXTRA_VALUES: dict[str, tuple[str, ...]] = {"--generation-config": ("auto", "vllm")}
# flags the engine reads itself: a whole number in this range (the gateway meters a cut stream by them)
EXTRA_INTS: dict[str, tuple[int, int]] = {"--stream-interval": (1, 1024)}


@dataclass(frozen=True)
class VllmFlag:
    """One option of the installed vLLM's API server, as its argument parser declares it."""

    name: str
    takes_value: bool
    choices: tuple[str, ...] | None = None


class EngineSettings(SettingsValues):
    """A revision's values as the engine validates them: the fields of SettingsValues (engine/schemas), and what
    needs this host to check (model folders and their roots, names vLLM is given, its extra flags)."""

    model_config = ConfigDict(extra="forbid", validate_default=False, protected_namespaces=())

    @property
    def tokens_per_event(self) -> int:
        """Tokens one event of a stream carries at most (vLLM's --stream-interval; 1 unless extra_args sets it)."""
        for arg in reversed(self.extra_args):  # (the last one given wins, as in vLLM's parser)
            flag, _, value = arg.partition("=")
            if flag == "--stream-interval" and value.isascii() and value.isdigit():
                return max(1, int(value))
        return 1

    @field_validator("model")
    @classmethod
    def _model_allowed(cls, value: str, info: ValidationInfo) -> str:
        context = info.context or {}
        # the roots are given by validate_settings, which every write (and every start) goes through
        locate_model(value, context.get("data_dir"), context.get("model_roots"))
        return value

    @field_validator("max_num_seqs_ceiling")
    @classmethod
    def _ceiling(cls, value: int | None, info: ValidationInfo) -> int | None:
        below = info.data.get("max_num_seqs")
        if value is not None and isinstance(below, int) and value < below:
            raise ValueError(f"must be at least max_num_seqs ({below}): it is what vLLM is started with, and the "
                             "gateway holds each instance to max_num_seqs below it")
        return value

    @field_validator("max_replicas")
    @classmethod
    def _max_replicas(cls, value: int | None, info: ValidationInfo) -> int | None:
        least = info.data.get("min_replicas")
        if value is not None and isinstance(least, int) and value < least:
            raise ValueError(f"must be at least min_replicas ({least})")
        return value

    @field_validator("max_lora_rank")
    @classmethod
    def _lora_rank(cls, value: int) -> int:
        if value not in LORA_RANKS:
            raise ValueError(f"one of {', '.join(map(str, LORA_RANKS))} (the ranks vLLM serves)")
        return value

    @field_validator("max_cpu_loras")
    @classmethod
    def _cpu_loras(cls, value: int | None, info: ValidationInfo) -> int | None:
        slots = info.data.get("max_loras")
        if value is not None and isinstance(slots, int) and value < slots:
            raise ValueError(f"must be at least max_loras ({slots}): vLLM keeps every adapter of a batch in host "
                             "memory too")
        return value

    @field_validator("served_model_name")
    @classmethod
    def _served_name(cls, value: str) -> str:
        if not SERVED_NAME.fullmatch(value) or value.startswith("-"):
            raise ValueError("use 1-128 letters, digits and . _ : / -, not starting with -")
        return value

    @field_validator("extra_args")
    @classmethod
    def _extra_args(cls, value: list[str], info: ValidationInfo) -> list[str]:
        context = info.context or {}
        flags: Mapping[str, VllmFlag] | None = context.get("vllm_flags")
        if value and "vllm_flags" in context and flags is None:
            raise ValueError(f"the installed vLLM's flags could not be read ({context.get('vllm_flags_error')}): "
                             "extra flags cannot be checked, so none are accepted")
        allowed = sorted(ALLOWED_EXTRA_FLAGS if flags is None else ALLOWED_EXTRA_FLAGS & flags.keys())
        for arg in value:
            m = _EXTRA_ARG.fullmatch(arg)
            if not m:
                raise ValueError(f"{arg[:100]!r} is not of the form --flag or --flag=value")
            name, given = m.group(1), m.group(2)
            if name not in allowed:
                missing = flags is not None and name in ALLOWED_EXTRA_FLAGS
                raise ValueError(f"{name} is {'not a flag of the installed vLLM' if missing else 'not allowed'}; "
                                 f"allowed flags: {', '.join(allowed)}")
            flag = flags.get(name) if flags is not None else None
            if flag is not None and not flag.takes_value and given is not None:
                raise ValueError(f"{name} takes no value")
            if flag is not None and flag.takes_value and given is None:
                raise ValueError(f"{name} needs a value: {name}=VALUE")
            if flag is not None and flag.choices and given is not None and given not in flag.choices:
                raise ValueError(f"{name}={given[:60]}: one of {', '.join(flag.choices)}")
            if name in EXTRA_INTS:
                low, high = EXTRA_INTS[name]
                if given is None or not given.isascii() or not given.isdigit() or not low <= int(given) <= high:
                    raise ValueError(f"{name}={str(given)[:60]}: a whole number from {low} to {high}")
            if name in EXTRA_VALUES and given not in EXTRA_VALUES[name]:
                raise ValueError(f"{name}={str(given)[:60]}: only {' or '.join(EXTRA_VALUES[name])} (a folder "
                                 "would be read from outside the model roots)")
        return value


FIELD_NAMES: tuple[str, ...] = tuple(EngineSettings.model_fields)


def field_help(name: str) -> str:
    """The one documentation string of a settings field."""
    return EngineSettings.model_fields[name].description or ""


class FlagSource(Protocol):
    """The installed vLLM's flags (engine/serving/flags.py); ``get`` may take seconds the first time."""

    error: str | None

    def get(self) -> Mapping[str, VllmFlag] | None: ...


def validate_settings(values: dict[str, Any], data_dir: Path | None, model_roots: list[Path] | None = None,
                      flags: FlagSource | None = None) -> EngineSettings:
    """Validate full values; raise InvalidSettingsError naming each bad field (loc ["body","values",field]).

    Local models must lie under ``model_roots`` (besides DATA_DIR/models and the Hugging Face cache); extra flags
    must be allowed and known to the installed vLLM (``flags``; read only when there are extra flags)."""
    context: dict[str, Any] = {"data_dir": data_dir}
    if flags is not None and values.get("extra_args"):
        context.update(vllm_flags=flags.get(), vllm_flags_error=flags.error)
    try:
        roots = allowed_roots(data_dir, model_roots)
    except ModelPathError as exc:
        raise InvalidSettingsError([{"type": "value_error", "loc": ["body", "values", "model"], "msg": str(exc),
                                     "input": None}]) from None
    try:
        return EngineSettings.model_validate(values, context={**context, "model_roots": roots})
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
