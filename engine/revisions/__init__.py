"""Settings revisions: the fields of a revision, each documented once, their validation, where models may come
from, and the store and use case that write them."""

from __future__ import annotations

from engine.revisions.models import (
    HUB_ID,
    ModelPathError,
    allowed_roots,
    check_form,
    default_model_roots,
    hf_home,
    hf_hub_cache,
    locate_model,
    model_path,
    names_local_path,
    resolve_local_model,
)
from engine.revisions.scope import DeploymentRef
from engine.revisions.service import Change, Checker, SettingsWriter
from engine.revisions.settings import (
    ALLOWED_EXTRA_FLAGS,
    FIELD_NAMES,
    EngineSettings,
    FlagSource,
    VllmFlag,
    field_help,
    initial_settings,
    merge_values,
    validate_settings,
)
from engine.revisions.store import RevisionStore

__all__ = [
    "ALLOWED_EXTRA_FLAGS",
    "FIELD_NAMES",
    "HUB_ID",
    "Change",
    "Checker",
    "DeploymentRef",
    "EngineSettings",
    "FlagSource",
    "ModelPathError",
    "RevisionStore",
    "SettingsWriter",
    "VllmFlag",
    "allowed_roots",
    "check_form",
    "default_model_roots",
    "field_help",
    "hf_home",
    "hf_hub_cache",
    "initial_settings",
    "locate_model",
    "merge_values",
    "model_path",
    "names_local_path",
    "resolve_local_model",
    "validate_settings",
]
