"""Settings revisions: the fields of a revision, each documented once, and their validation."""

from __future__ import annotations

from engine.revisions.service import Change, Checker, SettingsWriter
from engine.revisions.settings import (
    ALLOWED_EXTRA_FLAGS,
    FIELD_NAMES,
    EngineSettings,
    default_model_roots,
    field_help,
    hf_home,
    hf_hub_cache,
    initial_settings,
    merge_values,
    model_path,
    names_local_path,
    resolve_local_model,
    validate_settings,
)
from engine.revisions.store import RevisionStore

__all__ = [
    "ALLOWED_EXTRA_FLAGS",
    "FIELD_NAMES",
    "Change",
    "Checker",
    "EngineSettings",
    "RevisionStore",
    "SettingsWriter",
    "default_model_roots",
    "field_help",
    "hf_home",
    "hf_hub_cache",
    "initial_settings",
    "merge_values",
    "model_path",
    "names_local_path",
    "resolve_local_model",
    "validate_settings",
]
