"""Saved prompts of the playground."""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field


class PromptParams(BaseModel):
    """The sampling parameters a saved prompt keeps (each bounded: a saved prompt is read by everyone)."""

    model_config = ConfigDict(extra="forbid", populate_by_name=True)

    temperature: float | None = Field(None, ge=0, le=2)
    top_p: float | None = Field(None, gt=0, le=1)
    max_tokens: int | None = Field(None, ge=1, le=1_000_000)
    stop: list[Annotated[str, Field(min_length=1, max_length=200)]] | None = Field(None, max_length=8)
    format: Literal["Text", "JSON object", "JSON schema"] | None = None
    schema_: str | None = Field(None, alias="schema", max_length=20_000, description="JSON schema of a JSON reply")


class PromptIn(BaseModel):
    model_config = ConfigDict(strict=True)

    name: str = Field(min_length=1, max_length=200)
    mode: Literal["chat", "completion"] = "chat"
    system: str = Field("", max_length=20_000)
    prompt: str = Field(min_length=1, max_length=200_000)
    params: PromptParams = Field(default_factory=PromptParams, description="temperature, top_p, max_tokens, stop")


class PromptOut(PromptIn):
    id: int
    author: str
    created_at: float
