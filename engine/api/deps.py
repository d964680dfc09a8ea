"""FastAPI dependencies: typed aliases over the services container, and what each route declares where it is
defined: the least role it needs (``Require``, enforced before the body is read by engine/api/gate.py) and the
name of its audit action (``Audited``)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Annotated, Any, NamedTuple

from fastapi import Depends, HTTPException, Request
from fastapi.routing import APIRoute
from pydantic import TypeAdapter, ValidationError

from engine.access import AuditNote, Auth, Principal, Role
from engine.api.services import Services
from engine.benchmarks import Benchmarks
from engine.capacity import Planner
from engine.deployments import DeploymentNotFoundError, DeploymentStore, Fleet, Runtime
from engine.errors import OutOfScopeError
from engine.events import EventLog
from engine.gpu import AlertEngine, Sampler, TelemetryStore
from engine.metrics import SeriesStore, ServingMonitor
from engine.prompts import PromptStore
from engine.revisions import RevisionStore, SettingsWriter
from engine.serving import Controller

# Every dependency here is async: FastAPI runs a sync one on the shared thread pool, and /healthz and /readyz must
# not wait for a thread of it (a flood that holds every thread would delay them).

def _services(request: Request) -> Services:
    svc: Services = request.app.state.services
    return svc


async def services(request: Request) -> Services:
    return _services(request)


def _part(name: str) -> Callable[[Request], Any]:
    """A dependency that hands a route one service of the container (overridable in tests)."""
    async def part(request: Request) -> Any:
        return getattr(_services(request), name)
    part.__name__ = name
    return part


def _runtime(request: Request) -> Runtime:
    name = request.path_params.get("deployment")
    try:
        found = _services(request).fleet.get(name)
    except DeploymentNotFoundError as exc:
        raise HTTPException(404, detail=str(exc)) from None
    request.state.deployment = found.name
    return found


async def runtime(request: Request) -> Runtime:
    """The deployment a request acts on: ``/api/deployments/{deployment}/…`` names it, today's ``/api/…`` routes
    act on the default one. Its name goes into the request's audit record."""
    return _runtime(request)


def _of_runtime(name: str) -> Callable[[Request], Any]:
    """A dependency that hands a route one part of the request's deployment (its controller, revisions, …)."""
    async def part(request: Request) -> Any:
        found = _runtime(request)
        value = getattr(found, name)
        if value is None:
            raise HTTPException(503, detail=f"deployment {found.name} has no {name} yet: try again")
        return value
    part.__name__ = name
    return part


ServicesDep = Annotated[Services, Depends(services)]
RuntimeDep = Annotated[Runtime, Depends(runtime)]
FleetDep = Annotated[Fleet, Depends(_part("fleet"))]
DeploymentsDep = Annotated[DeploymentStore, Depends(_part("deployments"))]
RevisionsDep = Annotated[RevisionStore, Depends(_of_runtime("revisions"))]
WriterDep = Annotated[SettingsWriter, Depends(_of_runtime("writer"))]
EventsDep = Annotated[EventLog, Depends(_of_runtime("events"))]
PromptsDep = Annotated[PromptStore, Depends(_part("prompts"))]
AuthDep = Annotated[Auth, Depends(_part("auth"))]
ControllerDep = Annotated[Controller, Depends(_of_runtime("controller"))]
PlannerDep = Annotated[Planner, Depends(_of_runtime("planner"))]
SamplerDep = Annotated[Sampler, Depends(_part("sampler"))]
TelemetryDep = Annotated[TelemetryStore, Depends(_part("telemetry"))]
AlertsDep = Annotated[AlertEngine, Depends(_part("alerts"))]
ServingDep = Annotated[ServingMonitor, Depends(_of_runtime("serving"))]
ServingHistoryDep = Annotated[SeriesStore, Depends(_part("serving_history"))]
InstanceHistoryDep = Annotated[SeriesStore, Depends(_part("instance_history"))]
ScalingHistoryDep = Annotated[SeriesStore, Depends(_part("scaling_history"))]
BenchmarksDep = Annotated[Benchmarks, Depends(_of_runtime("benchmarks"))]


@dataclass(frozen=True)
class Require:
    """The least role a route needs (None: open). The gate has checked it before the body was read; this
    dependency hands the route its principal."""

    role: Role | None

    async def __call__(self, request: Request) -> Principal | None:
        principal: Principal | None = getattr(request.state, "principal", None)
        if self.role is not None and principal is None:  # only a route the gate did not see can get here
            raise HTTPException(401, detail="a valid bearer token is needed")
        return principal


@dataclass(frozen=True)
class SendsTo:
    """What each of the engine's own /v1 routes declares: the deployment it sends to (a function of the services).
    A gateway key limited to other deployments gets OpenAI's 404, as the data path answers for its routes; the
    scope is checked here and there only (tests/service/test_key_scope.py walks every /v1 route)."""

    deployment: Callable[[Services], str]

    async def __call__(self, request: Request) -> str:
        name = self.deployment(_services(request))
        principal: Principal | None = getattr(request.state, "principal", None)
        if principal is not None and not principal.may_use(name):
            raise OutOfScopeError(name)
        return name


_BOOL: TypeAdapter[bool] = TypeAdapter(bool)


def _truthy(value: object) -> bool:
    try:
        return _BOOL.validate_python(value)
    except ValidationError:
        return False  # not a boolean at all: the settings' own validation says so


def admin_for_remote_code(request: Request, *values: dict[str, Any]) -> None:
    """``trust_remote_code`` runs the model repository's code as the engine's user, beside its data: turning it on
    (in a write, a rollback or a new deployment) takes an admin; an operator gets 403 saying so (issue 31)."""
    if not any(_truthy(v.get("trust_remote_code")) for v in values):
        return
    principal: Principal | None = getattr(request.state, "principal", None)
    if principal is None or principal.role != "admin":
        raise HTTPException(403, detail="trust_remote_code runs the model repository's own code as the engine's "
                            "user: only an admin may turn it on")


def default_deployment(svc: Services) -> str:
    """The deployment a /v1 route with no model of its own sends to."""
    return svc.fleet.default.name


@dataclass(frozen=True)
class Audited:
    """The audit action of a mutating route; the handler fills the note the record is made from.
    ``when_disk_low``: the route still works when the data dir's disk is nearly full (signing in and out: someone
    must be able to sign in and look; changes are refused with 507)."""

    action: str
    when_disk_low: bool = False

    async def __call__(self, request: Request) -> AuditNote:
        return _note(request)


def _note(request: Request) -> AuditNote:
    note: AuditNote | None = getattr(request.state, "audit", None)
    if note is None:
        note = AuditNote()
        request.state.audit = note
    return note


def access(role: Role | None, action: str | None = None, *, when_disk_low: bool = False) -> list[Any]:
    """A route's declaration: ``dependencies=access("operator", "settings.write")``."""
    return [Depends(Require(role))] + ([Depends(Audited(action, when_disk_low))] if action else [])


class RouteMeta(NamedTuple):
    declared: bool  # the route declares its role (None included)
    role: Role | None
    action: str | None  # its audit action
    when_disk_low: bool  # it works when the disk is nearly full
    scoped: bool = False  # it declares the deployment it sends to (SendsTo): a /v1 route


def route_meta(route: APIRoute) -> RouteMeta:
    """What a route declares, read from its dependencies."""
    declared, role, action, low, scoped = False, None, None, False, False
    for dep in route.dependant.dependencies:
        if isinstance(dep.call, Require):
            declared, role = True, dep.call.role
        elif isinstance(dep.call, Audited):
            action, low = dep.call.action, dep.call.when_disk_low
        elif isinstance(dep.call, SendsTo):
            scoped = True
    return RouteMeta(declared, role, action, low, scoped)


async def principal_of(request: Request) -> Principal:
    principal: Principal | None = getattr(request.state, "principal", None)
    if principal is None:
        raise HTTPException(401, detail="a valid bearer token is needed")
    return principal


def actor(request: Request) -> str:
    """Who acts: the authenticated principal (no body field or header can claim another name)."""
    principal: Principal | None = getattr(request.state, "principal", None)
    return principal.name if principal is not None else "api"


async def audit_note(request: Request) -> AuditNote:
    """The note of this request's audit record (the route's ``Audited`` dependency made it)."""
    return _note(request)


PrincipalDep = Annotated[Principal, Depends(principal_of)]
NoteDep = Annotated[AuditNote, Depends(audit_note)]
