"""Where a revision's model comes from: a local folder under an allowed root, or a hub id.

One decision for every use (the write's validation, pre-flight's capacity check, the vLLM command): a value is a
local folder if it is absolute (or ./ ../ ~) or names something under the data dir, else a hub id. A relative value
is read relative to the data dir, never the engine's working directory, and vLLM runs with the data dir as its
working directory, so ``org/name`` means the same folder (or the same hub id) to all three.

A local model is allowed by where it *resolves* to, links followed: ``models/link/../victim`` with ``link`` a
symlink, or a link placed in an allowed folder that points elsewhere, is outside the roots unless its target is
inside one (add the target with ``LLMOPS_MODEL_ROOTS``). The roots are checked before anything about the path is
looked at, so an answer never tells whether a folder exists outside them.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

from engine.errors import EngineError

HUB_ID = re.compile(r"[A-Za-z0-9][\w.-]{0,95}/[\w.-]{1,96}")  # matched with fullmatch: no trailing newline
_CONTROL = re.compile(r"[\x00-\x1f\x7f]")
NAME_MAX = 255  # bytes of one path component on Linux filesystems
PATH_MAX = 4096


class ModelPathError(EngineError, ValueError):
    """A model value that names no usable model; the message says why and what to do."""


def hf_home() -> Path:
    """Hugging Face's folder, found as huggingface_hub finds it: HF_HOME, else $XDG_CACHE_HOME/huggingface
    (default ~/.cache/huggingface)."""
    home = os.environ.get("HF_HOME") or Path(os.environ.get("XDG_CACHE_HOME") or "~/.cache") / "huggingface"
    return Path(home).expanduser()


def hf_hub_cache() -> Path:
    """Where vLLM's hub downloads land: HF_HUB_CACHE, else HF_HOME/hub."""
    cache = os.environ.get("HF_HUB_CACHE")
    return Path(cache).expanduser() if cache else hf_home() / "hub"


def _resolved(path: Path) -> Path:
    try:
        return path.expanduser().resolve()
    except OSError as exc:  # a component too long, no permission
        raise ModelPathError(f"{str(path)[:200]!r} cannot be resolved: {exc.strerror or exc}") from None
    except RuntimeError:  # a link loop
        raise ModelPathError(f"{str(path)[:200]!r} cannot be resolved: its links loop") from None


def default_model_roots(data_dir: Path | str | None) -> list[Path]:
    """DATA_DIR/models and the Hugging Face cache, resolved."""
    roots = [hf_home(), hf_hub_cache()]
    if data_dir is not None:
        roots.insert(0, Path(data_dir) / "models")
    return [_resolved(Path(os.path.abspath(r))) for r in roots]


def allowed_roots(data_dir: Path | str | None, extra: list[Path] | None = None) -> list[Path]:
    """Every folder local models may come from, resolved: ``extra`` (LLMOPS_MODEL_ROOTS) and the defaults."""
    return [_resolved(Path(os.path.abspath(r))) for r in (extra or [])] + default_model_roots(data_dir)


def names_local_path(value: str) -> bool:
    """Whether a model value names a folder on this machine (absolute, or ./ ~), not a hub id."""
    return value.startswith(("/", "./", "../", "~"))


def check_form(value: str) -> None:
    """What no model value may hold, local or hub: control characters, backslashes, . or .. segments, a leading
    '-' (it would read as a flag), components longer than the filesystem allows."""
    if _CONTROL.search(value):
        raise ModelPathError(f"{value[:200]!r} holds a control character")
    if value.startswith("-"):
        raise ModelPathError(f"{value[:200]!r} starts with '-'")
    if "\\" in value:
        raise ModelPathError(f"{value[:200]!r}: use / between folders, not \\")
    parts = value.removeprefix("./").split("/")
    if any(part in (".", "..") for part in parts):
        raise ModelPathError(f"{value[:200]!r}: no . or .. segments in a model path or hub id")
    if len(value.encode()) > PATH_MAX or any(len(p.encode()) > NAME_MAX for p in parts):
        raise ModelPathError(f"{value[:200]!r}…: a folder name is longer than {NAME_MAX} bytes")


def _candidate(value: str, data_dir: Path | str | None) -> Path:
    """The folder a local value points at, links not yet followed: absolute or ~ as given, relative ones under the
    data dir (never the engine's working directory)."""
    path = Path(value).expanduser()
    if path.is_absolute() or data_dir is None:
        return Path(os.path.abspath(path))
    return Path(os.path.abspath(Path(data_dir) / value.removeprefix("./")))


def _inside(path: Path, roots: list[Path]) -> bool:
    return any(path == root or root in path.parents for root in roots)


def locate_model(value: str, data_dir: Path | str | None, roots: list[Path] | None) -> Path | None:
    """The resolved local folder ``value`` names (under ``roots``, with a config.json), or None for a hub id;
    ModelPathError saying why otherwise. ``roots=None``: any folder (callers that have no roots to apply)."""
    check_form(value)
    local = names_local_path(value)
    where = _resolved(_candidate(value, data_dir))
    if roots is not None and not _inside(where, roots):
        # a relative value that names anything under the data dir (a link in models/ to elsewhere) is that path,
        # not a hub id of the same spelling: vLLM runs in the data dir and would read it there (it takes an
        # existing path for a local model); looking is safe there: no .. can leave the data dir
        if local or os.path.lexists(_candidate(value, data_dir)):
            raise ModelPathError(f"{value!r} is outside the folders models may come from "
                                 f"({', '.join(map(str, roots or []))}); add one with LLMOPS_MODEL_ROOTS")
    elif (where / "config.json").is_file():
        return where
    elif local:
        raise ModelPathError(f"no model folder with a config.json at {value!r}")
    if not HUB_ID.fullmatch(value):
        where_to = f" under {', '.join(map(str, roots))}" if roots else ""
        raise ModelPathError(f"{value!r} is neither a local model folder (with config.json){where_to} nor a hub "
                             "id like org/name")
    return None


def resolve_local_model(value: str, data_dir: Path | str | None) -> Path | None:
    """The resolved local folder ``value`` names if it holds a config.json; else None (a hub id, missing, or a
    value no folder can have). Validation (``locate_model``) has already kept it inside the roots."""
    try:
        check_form(value)
        where = _resolved(_candidate(value, data_dir))
        return where if (where / "config.json").is_file() else None
    except (ModelPathError, OSError):
        return None


def model_path(value: str, data_dir: Path | str | None) -> Path:
    """Where a local model value points, for messages: absolute, links not followed."""
    return _candidate(value, data_dir)
