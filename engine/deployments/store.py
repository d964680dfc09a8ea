"""Deployments in the database: a name (the ``model`` clients ask for), whether it is enabled, where it runs.

Each deployment has its own revision history (engine/revisions, scoped by ``deployment_id``). The first one, id 1,
is the *default* deployment: today's routes (``/api/settings``, ``/api/status``, …) act on it, and a data dir
written before deployments existed is all its. It can be disabled, never deleted.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from sqlalchemy import delete, func, text
from sqlmodel import col, select

from engine.db import (
    DEFAULT_DEPLOYMENT,
    INSTANCE_MINUTE,
    INSTANCE_RAW,
    SCALING_MINUTE,
    SCALING_RAW,
    SERVING_MINUTE,
    SERVING_RAW,
    BenchmarkRun,
    Database,
    Deployment,
    Event,
    RequestLog,
    Revision,
)
from engine.errors import EngineError
from engine.revisions.settings import SERVED_NAME

MAX_DEPLOYMENTS = 64  # a host (or a small fleet) serves a handful; the bound keeps an API loop from filling the table


class DeploymentError(EngineError):
    """A deployment could not be created, changed or deleted; nothing was changed."""


class DeploymentNotFoundError(DeploymentError):
    def __init__(self, name: str) -> None:
        self.name = name
        super().__init__(f"no deployment {name[:130]!r}: GET /api/deployments lists them")


class DeploymentExistsError(DeploymentError):
    pass


def is_id(text: str) -> bool:
    """Whether a path segment is a deployment's id (ASCII digits, at most 15 of them), not its name."""
    return text.isascii() and text.isdigit() and len(text) <= 15


def check_name(name: str) -> str:
    """A deployment's name is the ``model`` clients send and vLLM's --served-model-name: the same rule."""
    if not SERVED_NAME.fullmatch(name) or name.startswith("-"):
        raise DeploymentError("name: use 1-128 letters, digits and . _ : / -, not starting with -")
    if is_id(name):
        raise DeploymentError("name: not only digits (a number in a path is a deployment's id)")
    return name


@dataclass(frozen=True)
class Deleted:
    """What deleting a deployment removed (the audit keeps its record of all of it)."""

    revisions: int
    events: int
    benchmarks: int
    requests: int

    def as_dict(self) -> dict[str, int]:
        return {"revisions": self.revisions, "events": self.events, "benchmarks": self.benchmarks,
                "requests": self.requests}


class DeploymentStore:
    def __init__(self, db: Database) -> None:
        self.db = db

    def ensure_default(self, name: str) -> bool:
        """Create the default deployment (id 1) on a data dir that has none; True when it did."""
        with self.db.session() as s:
            if s.get(Deployment, DEFAULT_DEPLOYMENT) is not None:
                return False
            s.add(Deployment(id=DEFAULT_DEPLOYMENT, name=check_name(name), created_by="engine",
                             note="the default deployment"))
            s.flush()
            if s.get_bind().dialect.name == "postgresql":  # an id given by hand does not move the sequence on
                s.exec(text("SELECT setval(pg_get_serial_sequence('deployment', 'id'), "  # type: ignore[call-overload]
                            "(SELECT MAX(id) FROM deployment))"))
            return True

    def all(self) -> Sequence[Deployment]:
        with self.db.read() as s:
            return s.exec(select(Deployment).order_by(col(Deployment.id))).all()

    def get(self, name: str) -> Deployment:
        with self.db.read() as s:
            row = s.exec(select(Deployment).where(Deployment.name == name)).first()
            if row is None and name.isdigit():
                row = s.get(Deployment, int(name))
        if row is None:
            raise DeploymentNotFoundError(name)
        return row

    def by_id(self, deployment_id: int) -> Deployment | None:
        with self.db.read() as s:
            return s.get(Deployment, deployment_id)

    def create(self, name: str, values: dict[str, Any], *, author: str, gpus: list[int] | None = None,
               enabled: bool = True, note: str = "") -> tuple[Deployment, Revision]:
        """A new deployment and its first revision (``values``, already validated), in one transaction."""
        check_name(name)
        with self.db.session() as s:
            if s.exec(select(Deployment.id).where(Deployment.name == name)).first() is not None:
                raise DeploymentExistsError(f"a deployment named {name!r} exists")
            count = s.exec(select(func.count()).select_from(Deployment)).one()
            if count >= MAX_DEPLOYMENTS:
                raise DeploymentError(f"{count} deployments exist, the most this engine keeps ({MAX_DEPLOYMENTS}); "
                                      "delete one first")
            row = Deployment(name=name, enabled=enabled, gpus=gpus, created_by=author, note=note)
            s.add(row)
            s.flush()
            assert row.id is not None
            rev = Revision(deployment_id=row.id, values={**values, "served_model_name": name}, author=author,
                           note=note or f"deployment {name} created")
            s.add(rev)
            s.flush()
            return row, rev

    def update(self, name: str, *, enabled: bool | None = None, gpus: list[int] | bool | None = False,
               rename: str | None = None, prices: dict[str, float | None] | None = None
               ) -> tuple[Deployment, Deployment]:
        """Change a deployment; (before, after). ``gpus=False`` leaves the placement alone, None makes it any;
        ``prices``: price_input_per_1k and price_output_per_1k to set (None clears)."""
        with self.db.session() as s:
            row = s.exec(select(Deployment).where(Deployment.name == name)).first()
            if row is None:
                raise DeploymentNotFoundError(name)
            before = row.model_copy()
            if enabled is not None:
                row.enabled = enabled
            if gpus is not False:
                row.gpus = gpus if isinstance(gpus, list) else None
            for field_name, price in (prices or {}).items():
                if field_name in ("price_input_per_1k", "price_output_per_1k"):
                    setattr(row, field_name, price)
            if rename is not None and rename != row.name:
                check_name(rename)
                if s.exec(select(Deployment.id).where(Deployment.name == rename)).first() is not None:
                    raise DeploymentExistsError(f"a deployment named {rename!r} exists")
                row.name = rename
            s.add(row)
            return before, row

    def delete(self, name: str) -> Deleted:
        """Remove a deployment and what is its alone: revisions, events, benchmark runs, ledger rows, serving
        history. The audit trail is append-only and keeps every record of it."""
        with self.db.session() as s:
            row = s.exec(select(Deployment).where(Deployment.name == name)).first()
            if row is None:
                raise DeploymentNotFoundError(name)
            if row.id == DEFAULT_DEPLOYMENT:
                raise DeploymentError(f"{name!r} is the default deployment (today's /api routes act on it): disable "
                                      "it instead")
            revisions = list(s.exec(select(Revision.id).where(Revision.deployment_id == row.id)).all())
            counts = Deleted(
                revisions=len(revisions),
                events=_count(s, Event, col(Event.deployment_id) == row.id),
                benchmarks=_count(s, BenchmarkRun, col(BenchmarkRun.deployment_id) == row.id),
                requests=_count(s, RequestLog, col(RequestLog.deployment_id) == row.id))
            for table in (SERVING_RAW, SERVING_MINUTE):
                if revisions:
                    s.exec(delete(table).where(table.c.revision.in_(revisions)))
            for table in (INSTANCE_RAW, INSTANCE_MINUTE):
                s.exec(delete(table).where(table.c.instance.startswith(f"{row.id}/", autoescape=True)))
            for table in (SCALING_RAW, SCALING_MINUTE):
                s.exec(delete(table).where(table.c.deployment == row.id))
            for model, column in ((Event, Event.deployment_id), (BenchmarkRun, BenchmarkRun.deployment_id),
                                  (RequestLog, RequestLog.deployment_id), (Revision, Revision.deployment_id)):
                s.exec(delete(model).where(col(column) == row.id))
            s.delete(row)
            return counts

    def summary(self, name: str) -> Deleted:
        """What deleting it would remove, for the confirmation that names it."""
        row = self.get(name)
        with self.db.read() as s:
            return Deleted(revisions=_count(s, Revision, col(Revision.deployment_id) == row.id),
                           events=_count(s, Event, col(Event.deployment_id) == row.id),
                           benchmarks=_count(s, BenchmarkRun, col(BenchmarkRun.deployment_id) == row.id),
                           requests=_count(s, RequestLog, col(RequestLog.deployment_id) == row.id))


def _count(s: Any, model: Any, where: Any) -> int:
    return int(s.exec(select(func.count()).select_from(model).where(where)).one())
