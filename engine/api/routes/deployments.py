"""Deployments: list, create (from a model in the roots or the Hugging Face cache), enable or disable, place,
delete. Each deployment's own routes (settings, status, events, logs, serving, benchmarks) are today's routes under
``/api/deployments/{name}/…`` (engine/api/__init__.py mounts them); today's ``/api/…`` act on the default one."""

from __future__ import annotations

import json
import time
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import anyio.from_thread
import anyio.to_thread
from fastapi import APIRouter, HTTPException, Query, Request
from fastapi import Path as PathParam

from engine.access import skeleton
from engine.api.deps import DeploymentsDep, FleetDep, NoteDep, ServicesDep, access, actor, admin_for_remote_code
from engine.capacity import find_model_config, load_shape
from engine.db import Deployment
from engine.deployments import DeploymentError, DeploymentExistsError, DeploymentNotFoundError, Fleet, Runtime
from engine.errors import PreflightError
from engine.revisions import DeploymentRef, EngineSettings, allowed_roots, hf_hub_cache, initial_settings, merge_values
from engine.schemas import (
    AdapterIn,
    AdapterOut,
    AvailableModel,
    CreatedDeploymentOut,
    DeletionOut,
    DeploymentIn,
    DeploymentMemory,
    DeploymentOut,
    DeploymentPatch,
    FleetOut,
    ModelsListOut,
    OkOut,
)

router = APIRouter(tags=["deployments"])
NAME_PATH = PathParam(min_length=1, max_length=128)
MODELS_LISTED = 200  # folders and cache entries looked at: a root with thousands of folders is not walked whole


def _when(ts: float) -> datetime:
    return datetime.fromtimestamp(ts, UTC)


def memory_of(fleet: Fleet, runtime: Runtime) -> list[DeploymentMemory]:
    """What its instances hold now, from the sampler's latest reading (NVML per GPU; the host's RSS)."""
    snap = fleet.planner.sampler.latest
    if fleet.planner.build == "cuda":
        out = []
        for gpu in snap.gpus:
            held = sum(int(p.get("used_memory") or 0) for p in gpu.processes if p.get("deployment") == runtime.name)
            if held:
                out.append(DeploymentMemory(device=str(gpu.index), bytes=held))
        return out
    held = int((snap.host or {}).get("vllm_rss_by_deployment", {}).get(runtime.name, 0))
    return [DeploymentMemory(device="host", bytes=held)] if held else []


def deployment_out(fleet: Fleet, runtime: Runtime, row: Deployment | None = None) -> DeploymentOut:
    """``row``: the table's row just written, when the registry has not taken it over yet."""
    sup, row = runtime.controller, row or runtime.row
    desired = runtime.revisions.desired_revision()
    assert row.id is not None
    return DeploymentOut(
        id=row.id, name=runtime.name, default=runtime.ref.default, enabled=row.enabled,
        gpus=list(row.gpus) if row.gpus else None, created_at=_when(row.created_at), created_by=row.created_by,
        note=row.note, state=sup.sm.state, reason=sup.sm.reason,
        model=str(desired.values.get("model")) if desired is not None else None,
        running_revision=sup.running.id if sup.running else None,
        desired_revision=desired.id if desired is not None else None,
        instances=len(sup.instances), serving=sum(1 for i in sup.instances if i.serving),
        memory=memory_of(fleet, runtime), price_input_per_1k=row.price_input_per_1k,
        price_output_per_1k=row.price_output_per_1k)


def _runtime(fleet: Fleet, name: str) -> Runtime:
    """The deployment a path names: by name, or by id (a name with a / in it is reached by its id)."""
    try:
        return fleet.get(name)
    except DeploymentNotFoundError as exc:
        raise HTTPException(404, detail=str(exc)) from None


def _check_gpus(svc: ServicesDep, gpus: list[int] | None) -> None:
    if gpus is None:
        return
    snap = svc.sampler.latest
    present = {g.index for g in snap.gpus}
    if len(set(gpus)) != len(gpus):
        raise HTTPException(422, detail=[{"loc": ["body", "gpus"], "msg": "a GPU is named twice",
                                          "type": "value_error"}])
    if svc.build != "cuda" or not present:
        raise HTTPException(422, detail=[{"loc": ["body", "gpus"], "msg": "this host has no GPU to place a "
                                          "deployment on (the CPU build): leave gpus out", "type": "value_error"}])
    missing = sorted(set(gpus) - present)
    if missing:
        raise HTTPException(422, detail=[{"loc": ["body", "gpus"], "msg": f"no GPU {missing[0]} on this host "
                                          f"(GPUs: {', '.join(map(str, sorted(present)))})", "type": "value_error"}])


@router.get("/api/deployments", response_model=list[DeploymentOut], dependencies=access("viewer"))
def deployments(fleet: FleetDep, store: DeploymentsDep) -> list[DeploymentOut]:
    """Every deployment, with its state, revisions, instances and the memory they hold; enabled and placed as its
    row says now (a change just written shows at once, before the registry takes it over within a second)."""
    rows = {row.id: row for row in store.all()}
    return [deployment_out(fleet, r, rows.get(r.ref.id)) for r in sorted(fleet.runtimes.values(),
                                                                         key=lambda r: r.ref.id)]


@router.post("/api/deployments", status_code=201, response_model=CreatedDeploymentOut,
             dependencies=access("operator", "deployments.create"))
def create(body: DeploymentIn, request: Request, svc: ServicesDep, fleet: FleetDep, store: DeploymentsDep,
           note: NoteDep) -> CreatedDeploymentOut:
    """A new deployment serving ``values.model`` under ``name``: validated and pre-flighted like a settings write,
    packed beside the deployments already on the host (what they reserve is not its to take)."""
    request.state.deployment = body.name
    note.target = f"deployment {body.name}"
    admin_for_remote_code(request, dict(body.values))
    if "model" not in body.values:
        raise HTTPException(422, detail=[{"loc": ["body", "values", "model"], "msg": "a deployment needs a model",
                                          "type": "missing"}])
    if any(r.name == body.name or body.name in r.controller.served_names() for r in fleet.runtimes.values()):
        raise HTTPException(409, detail=f"a deployment named {body.name!r} exists")
    alike = next((r.name for r in fleet.runtimes.values() if skeleton(r.name) == skeleton(body.name)), None)
    if alike is not None:  # dem0-b beside demo-b, Demo beside demo: one is taken for the other
        raise HTTPException(409, detail=f"{body.name!r} looks like the deployment {alike!r}: choose a name that "
                            "cannot be taken for it")
    _check_gpus(svc, body.gpus)
    defaults = EngineSettings.model_construct(**initial_settings(svc.config.data_dir.resolve())).model_dump()
    values = merge_values(defaults, {**body.values, "served_model_name": body.name})
    writer = fleet.default.writer
    settings = writer.validate(values)  # InvalidSettingsError: 422 naming each field
    planner = svc.planner.scoped(DeploymentRef(id=-1, name=body.name, gpus=body.gpus))
    result = planner.check(settings)
    errors: list[dict[str, object]] = [{"type": "preflight", "loc": ["body", "values", f.field], "msg": f.message,
                                        "code": f.code, "fit": f.fit} for f in result.errors]
    if errors and not body.force:
        raise PreflightError(errors)
    try:
        row, rev = store.create(body.name, settings.model_dump(), author=actor(request), gpus=body.gpus,
                                enabled=body.enabled, note=body.note)
    except DeploymentExistsError as exc:
        raise HTTPException(409, detail=str(exc)) from None
    except DeploymentError as exc:
        raise HTTPException(422, detail=[{"loc": ["body", "name"], "msg": str(exc), "type": "value_error"}]) from None
    # taken before the answer: whoever created it opens it next (the registry's own loop may be a second away)
    anyio.from_thread.run(fleet.sync)
    note.after = {"model": settings.model, "gpus": body.gpus, "enabled": body.enabled, "revision": rev.id,
                  "forced": bool(errors)}
    assert row.id is not None and rev.id is not None
    warnings: list[dict[str, Any]] = [f.as_dict() for f in result.warnings] + [
        {**f.as_dict(), "forced": True} for f in result.errors]
    return CreatedDeploymentOut(
        id=row.id, name=row.name, default=False, enabled=row.enabled, gpus=body.gpus,
        created_at=_when(row.created_at), created_by=row.created_by, note=row.note, state="stopped",
        reason="created: the engine starts it within a second" if row.enabled else "created disabled",
        model=settings.model, running_revision=None, desired_revision=rev.id, instances=0, serving=0,
        revision=rev.id, warnings=json.loads(json.dumps(warnings, default=str)))


@router.get("/api/deployments/{name}", response_model=DeploymentOut, dependencies=access("viewer"))
def one(fleet: FleetDep, store: DeploymentsDep, name: str = NAME_PATH) -> DeploymentOut:
    runtime = _runtime(fleet, name)
    return deployment_out(fleet, runtime, store.by_id(runtime.ref.id))


@router.patch("/api/deployments/{name}", response_model=DeploymentOut,
              dependencies=access("operator", "deployments.update"))
def update(body: DeploymentPatch, request: Request, svc: ServicesDep, fleet: FleetDep, store: DeploymentsDep,
           note: NoteDep, name: str = NAME_PATH) -> DeploymentOut:
    """Enable or disable a deployment (disabled: its instances drain and stop, requests for it get 503), or place
    it on other GPUs (taken at its next start or apply)."""
    runtime = _runtime(fleet, name)
    name = runtime.name
    request.state.deployment = name
    if body.any_gpu and body.gpus is not None:
        raise HTTPException(422, detail=[{"loc": ["body", "gpus"], "msg": "any_gpu clears the placement: leave gpus "
                                          "out", "type": "value_error"}])
    _check_gpus(svc, body.gpus)
    gpus: list[int] | bool | None = None if body.any_gpu else (body.gpus if body.gpus is not None else False)
    prices: dict[str, float | None] = {f: getattr(body, f) for f in ("price_input_per_1k", "price_output_per_1k")
                                       if f in body.model_fields_set}
    try:
        before, after = store.update(name, enabled=body.enabled, gpus=gpus, prices=prices)
    except DeploymentError as exc:
        raise HTTPException(422, detail=[{"loc": ["body"], "msg": str(exc), "type": "value_error"}]) from None
    note.target = f"deployment {name}"
    note.before = {"enabled": before.enabled, "gpus": before.gpus, **{f: getattr(before, f) for f in prices}}
    note.after = {"enabled": after.enabled, "gpus": after.gpus, **prices}
    fleet.wake()  # the registry starts or stops it (within a second: it also sees changes made elsewhere)
    return deployment_out(fleet, runtime, after)


@router.get("/api/deployments/{name}/deletion", response_model=DeletionOut, dependencies=access("viewer"))
def deletion(store: DeploymentsDep, fleet: FleetDep, name: str = NAME_PATH) -> DeletionOut:
    """What deleting it would remove: shown by the console's confirmation before anything is deleted."""
    name = _runtime(fleet, name).name
    return DeletionOut(name=name, **store.summary(name).as_dict())


@router.delete("/api/deployments/{name}", response_model=DeletionOut,
               dependencies=access("operator", "deployments.delete"))
def delete(request: Request, store: DeploymentsDep, fleet: FleetDep, note: NoteDep, name: str = NAME_PATH,
           confirm: str = Query(max_length=128, description="the deployment's name again: nothing is deleted by a "
                                "request that does not repeat it")) -> DeletionOut:
    """Delete a deployment: its instances stop; its revisions, events, benchmarks, serving history and request
    ledger go (the audit keeps its records). The default deployment cannot be deleted (disable it)."""
    name = _runtime(fleet, name).name
    request.state.deployment = name
    note.target = f"deployment {name}"
    if confirm != name:
        raise HTTPException(422, detail=[{"loc": ["query", "confirm"], "msg": f"repeat the name ({name!r}) to "
                                          "delete it", "type": "value_error"}])
    try:
        deleted = store.delete(name)
    except DeploymentError as exc:
        raise HTTPException(409, detail=str(exc)) from None
    note.after = {"deleted": deleted.as_dict()}
    fleet.wake()
    return DeletionOut(name=name, **deleted.as_dict())


@router.get("/api/fleet", response_model=FleetOut, dependencies=access("viewer"))
def fleet_view(svc: ServicesDep, fleet: FleetDep) -> FleetOut:
    """The fleet at a glance: each node (the engine's host, or every node of the Ray cluster, the dead ones
    marked), its GPUs as its own sampler read them (or its host where it has none), and the instances on it."""
    return fleet.view(svc.sampler.latest)


@router.get("/api/models", response_model=ModelsListOut, dependencies=access("viewer"))
def models(svc: ServicesDep, fleet: FleetDep) -> ModelsListOut:
    """Models a deployment can be created from: folders with a config.json under the model roots (DATA_DIR/models,
    LLMOPS_MODEL_ROOTS) and hub models in the Hugging Face cache."""
    data_dir = svc.config.data_dir.resolve()
    roots = allowed_roots(data_dir, svc.config.model_roots)
    used: dict[str, list[str]] = {}
    for runtime in fleet.runtimes.values():
        rev = runtime.revisions.desired_revision()
        if rev is not None:
            used.setdefault(str(rev.values.get("model")), []).append(runtime.name)
    found: dict[str, AvailableModel] = {}
    cache = hf_hub_cache()
    for root in roots:
        if root == cache or not root.is_dir():
            continue
        for config in _limited(root.glob("*/config.json")):
            _add(found, str(config.parent), "local", config.parent, used)
    if cache.is_dir():
        for entry in _limited(cache.glob("models--*")):
            hub_id = entry.name.removeprefix("models--").replace("--", "/", 1)
            folder = find_model_config(hub_id, data_dir)
            if folder is not None:
                _add(found, hub_id, "hf-cache", folder, used)
    for value, names in used.items():  # what deployments serve, wherever it is
        if value not in found and value:
            found[value] = AvailableModel(value=value, source="local" if value.startswith("/") else "hf-cache",
                                          used_by=names)
    return ModelsListOut(models=sorted(found.values(), key=lambda m: m.value), roots=[str(r) for r in roots])


def _limited(paths: Any) -> list[Path]:
    out = []
    for path in paths:
        out.append(path)
        if len(out) >= MODELS_LISTED:
            break
    return out


def _add(found: dict[str, AvailableModel], value: str, source: str, folder: Path, used: dict[str, list[str]]) -> None:
    try:
        shape = load_shape(folder)
        arch, params, positions = ", ".join(shape.architectures) or None, shape.parameters(), \
            shape.max_position_embeddings
    except (KeyError, ValueError, TypeError, OSError):
        arch, params, positions = None, None, None
    found[value] = AvailableModel(value=value, source=source, architecture=arch, parameters=params,
                                  max_position_embeddings=positions, used_by=used.get(value, []))


# --- LoRA adapters --------------------------------------------------------------------------------------------------

ADAPTER_PATH = PathParam(min_length=1, max_length=128)
DAY_S = 86_400.0


def _adapters_out(fleet: Fleet, runtime: Runtime) -> list[AdapterOut]:
    """Each adapter of the deployment: what it is, where it is loaded, and its last day's requests (the ledger)."""
    served = fleet.adapters.of(runtime.ref.id)
    rows = sorted(served.rows.values(), key=lambda r: r.name)
    usage = fleet.adapters.store.usage(runtime.ref.id, [r.name for r in rows], time.time() - DAY_S)
    base = runtime.controller.served_model()
    out = []
    for row in rows:
        n, i, o, e = usage.get(row.name, (0, 0, 0, 0))
        out.append(AdapterOut(
            name=row.name, deployment=runtime.name, base=base, path=row.path, rank=row.rank, alpha=row.alpha,
            target_modules=list(row.target_modules), base_model=row.base_model, size_bytes=row.size_bytes,
            created_at=_when(row.created_at), created_by=row.created_by, listed=row.name in served.listed,
            loaded_on=sorted(inst for inst, names in served.loaded.items() if row.name in names),
            failure=served.failures.get(row.name), requests_24h=n, input_tokens_24h=i, output_tokens_24h=o,
            errors_24h=e))
    return out


@router.get("/api/deployments/{name}/adapters", response_model=list[AdapterOut], dependencies=access("viewer"))
def adapters(fleet: FleetDep, name: str = NAME_PATH) -> list[AdapterOut]:
    return _adapters_out(fleet, _runtime(fleet, name))


@router.post("/api/deployments/{name}/adapters", status_code=201, response_model=AdapterOut,
             dependencies=access("operator", "adapters.register"))
async def register_adapter(body: AdapterIn, request: Request, fleet: FleetDep, note: NoteDep,
                           name: str = NAME_PATH) -> AdapterOut:
    """Register a LoRA adapter: checked against the deployment's base model (its revision must have enable_lora,
    the rank within max_lora_rank, the target modules and shapes the base model's), then loaded on every instance
    that serves, without a restart; only then is it a model name on /v1. Refused: 422 naming the reason, nothing
    changed."""
    runtime = _runtime(fleet, name)
    request.state.deployment = runtime.name
    note.target = f"adapter {body.name[:128]} of deployment {runtime.name}"
    row = await fleet.adapters.register(runtime, body.name, body.path, actor(request))
    note.after = {"name": row.name, "path": row.path, "rank": row.rank, "target_modules": row.target_modules}
    return next(a for a in await anyio.to_thread.run_sync(_adapters_out, fleet, runtime) if a.name == row.name)


@router.delete("/api/deployments/{name}/adapters/{adapter}", response_model=OkOut,
               dependencies=access("operator", "adapters.remove"))
async def remove_adapter(request: Request, fleet: FleetDep, note: NoteDep, name: str = NAME_PATH,
                         adapter: str = ADAPTER_PATH) -> OkOut:
    """Remove an adapter: its name leaves /v1 at once, then each instance unloads it."""
    runtime = _runtime(fleet, name)
    request.state.deployment = runtime.name
    note.target = f"adapter {adapter} of deployment {runtime.name}"
    row = await fleet.adapters.remove(runtime, adapter)
    note.before = {"name": row.name, "path": row.path, "rank": row.rank}
    return OkOut(ok=True)
