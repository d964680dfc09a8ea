"""Saved prompts of the playground, kept in the engine's database so a team shares them."""

from __future__ import annotations

from typing import Any, Literal

from fastapi import APIRouter, HTTPException, Request
from fastapi import Path as PathParam
from pydantic import BaseModel, ConfigDict, Field

from engine.api.routes.access import actor
from engine.db import SavedPrompt, Store
from engine.errors import MAX_ID


class PromptIn(BaseModel):
    model_config = ConfigDict(strict=True)  # a JSON 0 is not false, nor "1" a number

    name: str = Field(min_length=1, max_length=200)
    mode: Literal["chat", "completion"] = "chat"
    system: str = Field("", max_length=20_000)
    prompt: str = Field(min_length=1, max_length=200_000)
    params: dict[str, Any] = Field(default_factory=dict, description="temperature, top_p, max_tokens, stop")


class PromptOut(PromptIn):
    id: int
    author: str
    created_at: float


def build_router(store: Store) -> APIRouter:
    router = APIRouter(tags=["playground"])

    def out(p: SavedPrompt) -> PromptOut:
        assert p.id is not None
        return PromptOut(id=p.id, name=p.name, mode=p.mode, system=p.system, prompt=p.prompt,  # type: ignore[arg-type]
                         params=p.params, author=p.author, created_at=p.created_at)

    @router.get("/api/prompts")
    def list_prompts() -> list[PromptOut]:
        return [out(p) for p in store.prompts()]

    @router.post("/api/prompts", status_code=201)
    def save_prompt(body: PromptIn, request: Request) -> PromptOut:
        return out(store.save_prompt(SavedPrompt(**body.model_dump(), author=actor(request))))

    @router.delete("/api/prompts/{prompt_id}", status_code=204)
    def delete_prompt(prompt_id: int = PathParam(ge=1, le=MAX_ID)) -> None:
        if not store.delete_prompt(prompt_id):
            raise HTTPException(404, detail=f"no saved prompt {prompt_id}")

    return router
