"""Saved prompts of the playground, kept in the engine's database so a team shares them. The list comes a page
at a time; a prompt is bounded in size (prompt_max_chars) and each user in how many they keep (prompts_per_user);
only its author, or an operator or admin, may delete one."""

from __future__ import annotations

from fastapi import APIRouter, HTTPException, Query, Request, Response
from fastapi import Path as PathParam

from engine.access import allows
from engine.api.deps import NoteDep, PrincipalDep, PromptsDep, ServicesDep, access, actor
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
def list_prompts(prompts: PromptsDep, limit: int = Query(50, ge=1, le=100, description="prompts in this page"),
                 before: int | None = Query(None, ge=1, le=MAX_ID, description="only prompts with a smaller id: "
                                            "the next page starts before the last id of this one")) -> list[PromptOut]:
    """Saved prompts, newest first, a page at a time."""
    return [prompt_out(p) for p in prompts.prompts(limit, before)]


@router.post("/api/prompts", status_code=201, response_model=PromptOut, dependencies=access("prompter", "prompts.save"))
def save_prompt(body: PromptIn, request: Request, prompts: PromptsDep, svc: ServicesDep, note: NoteDep) -> PromptOut:
    """Save a prompt for the team: refused with 422 when it is larger than prompt_max_chars (system prompt, prompt
    and JSON schema together), with 409 when its author already keeps prompts_per_user."""
    limit = svc.config.prompt_max_chars
    size = len(body.system) + len(body.prompt) + len(body.params.schema_ or "")
    if size > limit:
        raise HTTPException(422, detail=[{"type": "too_long", "loc": ["body", "prompt"],
                                          "msg": f"the prompt, system prompt and JSON schema come to {size:,} "
                                          f"characters; a saved prompt holds at most {limit:,} (prompt_max_chars)"}])
    author = actor(request)
    most = svc.config.prompts_per_user
    if prompts.count_by(author) >= most:
        raise HTTPException(409, detail=f"{author} keeps {most} saved prompts, the most one user may "
                            "(prompts_per_user): delete one of them first")
    saved = prompts.save_prompt(SavedPrompt(name=body.name, mode=body.mode, system=body.system, prompt=body.prompt,
                                            params=body.params.model_dump(by_alias=True, exclude_none=True),
                                            author=author))
    note.target, note.after = f"prompt {saved.id}", {"name": body.name, "mode": body.mode}
    return prompt_out(saved)


@router.delete("/api/prompts/{prompt_id}", status_code=204, response_class=Response,
               dependencies=access("prompter", "prompts.delete"))
def delete_prompt(prompts: PromptsDep, note: NoteDep, principal: PrincipalDep,
                  prompt_id: int = PathParam(ge=1, le=MAX_ID)) -> Response:
    """Delete a saved prompt: its author may, and an operator or admin; anyone else gets 403."""
    note.target = f"prompt {prompt_id}"
    found = prompts.get(prompt_id)
    if found is None:
        raise HTTPException(404, detail=f"no saved prompt {prompt_id}")
    if found.author != principal.name and not allows(principal.role, "operator"):
        raise HTTPException(403, detail=f"prompt {prompt_id} is {found.author}'s: only its author or an operator "
                            "may delete it")
    note.before = {"name": found.name, "author": found.author}
    prompts.delete_prompt(prompt_id)
    return Response(status_code=204)
