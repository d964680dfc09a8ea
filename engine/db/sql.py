"""The few SQL expressions that SQLite and PostgreSQL spell differently, written once for both.

A store that needs one of them takes it from here instead of writing a dialect's function by name
(``json_extract``, ``julianday``): the compiler picks the spelling of the database it runs on.
"""

from __future__ import annotations

from typing import Any

from sqlalchemy import Dialect, Float, Integer, String, TypeDecorator
from sqlalchemy.ext.compiler import compiles
from sqlalchemy.sql.elements import ColumnElement
from sqlalchemy.sql.functions import FunctionElement


class epoch_now(FunctionElement[float]):
    """The current time in seconds since the epoch (what ``time.time()`` gives), as a column default."""

    type = Float()
    inherit_cache = True


@compiles(epoch_now, "sqlite")
def _epoch_now_sqlite(_: epoch_now, __: Any, **___: Any) -> str:
    return "((julianday('now') - 2440587.5) * 86400.0)"


@compiles(epoch_now, "postgresql")
def _epoch_now_postgresql(_: epoch_now, __: Any, **___: Any) -> str:
    return "(extract(epoch from now())::double precision)"


class floor_int(FunctionElement[int]):
    """The largest integer not above a non-negative number (SQLite has no floor() in every build; PostgreSQL's
    CAST to integer rounds instead of truncating, and its integer stops at 2**31)."""

    type = Integer()
    inherit_cache = True


@compiles(floor_int, "sqlite")
def _floor_sqlite(element: floor_int, compiler: Any, **kw: Any) -> str:
    return f"CAST({compiler.process(element.clauses, **kw)} AS INTEGER)"


@compiles(floor_int, "postgresql")
def _floor_postgresql(element: floor_int, compiler: Any, **kw: Any) -> str:
    return f"floor({compiler.process(element.clauses, **kw)})"


def json_true(column: Any, key: str) -> ColumnElement[bool]:
    """``column[key]`` of a JSON column is true (``json_extract(...) = 1`` on SQLite, ``(... ->> key)::boolean``
    on PostgreSQL)."""
    element: ColumnElement[bool] = column[key].as_boolean() == True  # noqa: E712 - SQL, not Python
    return element


def portable(value: str | None, dialect: str) -> str | None:
    """A value to look up as PortableString stores it: a filter with a NUL, which PostgreSQL refuses in any text
    parameter, searches for the U+FFFD it was stored as (LIKE patterns and casts bind plain strings)."""
    if value is not None and dialect == "postgresql" and "\x00" in value:
        return value.replace("\x00", "\ufffd")
    return value


class PortableString(TypeDecorator[str]):
    """A text column. PostgreSQL cannot store NUL (U+0000) in text, which SQLite and Python can: there it is kept as
    U+FFFD (the replacement character), in what is written and in what is looked up alike, so that a NUL sent to
    the API (a token's name, a path the audit records) is stored, not a failed write or a lost audit record."""

    impl = String
    cache_ok = True

    def process_bind_param(self, value: str | None, dialect: Dialect) -> str | None:
        if value is not None and dialect.name == "postgresql" and "\x00" in value:
            return value.replace("\x00", "\ufffd")
        return value
