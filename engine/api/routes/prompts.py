"""Saved prompts of the playground, kept in the engine's database so a team shares them."""

from __future__ import annotations

from fastapi import APIRouter, HTTPException, Request, Response
from fastapi import Path as PathParam

from engine.api.deps import NoteDep, PromptsDep, access, actor
from engine.db import SavedPrompt
from engine.schemas import MAX_ID, PromptIn, PromptOut, PromptParams

router = APIRouter(tags=["playground"])


def prompt_out(p: SavedPrompt) -> PromptOut:
    """A stored prompt; params saved before they were bounded keep only what the schema allows."""
    assert p.id is not None
    raw = p.params if isinstance(p.params, dict) else {}
    try:
        params = PromptParams.model_validate(raw)
    except ValueError:
        params = PromptParams()  # one malformed row must not break the list for everyone
    return PromptOut(id=p.id, name=p.name, mode=p.mode, system=p.system, prompt=p.prompt,  # type: ignore[arg-type]
                     params=params, author=p.author, created_at=p.created_at)


@router.get("/api/prompts", response_model=list[PromptOut], dependencies=access("prompter"))
def list_prompts(prompts: PromptsDep) -> list[PromptOut]:
    return [prompt_out(p) for p in prompts.prompts()]


@router.post("/api/prompts", status_code=201, response_model=PromptOut, dependencies=access("prompter", "prompts.save"))
def save_prompt(body: PromptIn, request: Request, prompts: PromptsDep, note: NoteDep) -> PromptOut:
    saved = prompts.save_prompt(SavedPrompt(name=body.name, mode=body.mode, system=body.system, prompt=body.prompt,
                                            params=body.params.model_dump(by_alias=True, exclude_none=True),
                                            author=actor(request)))
    note.target, note.after = f"prompt {saved.id}", {"name": body.name, "mode": body.mode}
    return prompt_out(saved)


@router.delete("/api/prompts/{prompt_id}", status_code=204, response_class=Response,
               dependencies=access("prompter", "prompts.delete"))
def delete_prompt(prompts: PromptsDep, note: NoteDep, prompt_id: int = PathParam(ge=1, le=MAX_ID)) -> Response:
    note.target = f"prompt {prompt_id}"
    if not prompts.delete_prompt(prompt_id):
        raise HTTPException(404, detail=f"no saved prompt {prompt_id}")
    return Response(status_code=204)
