"""Reaching a test's database the way an operator's SQL client would: a plain connection of its own (no engine
locks), in autocommit, to the SQLite file or the PostgreSQL database the engine uses."""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from sqlalchemy import Connection, create_engine, text

from engine.config import AppConfig
from engine.db import Database, database_url


def target_of(where: Database | AppConfig | Path | str) -> Path | str:
    if isinstance(where, Database):
        return where.path if where.path is not None else where.url.render_as_string(hide_password=False)
    if isinstance(where, AppConfig):
        return where.database
    return where


@contextmanager
def sql_client(where: Database | AppConfig | Path | str) -> Iterator[Connection]:
    """An autocommit connection to the database (each statement its own transaction)."""
    engine = create_engine(database_url(target_of(where)), isolation_level="AUTOCOMMIT")
    try:
        with engine.connect() as conn:
            yield conn
    finally:
        engine.dispose()


def sql(where: Database | AppConfig | Path | str, statement: str, params: Mapping[str, Any] | None = None
        ) -> list[tuple[Any, ...]]:
    """One statement through sql_client; its rows (empty for a statement without)."""
    with sql_client(where) as conn:
        result = conn.execute(text(statement), dict(params or {}))
        return [tuple(r) for r in result] if result.returns_rows else []


def dialect(where: Database | AppConfig | Path | str) -> str:
    return database_url(target_of(where)).get_backend_name()


def row_counts(where: Database | AppConfig | Path | str, tables: list[str]) -> dict[str, int]:
    with sql_client(where) as conn:
        return _counted(conn, tables)


def _counted(conn: Connection, tables: list[str]) -> dict[str, int]:
    return {t: int(conn.execute(text(f'SELECT count(*) FROM "{t}"')).scalar_one()) for t in tables}


class RowCounter:
    """Row counts of ``tables`` on one autocommit connection kept open until ``close``: for a test that counts
    before and after each of hundreds of requests (a connection of its own each time, PostgreSQL's above all, was
    two thirds of the fuzzer's time on it)."""

    def __init__(self, where: Database | AppConfig | Path | str, tables: list[str]) -> None:
        self.tables = tables
        self._engine = create_engine(database_url(target_of(where)), isolation_level="AUTOCOMMIT")
        self._conn = self._engine.connect()

    def __call__(self) -> dict[str, int]:
        return _counted(self._conn, self.tables)

    def close(self) -> None:
        self._conn.close()
        self._engine.dispose()
