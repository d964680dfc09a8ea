"""The adapters registered under each deployment, in the store (SQLite or PostgreSQL): they survive restarts, and
every instance started later serves them from its start."""

from __future__ import annotations

from sqlalchemy import Integer
from sqlalchemy import select as sql_select
from sqlalchemy.exc import IntegrityError
from sqlmodel import col, func, select

from engine.adapters.check import AdapterInfo
from engine.db import Database, LoraAdapter, RequestLog
from engine.errors import AdapterConflictError, AdapterNotFoundError


class AdapterStore:
    def __init__(self, db: Database) -> None:
        self.db = db

    def all(self) -> list[LoraAdapter]:
        with self.db.read() as s:
            return list(s.exec(select(LoraAdapter).order_by(col(LoraAdapter.id))).all())

    def add(self, deployment_id: int, name: str, info: AdapterInfo, by: str) -> LoraAdapter:
        row = LoraAdapter(deployment_id=deployment_id, name=name, path=str(info.path), rank=info.rank,
                          alpha=info.alpha, target_modules=list(info.target_modules), base_model=info.base_model,
                          size_bytes=info.size_bytes, created_by=by)
        try:
            with self.db.session() as s:
                s.add(row)
                s.flush()
        except IntegrityError:
            raise AdapterConflictError(f"an adapter named {name!r} is registered already") from None
        return row

    def delete(self, deployment_id: int, name: str) -> LoraAdapter:
        with self.db.session() as s:
            row = s.exec(select(LoraAdapter).where(LoraAdapter.deployment_id == deployment_id,
                                                   LoraAdapter.name == name)).first()
            if row is None:
                raise AdapterNotFoundError(f"no adapter {name!r} under this deployment")
            s.delete(row)
        return row

    def delete_deployment(self, deployment_id: int) -> None:
        with self.db.session() as s:
            for row in s.exec(select(LoraAdapter).where(LoraAdapter.deployment_id == deployment_id)).all():
                s.delete(row)

    def usage(self, deployment_id: int, names: list[str], since: float) -> dict[str, tuple[int, int, int, int]]:
        """Requests, input and output tokens and errors of each adapter since ``since`` (the request ledger)."""
        if not names:
            return {}
        errors = func.sum(func.coalesce((col(RequestLog.status) >= 400).cast(Integer), 0))
        with self.db.read() as s:
            rows = s.execute(
                sql_select(col(RequestLog.model), func.count(), func.coalesce(func.sum(RequestLog.input_tokens), 0),
                       func.coalesce(func.sum(RequestLog.output_tokens), 0), errors)
                .where(col(RequestLog.deployment_id) == deployment_id, col(RequestLog.model).in_(names),
                       col(RequestLog.ts) >= since)
                .group_by(RequestLog.model)).all()
        return {str(m): (int(n), int(i), int(o), int(e or 0)) for m, n, i, o, e in rows}
