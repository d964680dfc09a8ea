"""Saved prompts of the playground."""

from __future__ import annotations

from engine.prompts.store import PromptStore

__all__ = ["PromptStore"]
